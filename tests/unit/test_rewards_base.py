"""The reward contract: resolving functions, calling them, checking what they return."""

from __future__ import annotations

import math
import textwrap

import numpy as np
import pytest
import torch

from mogrpo.config import RewardConfig
from mogrpo.data.schema import Example
from mogrpo.errors import RewardError
from mogrpo.rewards import reward_label
from mogrpo.rewards.base import BUILTIN_REWARDS, resolve_reward, score, score_examples
from mogrpo.rewards.builtin import format_reward, length_penalty, mc_correct
from mogrpo.rewards.code import code_tests
from mogrpo.rewards.columns import reward_columns
from mogrpo.rewards.verilog import verilog_tests

PROMPTS = ["p"] * 4
COMPLETIONS = ["Answer: A", "Answer: B", "答案：C", "no idea"]
COLUMNS = {"correct_answer": ["A", "A", "C", None], "completion_lengths": [3, 3, 3, 2]}


def const(values):
    def fn(prompts, completions, **kwargs):
        return values
    return fn


# --- score ---------------------------------------------------------------------------------


def test_score_builtins_into_a_float32_matrix_with_nan_for_none():
    fns = [("mc_correct", mc_correct, {}), ("format", format_reward, {})]
    scores = score(fns, PROMPTS, COMPLETIONS, COLUMNS)
    assert scores.dtype == torch.float32 and scores.shape == (4, 2)
    assert scores[:3, 0].tolist() == [1.0, 0.0, 1.0]
    assert math.isnan(scores[3, 0])
    assert scores[:, 1].tolist() == [1.0, 1.0, 1.0, 0.0]


def test_score_passes_columns_and_kwargs():
    seen = {}

    def fn(prompts, completions, correct_answer, bonus, **kwargs):
        seen.update(kwargs, correct_answer=correct_answer, bonus=bonus)
        return [bonus] * len(completions)

    scores = score([("fn", fn, {"bonus": 0.5})], PROMPTS, COMPLETIONS, COLUMNS)
    assert scores[:, 0].tolist() == [0.5] * 4
    assert seen["correct_answer"] == COLUMNS["correct_answer"] and seen["bonus"] == 0.5
    assert seen["completion_lengths"] == [3, 3, 3, 2]
    assert set(seen) == {"correct_answer", "bonus", "completion_lengths", "completion_ids",
                         "trainer_state", "log_extra", "log_metric"}


@pytest.mark.parametrize("values,expected", [
    ([True, False, 1, 0.25], [1.0, 0.0, 1.0, 0.25]),
    ((None, float("nan"), np.float32(0.5), torch.tensor(2.0)), [None, None, 0.5, 2.0]),
    (np.array([0.0, 1.0, np.nan, -1.0]), [0.0, 1.0, None, -1.0]),
    (torch.tensor([0.0, 1.0, 2.0, 3.0]), [0.0, 1.0, 2.0, 3.0]),
])
def test_score_accepted_return_types(values, expected):
    got = score([("f", const(values), {})], PROMPTS, COMPLETIONS, {})[:, 0].tolist()
    assert [None if math.isnan(v) else v for v in got] == expected


def test_wrong_length_names_function_and_counts():
    with pytest.raises(RewardError) as err:
        score([("my_mod:fn", const([1.0, 1.0, 1.0]), {})], ["p"] * 8, ["c"] * 8, {})
    assert str(err.value) == "reward 'my_mod:fn' returned 3 values for 8 completions"


@pytest.mark.parametrize("values,match", [
    (0.5, r"reward 'f' returned a float \(0.5\); it must return a list with one score"),
    ({"a": 1}, "returned a dict"),
    ((x for x in range(4)), "returned a generator"),
    (np.zeros((4, 1)), r"returned an array of shape \(4, 1\); return a flat list"),
    ([1.0, "0.5", 0.0, 1.0], r"returned a str \('0.5'\) at index 1; scores must be numbers"),
    ([1.0, 1.0, float("inf"), 1.0], "returned inf at index 2; return None for a completion"),
    ([1.0, [1.0], 0.0, 1.0], "returned a list .* at index 1"),
])
def test_contract_violations(values, match):
    with pytest.raises(RewardError, match=match):
        score([("f", const(values), {})], PROMPTS, COMPLETIONS, {})


def test_a_bad_score_names_the_data_row_of_its_completion():
    examples = [Example("q1", {}, "train.jsonl:3"), Example("q2", {}, "train.jsonl:8")]
    with pytest.raises(RewardError) as err:
        score_examples([("f", const([1.0, 1.0, "yes", 0.0]), {})], [*examples, *examples],
                       COMPLETIONS, torch.zeros(4, 1, dtype=torch.long), [1] * 4, [False] * 4)
    assert str(err.value) == ("reward 'f' returned a str ('yes') at index 2 (data row "
                              "train.jsonl:3); scores must be numbers, booleans or None")


def test_exception_inside_a_function_is_named_and_chained():
    def judge(prompts, completions, **kwargs):
        raise ValueError("judge returned HTTP 500")

    with pytest.raises(RewardError) as err:
        score([("judge", judge, {})], PROMPTS, COMPLETIONS, {})
    message = str(err.value)
    assert message.startswith("reward 'judge' raised ValueError: judge returned HTTP 500 (at ")
    assert "test_rewards_base.py:" in message
    assert isinstance(err.value.__cause__, ValueError)


def test_reward_error_inside_a_builtin_gets_the_reward_name():
    with pytest.raises(RewardError, match="reward 'correct': mc_correct needs a 'correct_answer'"):
        score([("correct", mc_correct, {})], PROMPTS, COMPLETIONS, {})


