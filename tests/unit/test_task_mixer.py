"""Tasks at run time: the mixer's shares, passes and resume, and `load_tasks` on real configs."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from mogrpo.config import TaskConfig, load_config
from mogrpo.data.schema import Example
from mogrpo.rewards.base import BUILTIN_REWARDS
from mogrpo.tasks.task import Task, TaskMixer, load_tasks


def make_task(name: str, size: int, weight: float = 1.0) -> Task:
    examples = [
        Example(f"{name} prompt {i}", {"i": i}, f"{name}.jsonl:{i + 1}") for i in range(size)
    ]
    config = TaskConfig(data="x.jsonl", rewards=[{"fn": "mc_correct"}], weight=weight)
    return Task(name, config, examples, [])


def draws(mixer: TaskMixer, steps: int, n: int) -> list[list[tuple[int, str]]]:
    """`steps` batches of `n` as (task index, example source), comparable across mixers."""
    return [[(t, ex.source) for t, ex in mixer.next_batch(n)] for _ in range(steps)]


@pytest.mark.parametrize(
    ("weights", "n", "expected"),
    [
        ((1, 1), 4, [2, 2]),
        ((3, 1), 4, [3, 1]),
        ((1.5, 0.5), 4, [3, 1]),  # only the ratio matters
        ((1, 2, 1), 4, [1, 2, 1]),
        ((2, 1), 6, [4, 2]),
    ],
)
def test_every_step_holds_exact_shares(weights, n, expected):
    tasks = [make_task(f"t{i}", 5, w) for i, w in enumerate(weights)]
    mixer = TaskMixer(tasks, seed=0)
    for _ in range(25):
        counts = Counter(t for t, _ in mixer.next_batch(n))
        assert [counts[i] for i in range(len(tasks))] == expected


def test_shares_are_exact_over_any_window_of_slots():
    # 3:1 drawn one prompt at a time: every 4 consecutive slots hold 3 + 1, wherever they start.
    mixer = TaskMixer([make_task("a", 5, 3), make_task("b", 5, 1)], seed=0)
    slots = [mixer.next_batch(1)[0][0] for _ in range(40)]
    for start in range(len(slots) - 4):
        assert sorted(slots[start: start + 4]) == [0, 0, 0, 1], slots


def test_batch_is_grouped_by_task_in_task_order():
    tasks = [make_task("a", 4, 1), make_task("b", 4, 2), make_task("c", 4, 1)]
    mixer = TaskMixer(tasks, seed=0)
    for _ in range(10):
        batch = mixer.next_batch(8)
        indices = [t for t, _ in batch]
        assert indices == [0, 0, 1, 1, 1, 1, 2, 2]
        for t, example in batch:
            assert example.source.startswith(tasks[t].name + ".jsonl:")


def test_each_pass_draws_every_example_once_before_repeats():
    sizes = {"a": 3, "b": 7}
    tasks = [make_task(name, size) for name, size in sizes.items()]
    mixer = TaskMixer(tasks, seed=0)
    drawn: dict[int, list[str]] = {0: [], 1: []}
    for batch in draws(mixer, 21, 2):  # 21 prompts per task: 7 passes of a, 3 passes of b
        for t, source in batch:
            drawn[t].append(source)
    for t, task in enumerate(tasks):
        everything = sorted(ex.source for ex in task.train)
        size = len(everything)
        passes = [drawn[t][i: i + size] for i in range(0, len(drawn[t]), size)]
        assert len(passes) == 21 // size
        for one_pass in passes:
            assert sorted(one_pass) == everything


def test_passes_are_reshuffled_and_deterministic_in_the_seed():
    def first_passes(seed: int) -> list[str]:
        mixer = TaskMixer([make_task("a", 10)], seed=seed)
        return [source for batch in draws(mixer, 5, 4) for _, source in batch]

    order = first_passes(0)
    first, second = order[:10], order[10:20]
    assert sorted(first) == sorted(second)
    assert first != second, "the second pass must be a new shuffle, not a replay"
    assert first_passes(0) == order
    assert first_passes(1)[:10] != first
    assert first != sorted(first, key=lambda s: int(s.rsplit(":", 1)[1]))  # shuffled at all


def test_resume_from_state_dict_reproduces_the_next_batches():
    def tasks() -> list[Task]:
        return [make_task("a", 5, 0.7), make_task("b", 7, 0.3), make_task("c", 3, 1.0)]

    uninterrupted = TaskMixer(tasks(), seed=3)
    draws(uninterrupted, 7, 3)  # mid-pass for every task, past a pass boundary for some
    state = json.loads(json.dumps(uninterrupted.state_dict()))
    assert any(e >= 1 for e in state["epoch"]) and any(p > 0 for p in state["position"])

    resumed = TaskMixer(tasks(), seed=3)
    resumed.load_state_dict(state)
    assert draws(resumed, 12, 3) == draws(uninterrupted, 12, 3)


def test_fresh_mixer_without_state_does_not_resume():
    # The resume test above is only meaningful if the state actually changes what is drawn.
    first = TaskMixer([make_task("a", 5, 0.7), make_task("b", 7, 0.3)], seed=3)
    draws(first, 4, 3)
    fresh = TaskMixer([make_task("a", 5, 0.7), make_task("b", 7, 0.3)], seed=3)
    assert draws(fresh, 5, 3) != draws(first, 5, 3)


def write_mc_jsonl(path: Path, n: int) -> Path:
    rows = [
        {"question": f"q{i}?", "option_A": "yes", "option_B": "no", "correct_answer": "AB"[i % 2]}
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_load_tasks_splits_and_resolves_rewards(tmp_path: Path):
    data = write_mc_jsonl(tmp_path / "mine.jsonl", 6)
    held_out = write_mc_jsonl(tmp_path / "held_out.jsonl", 3)
    config, _ = load_config(None, [], environ={}, base={
        "seed": 5,
        "model": {"name_or_path": "some/model"},
        "tasks": {
            "fairness": {
                "data": "builtin:bias_probe?size=20", "eval_size": 4,
                "rewards": [{"fn": "mc_correct", "weight": 2.0}, {"fn": "format", "name": "fmt"}],
            },
            "mine": {"data": str(data), "eval_size": 2, "rewards": ["mc_correct"], "weight": 3},
            "separate": {"data": str(data), "eval_data": str(held_out), "rewards": ["format"]},
            "no_eval": {"data": str(data), "rewards": ["mc_correct"]},
        },
    })
    fairness, mine, separate, no_eval = load_tasks(config)

    assert [t.name for t in (fairness, mine, separate, no_eval)] == list(config.tasks)
    assert (len(fairness.train), len(fairness.eval)) == (16, 4)
    assert (len(mine.train), len(mine.eval)) == (4, 2)
    assert (len(separate.train), len(separate.eval)) == (6, 3)
    assert (len(no_eval.train), no_eval.eval) == (6, [])

    # The split holds out rows, it does not duplicate or lose any.
    sources = sorted(ex.source for ex in mine.train + mine.eval)
    assert sources == [f"{data}:{row}" for row in range(1, 7)]
    assert {ex.source for ex in separate.eval} == {f"{held_out}:{row}" for row in (1, 2, 3)}
    assert fairness.train[0].source.startswith("builtin:bias_probe?size=20:")
    assert fairness.train[0].columns["correct_answer"] in "ABCD"

    assert fairness.reward_labels == ["mc_correct", "fmt"]
    assert fairness.reward_weights(0) == [2.0, 1.0]
    assert [fn for _, fn, _ in fairness.reward_fns] == [
        BUILTIN_REWARDS["mc_correct"], BUILTIN_REWARDS["format"],
    ]
    assert mine.config.weight == 3


def test_load_tasks_builtin_data_is_deterministic_in_the_run_seed():
    def train_questions(seed: int) -> list[str]:
        config, _ = load_config(None, [], environ={}, base={
            "seed": seed,
            "model": {"name_or_path": "some/model"},
            "tasks": {"f": {"data": "builtin:grounded_qa?size=10", "eval_size": 2,
                            "rewards": ["mc_correct"]}},
        })
        return [ex.columns["question"] for ex in load_tasks(config)[0].train]

    assert train_questions(0) == train_questions(0)
    assert train_questions(0) != train_questions(1)


def test_a_curriculum_weight_of_zero_is_never_drawn_and_shares_restart():
    mixer = TaskMixer([make_task("a", 10), make_task("b", 10)], seed=0)
    draws(mixer, 3, 3)  # leaves the round-robin credit uneven
    mixer.set_weights([0.0, 1.0])
    assert {t for batch in draws(mixer, 5, 4) for t, _ in batch} == {1}
    mixer.set_weights([1.0, 3.0])
    counts = Counter(t for t, _ in mixer.next_batch(4))
    assert counts == {0: 1, 1: 3}  # exact shares from the first batch of the new stage
    resumed = TaskMixer([make_task("a", 10), make_task("b", 10)], seed=0)
    resumed.load_state_dict(json.loads(json.dumps(mixer.state_dict())))
    assert draws(resumed, 3, 4) == draws(mixer, 3, 4)
