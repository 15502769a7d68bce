"""TRL's reward contract: keyword calls, any signature TRL accepts, chat completions, async
functions run concurrently, config-time errors that name what a function lacks, and TRL's own
`trl.rewards` functions running unchanged."""

from __future__ import annotations

import asyncio
import math
import os
import threading
import time

import pytest
import torch

from mogrpo.data.schema import Example
from mogrpo.errors import RewardError
from mogrpo.rewards.base import (
    RewardLog,
    TrainerState,
    as_completions,
    check_reward_call,
    score,
    score_examples,
)
from multiproc import in_forked_child

CHAT = [{"role": "user", "content": "What is 1/3 + 1/3?"}]


def chat_examples(solutions: list[str]) -> list[Example]:
    return [Example(list(CHAT), {"solution": s}, f"data.jsonl:{i + 1}")
            for i, s in enumerate(solutions)]


def ids(*rows: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Right-padded [B, C] ids and the row lengths."""
    width = max(len(r) for r in rows)
    return torch.tensor([r + [0] * (width - len(r)) for r in rows]), [len(r) for r in rows]


# --- signatures TRL accepts ---------------------------------------------------------------------


def think_format(completions, **kwargs):
    return [1.0 if c[0]["content"].startswith("<think>") else 0.0 for c in completions]


def accuracy(completions, solution, **kwargs):
    return [1.0 if s in c[0]["content"] else 0.0 for c, s in zip(completions, solution, strict=True)]


def test_completions_only_and_named_column_signatures_are_called_by_keyword():
    examples = chat_examples(["2/3", "2/3"])
    completion_ids, lengths = ids([5, 6, 7], [8])
    values = score_examples(
        [("think", think_format, {}), ("accuracy", accuracy, {})], examples,
        ["<think>add</think> 2/3", "1/2"], completion_ids, lengths, [False, True])
    assert values.tolist() == [[1.0, 1.0], [0.0, 0.0]]


def test_chat_prompts_get_message_completions_and_text_prompts_get_strings():
    assert as_completions([CHAT, "plain"], ["a", "b"]) == [
        [{"role": "assistant", "content": "a"}], "b"]


def test_every_trl_argument_arrives_by_keyword():
    seen: dict = {}

    def spy(prompts, completions, completion_ids, trainer_state, log_extra, log_metric,
            solution, completion_lengths, truncated):
        seen.update(locals())
        return [0.0] * len(completions)

    completion_ids, lengths = ids([5, 6, 7], [8])
    state = TrainerState(global_step=3, max_steps=10, epoch=1.25)
    score_examples([("spy", spy, {})], chat_examples(["x", "y"]), ["a", "b"], completion_ids,
                   lengths, [True, False], trainer_state=state)
    assert seen["prompts"] == [CHAT, CHAT]
    assert seen["completions"] == [[{"role": "assistant", "content": "a"}],
                                   [{"role": "assistant", "content": "b"}]]
    assert seen["completion_ids"] == [[5, 6, 7], [8]]  # unpadded, as in TRL
    assert (seen["trainer_state"].global_step, seen["trainer_state"].max_steps,
            seen["trainer_state"].epoch) == (3, 10, 1.25)
    assert seen["solution"] == ["x", "y"]
    assert seen["completion_lengths"] == [3, 1] and seen["truncated"] == [True, False]
    assert callable(seen["log_extra"]) and callable(seen["log_metric"])


def test_function_without_kwargs_gets_only_what_it_names():
    def strict(completions, solution):
        return [float(len(c)) for c in completions]

    got = score([("strict", strict, {})], ["p", "p"], ["ab", "c"], {"solution": ["1", "2"],
                                                                      "other": [0, 0]})
    assert got[:, 0].tolist() == [2.0, 1.0]


def test_callable_object_and_trainer_state_shaping():
    class Ramp:
        """A reward shaped by training progress, as a callable object (TRL ships such)."""

        def __call__(self, completions, trainer_state, **kwargs):
            return [trainer_state.global_step / trainer_state.max_steps] * len(completions)

    state = TrainerState(global_step=5, max_steps=20)
    got = score([("ramp", Ramp(), {})], ["p"], ["c"], {}, trainer_state=state)
    assert got.tolist() == [[0.25]]


def test_log_extra_and_log_metric_are_collected_per_reward():
    def logs(completions, log_extra, log_metric, **kwargs):
        log_extra("parsed", [c.upper() for c in completions])
        log_metric("hits", 2.0)
        return [1.0] * len(completions)

    log = RewardLog()
    score([("acc", logs, {})], ["p", "p"], ["a", "b"], {}, log=log)
    assert log.extra == {"parsed": ["A", "B"]}
    assert log.metrics == {"acc/hits": [2.0]}


# --- async ---------------------------------------------------------------------------------


def test_async_functions_are_awaited_concurrently():
    # `first` only finishes once `second` has started: run one after the other, it would time out.
    started = None

    async def first(completions, **kwargs):
        await asyncio.wait_for(started.wait(), timeout=5)
        return [1.0] * len(completions)

    async def second(completions, **kwargs):
        started.set()
        await asyncio.sleep(0.2)
        return [2.0] * len(completions)

    def sync(completions, **kwargs):
        return [3.0] * len(completions)

    async def make_event():
        return asyncio.Event()

    from mogrpo.user_loop import user_loop

    started = asyncio.run_coroutine_threadsafe(make_event(), user_loop()).result()
    t0 = time.perf_counter()
    got = score([("first", first, {}), ("sync", sync, {}), ("second", second, {})],
                ["p", "p"], ["a", "b"], {})
    assert got.tolist() == [[1.0, 3.0, 2.0]] * 2
    assert time.perf_counter() - t0 < 4


def test_async_failure_names_the_function():
    async def broken(completions, **kwargs):
        raise TimeoutError("judge timed out")

    with pytest.raises(RewardError, match=r"reward 'broken' raised TimeoutError: judge timed out"):
        score([("broken", broken, {})], ["p"], ["a"], {})


def test_a_failing_sync_function_cancels_the_async_ones_already_started():
    finished = threading.Event()

    async def paid(completions, **kwargs):  # an API judge: each call costs money
        await asyncio.sleep(0.3)
        finished.set()
        return [1.0] * len(completions)

    def broken(completions, **kwargs):
        raise ValueError("bad column")

    with pytest.raises(RewardError, match=r"reward 'broken' raised ValueError: bad column"):
        score([("paid", paid, {}), ("broken", broken, {})], ["p"], ["a"], {})
    assert not finished.wait(1.0)  # not left running after the step failed


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_async_functions_work_in_a_forked_child():
    # the child inherits the parent's loop object but not the thread that runs it
    async def one(completions, **kwargs):
        return [1.0] * len(completions)

    assert score([("one", one, {})], ["p"], ["a"], {}).tolist() == [[1.0]]
    answer = in_forked_child(
        lambda: repr(score([("one", one, {})], ["p", "p"], ["a", "b"], {}).tolist()))
    assert answer == "[[1.0], [1.0]]"


def test_async_function_works_inside_a_running_event_loop():
    # A notebook runs an event loop in the main thread; asyncio.run would refuse there.
    async def fine(completions, **kwargs):
        await asyncio.sleep(0)
        return [None] * len(completions)

    async def from_a_notebook_cell():
        return score([("fine", fine, {})], ["p"], ["a"], {})

    got = asyncio.run(from_a_notebook_cell())
    assert math.isnan(got.item())


# --- config-time errors ----------------------------------------------------------------------


def test_missing_column_is_named_before_training():
    with pytest.raises(RewardError) as err:
        check_reward_call("accuracy", accuracy, {}, ["question", "answer"],
                          where="tasks.math.rewards.0")
    assert str(err.value).startswith(
        "tasks.math.rewards.0: reward 'accuracy' accuracy(completions, solution, **kwargs) needs "
        "'solution', which is neither an argument the trainer passes (prompts, completions, "
        "completion_ids, trainer_state, log_extra, log_metric, completion_lengths, truncated) nor "
        "a column of the task's data (question, answer) nor one of its kwargs")


def test_positional_names_get_the_keyword_hint():
    def old_style(p, c, **kw):
        return []

    with pytest.raises(RewardError, match=r"needs 'p'.*name the parameters `prompts` and "
                                          r"`completions`"):
        check_reward_call("old", old_style, {}, [], where="tasks.t.rewards.1")


def test_kwarg_the_function_cannot_take():
    def strict(completions):
        return []

    with pytest.raises(RewardError, match=r"strict\(completions\) has no parameter 'bonus'"):
        check_reward_call("strict", strict, {"bonus": 1}, [], where="tasks.t.rewards.0")


def test_a_kwarg_a_built_in_reward_does_not_name_is_an_error():
    """A built-in's **_ takes the trainer's arguments and the columns: `target` (for
    `target_length`) was dropped silently and the penalty ran at its default, 64."""
    from mogrpo.rewards.builtin import length_penalty

    with pytest.raises(RewardError) as err:
        check_reward_call("length_penalty", length_penalty, {"target": 5}, ["solution"],
                          where="tasks.t.rewards.1")
    assert str(err.value) == (
        "tasks.t.rewards.1: kwarg 'target' is not an option of the built-in reward "
        "'length_penalty'; did you mean 'target_length'? its options: max_length, target_length")
    check_reward_call("length_penalty", length_penalty, {"target_length": 5}, ["solution"],
                      where="tasks.t.rewards.1")


@pytest.mark.parametrize(("fn", "kwargs", "message"), [
    ("format", {"pattern": "<answer>(["}, "format: pattern '<answer>([' is not a valid regular"),
    ("length_penalty", {"target_length": 60, "max_length": 40},
     "length_penalty: need 0 <= target_length < max_length, got target_length=60, max_length=40"),
    ("length_penalty", {"target_length": "60"},
     "length_penalty: target_length='60' and max_length=None must be numbers"),
    ("code_tests", {"language": "rust"}, "code_tests runs Python only, got language 'rust'"),
    ("code_tests", {"isolation": "strict"}, "sandbox isolation 'strict': use one of"),
    ("verilog_tests", {"compile_bonus": 1.5}, "verilog_tests: compile_bonus 1.5 must be in [0, 1)"),
])
def test_a_built_in_option_that_can_never_work_is_refused_before_training(fn, kwargs, message):
    """They failed at the first reward call, after the model had loaded and a rollout ran."""
    from mogrpo.rewards.base import BUILTIN_REWARDS

    columns = ["tests", "testbench", "correct_answer"]
    with pytest.raises(RewardError) as err:
        check_reward_call(fn, BUILTIN_REWARDS[fn], kwargs, columns, where="tasks.t.rewards.0")
    assert str(err.value).startswith(f"tasks.t.rewards.0.kwargs: {message}")
    check_reward_call(fn, BUILTIN_REWARDS[fn], {}, columns, where="tasks.t.rewards.0")


@pytest.mark.parametrize("key", ["trainer_state", "solution"])
def test_kwarg_hiding_a_passed_argument(key):
    with pytest.raises(RewardError, match=f"kwarg '{key}' of reward 'acc' has the name of"):
        check_reward_call("acc", accuracy, {key: 1}, ["solution"], where="tasks.t.rewards.0")


def test_accepted_signatures_pass_the_check():
    for fn in (think_format, accuracy, lambda completions, **kw: [], lambda **kw: []):
        check_reward_call("f", fn, {}, ["solution"], where="tasks.t.rewards.0")


# --- TRL's own reward functions, unchanged ------------------------------------------------------


def test_trl_shipped_rewards_run_unchanged():
    rewards = pytest.importorskip("trl.rewards")
    fns = [
        ("think", rewards.think_format_reward, {}),
        ("overlong", rewards.get_soft_overlong_punishment(max_completion_len=4,
                                                          soft_punish_cache=2), {}),
        ("repetition", rewards.get_repetition_penalty_reward(ngram_size=2, max_penalty=-1.0), {}),
    ]
    examples = chat_examples(["x", "y"])
    for label, fn, kwargs in fns:
        check_reward_call(label, fn, kwargs, ["solution"], where="tasks.t.rewards.0")
    completion_ids, lengths = ids([1, 2, 3], [5, 5, 5, 5, 5])
    got = score_examples(fns, examples, ["<think>\nhm\n</think>\n2/3", "no think"],
                         completion_ids, lengths, [False, True])
    # think: format ok / not; overlong: 3 tokens of 4 with cache 2 → (2 - 3) / 2, 5 > 4 → -1;
    # repetition: 2-grams (1,2),(2,3) unique → 0; (5,5) x4 → 1 - 1/4 of max_penalty -1
    assert got.tolist() == [[1.0, -0.5, 0.0], [0.0, -1.0, -0.75]]


def test_trl_accuracy_reward_with_math_verify():
    rewards = pytest.importorskip("trl.rewards")
    pytest.importorskip("math_verify")
    log = RewardLog()
    examples = chat_examples([r"\frac{2}{3}", r"\frac{2}{3}", "not latex at all"])
    completion_ids, lengths = ids([1], [2], [3])
    got = score_examples([("accuracy", rewards.accuracy_reward, {})], examples,
                         [r"So \boxed{\frac{2}{3}}", r"\boxed{\frac{1}{2}}", r"\boxed{1}"],
                         completion_ids, lengths, [False] * 3, log=log)
    assert got[:2, 0].tolist() == [1.0, 0.0]
    assert math.isnan(got[2, 0])  # the gold cannot be parsed: TRL returns None, never a 0
    assert log.extra["solution"] == [r"\frac{2}{3}", r"\frac{2}{3}", "not latex at all"]
    assert log.extra["answer_parsed"][2] == "[skipped]"