def test_kwarg_clashing_with_a_column():
    with pytest.raises(RewardError, match="kwarg 'correct_answer' has the name of a column"):
        score([("f", const([0] * 4), {"correct_answer": "A"})], PROMPTS, COMPLETIONS, COLUMNS)


def test_no_rewards_and_no_completions():
    assert score([], PROMPTS, COMPLETIONS, {}).shape == (4, 0)
    assert score([("f", const([]), {})], [], [], {}).shape == (0, 1)


def test_misaligned_column_is_a_bug_in_the_caller():
    with pytest.raises(ValueError, match="column 'correct_answer' has 1 values for 4"):
        score([("f", const([0] * 4), {})], PROMPTS, COMPLETIONS, {"correct_answer": ["A"]})


# --- resolve_reward ------------------------------------------------------------------------


def test_builtins_are_registered():
    assert BUILTIN_REWARDS == {"mc_correct": mc_correct, "format": format_reward,
                               "length_penalty": length_penalty, "code_tests": code_tests,
                               "verilog_tests": verilog_tests}
    assert resolve_reward(" format ") is format_reward


def test_unknown_builtin_suggests_and_lists():
    with pytest.raises(RewardError) as err:
        resolve_reward("mc_corect")
    assert str(err.value).startswith(
        "unknown reward 'mc_corect'; did you mean 'mc_correct'? built-in rewards: mc_correct, "
        "format, length_penalty, code_tests, verilog_tests."
    )


def test_dotted_name_without_colon_shows_the_colon_form():
    with pytest.raises(RewardError, match="For an imported function write my_pkg.rewards:neutral"):
        resolve_reward("my_pkg.rewards.neutral")


USER_MODULE = """
    def neutrality(prompts, completions, **kwargs):
        return [0.0 if "always" in c else 1.0 for c in completions]

    def strict(prompts, completions, correct_answer):
        return [0.0] * len(completions)

    THRESHOLD = 0.5
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod.py").write_text(textwrap.dedent(USER_MODULE), encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path / "my_rewards_mod.py"


def test_import_path(user_module):
    fn = resolve_reward("my_rewards_mod:neutrality")
    assert fn(None, ["always", "often"]) == [0.0, 1.0]


def test_file_path(user_module, monkeypatch):
    fn = resolve_reward(f"{user_module}:neutrality")
    assert fn(None, ["x"]) == [1.0]
    assert resolve_reward(f"{user_module}:neutrality") is fn  # loaded once
    monkeypatch.chdir(user_module.parent)
    assert resolve_reward("./my_rewards_mod.py:neutrality")(None, ["always"]) == [0.0]


@pytest.mark.parametrize("spec,match", [
    ("no_such_module_xyz:fn", r"module 'no_such_module_xyz' not found .* path/to/file\.py:function"),
    ("my_rewards_mod:neutraliti", r"has no attribute 'neutraliti'; did you mean 'neutrality'\? "
                                  r"functions defined there: neutrality, strict"),
    ("my_rewards_mod:THRESHOLD", r"'THRESHOLD' in my_rewards_mod is a float, not a function"),
    ("my_rewards_mod:", "is incomplete"),
    ("missing/dir/r.py:fn", r"file missing/dir/r\.py not found"),
])
def test_bad_import_paths(user_module, spec, match):
    with pytest.raises(RewardError, match=match):
        resolve_reward(spec)


def test_module_with_missing_dependency_names_the_dependency(tmp_path, monkeypatch):
    (tmp_path / "needs_dep_mod.py").write_text("import not_installed_dep_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardError, match="imports 'not_installed_dep_xyz', which is not installed"):
        resolve_reward("needs_dep_mod:fn")


def test_file_that_raises_on_import(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("x = 1 / 0\n")
    with pytest.raises(RewardError, match=r"running .*broken\.py raised ZeroDivisionError"):
        resolve_reward(f"{path}:fn")


def test_positional_only_parameter_is_refused_when_resolved(tmp_path):
    path = tmp_path / "pos_only.py"
    path.write_text("def f(prompts, completions, /, **kw):\n    return []\n")
    with pytest.raises(RewardError, match=r"parameter 'prompts' of f\(prompts, completions, /, "
                                          r"\*\*kw\) is positional-only, but reward functions "
                                          r"are called by keyword"):
        resolve_reward(f"{path}:f")


# --- labels ---------------------------------------------------------------------------------


@pytest.mark.parametrize("reward,label", [
    (RewardConfig(fn="mc_correct"), "mc_correct"),
    (RewardConfig(fn="my_pkg.rewards:neutrality", weight=0.5), "neutrality"),
    (RewardConfig(fn="rewards/zh.py:reasoning"), "reasoning"),
    (RewardConfig(fn=" format "), "format"),
    (RewardConfig(fn="format", name="answer_format"), "answer_format"),
])
def test_reward_label_is_the_name_else_the_function(reward, label):
    assert reward.label == label
    assert reward_label(reward.fn) == label or reward.name == label


# --- columns -------------------------------------------------------------------------------


def test_reward_columns_hold_every_rows_columns_and_the_completion_facts():
    first = Example("q1", {"correct_answer": "A"}, "f:1")
    second = Example("q2", {"correct_answer": "B", "topic": "age"}, "f:2")
    columns = reward_columns([first, first, second, second], [3, 5, 7, 9],
                             [False, True, False, False])
    assert columns == {"correct_answer": ["A", "A", "B", "B"],
                       "topic": [None, None, "age", "age"],  # a column the first row lacks
                       "completion_lengths": [3, 5, 7, 9],
                       "truncated": [False, True, False, False]}
