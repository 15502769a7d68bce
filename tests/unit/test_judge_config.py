"""A `judge` reward configured in YAML is built once per task, before any model loads."""

from __future__ import annotations

import pytest

from mogrpo.config import load_config
from mogrpo.errors import MogrpoError
from mogrpo.rewards.judge import JudgeReward
from mogrpo.tasks.task import judges, load_tasks

JUDGE = {
    "providers": [{"name": "local", "base_url": "http://127.0.0.1:9/v1", "model": "judge"}],
    "template": "Question: {prompt}\nAnswer: {completion}\nScore 0-10:",
    "parser": {"kind": "number", "min": 0, "max": 10},
}


def base(tmp_path, kwargs) -> dict:
    return {
        "model": {"name_or_path": "unused"},
        "output": {"dir": str(tmp_path / "run")},
        "tasks": {"fairness": {"data": "builtin:bias_probe?size=8",
                               "rewards": ["mc_correct", {"fn": "judge", "name": "judge",
                                                          "kwargs": kwargs}]}},
    }


def test_judge_reward_from_config(tmp_path):
    config, _ = load_config(None, [], environ={}, base=base(tmp_path, JUDGE))
    tasks = load_tasks(config)
    label, fn, kwargs = tasks[0].reward_fns[1]
    assert (label, kwargs) == ("judge", {})
    assert isinstance(fn, JudgeReward)
    assert list(judges(tasks)) == ["fairness/judge"]
    assert not (tmp_path / "run").exists()  # nothing written before the run starts


def test_bad_judge_option_names_the_config_path(tmp_path):
    bad = {**JUDGE, "template": "Score this: {answer_text}"}
    config, _ = load_config(None, [], environ={}, base=base(tmp_path, bad))
    with pytest.raises(MogrpoError, match=r"tasks\.fairness\.rewards\.1\.kwargs"):
        load_tasks(config)


def test_a_fallback_that_needs_a_missing_column_is_refused_before_training(tmp_path):
    # it would be called first when the judge fails, maybe hours into the run
    rules = tmp_path / "rules.py"
    rules.write_text("def exact(completions, solution, **kwargs):\n"
                     "    return [float(c == s) for c, s in zip(completions, solution)]\n")
    options = {**JUDGE, "fallback": f"{rules}:exact"}
    config, _ = load_config(None, [], environ={}, base=base(tmp_path, options))
    with pytest.raises(MogrpoError, match=r"tasks\.fairness\.rewards\.1\.kwargs\.fallback: "
                                          r"reward 'exact' exact\(completions, solution, \*\*kwargs\)"
                                          r" needs 'solution'"):
        load_tasks(config)


def test_two_objectives_with_one_name_are_refused(tmp_path):
    # two judges without `name` would share metrics, a completions-log column, and the
    # checkpointed budget of only one of them
    config, _ = load_config(None, [], environ={}, base=base(tmp_path, JUDGE))
    config.tasks["fairness"].rewards[0] = config.tasks["fairness"].rewards[1].model_copy(
        update={"name": None})
    config.tasks["fairness"].rewards[1] = config.tasks["fairness"].rewards[1].model_copy(
        update={"name": None})
    with pytest.raises(MogrpoError) as err:
        load_tasks(config)
    assert str(err.value) == (
        "tasks.fairness.rewards.1: objective 'judge' has the name of tasks.fairness.rewards.0; "
        "each objective needs its own (metrics, the completions log and a judge's budget are "
        "kept by name): set `name` on one of them")


@pytest.mark.parametrize(("rank", "calls", "tokens"), [(0, 3, 51), (1, 2, 50)])
def test_each_process_keeps_its_share_of_the_run_budget(tmp_path, rank, calls, tokens):
    # every process judges its own completions: alone, each could spend the whole budget
    options = {**JUDGE, "budget": {"max_calls": 5, "max_tokens": 101}}
    config, _ = load_config(None, [], environ={}, base=base(tmp_path, options))
    budget = judges(load_tasks(config, rank, 2))["fairness/judge"].budget
    assert (budget.max_calls, budget.max_tokens) == (calls, tokens)


def test_judge_counts_of_several_processes_add_up(monkeypatch):
    # each process judges its own completions: the step made all their calls, paid all of it
    from mogrpo.trainer.distributed import Dist

    p = "task/fairness/judge/judge"
    parts = [{f"{p}/calls": 8.0, f"{p}/failed": 1.0, f"{p}/errors/timeout": 1.0,
              f"{p}/budget/calls": 40.0, f"{p}/failed_frac": 0.125, f"{p}/wall_s": 2.0},
             {f"{p}/calls": 8.0, f"{p}/failed": 3.0, f"{p}/errors/timeout": 0.0,
              f"{p}/budget/calls": 38.0, f"{p}/failed_frac": 0.375, f"{p}/wall_s": 4.0}]
    monkeypatch.setattr(Dist, "gather", lambda self, value: parts)
    assert Dist(0, 2).reduce_metrics(parts[0]) == {
        f"{p}/calls": 16.0, f"{p}/failed": 4.0, f"{p}/errors/timeout": 1.0,
        f"{p}/budget/calls": 78.0, f"{p}/failed_frac": 0.25, f"{p}/wall_s": 3.0}
