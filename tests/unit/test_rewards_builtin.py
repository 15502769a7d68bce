"""Built-in rewards: exact values, None only where the row cannot be scored."""

from __future__ import annotations

import pytest
import torch

from mogrpo.errors import RewardError
from mogrpo.rewards.builtin import format_reward, length_penalty, mc_correct

EXTRA = {"question": ["q"] * 4, "truncated": [False] * 4, "completion_lengths": [5] * 4}


def test_mc_correct_scores_and_ignores_unknown_columns():
    completions = ["Answer: B", "答案：C", "I am not sure", "so it is (B)"]
    scores = mc_correct([None] * 4, completions, correct_answer=["B", "B", "B", "B"], **EXTRA)
    assert scores == [1.0, 0.0, 0.0, 1.0]


def test_mc_correct_none_only_when_the_row_has_no_answer():
    scores = mc_correct([None] * 3, ["Answer: A"] * 3, correct_answer=["A", None, ""])
    assert scores == [1.0, None, None]


def test_mc_correct_normalises_the_expected_answer():
    assert mc_correct([None], ["Answer: B"], correct_answer=["(b)"]) == [1.0]
    assert mc_correct([None, None], ["B", "A"], correct_answer="B") == [1.0, 0.0]


def test_mc_correct_uses_the_row_options_for_letters():
    options = [{"A": "1", "B": "2", "C": "3", "D": "4", "E": "5"}, {"A": "x", "B": "y"}]
    scores = mc_correct([None] * 2, ["Answer: E", "Answer: C"], correct_answer=["E", "B"],
                        options=options)
    assert scores == [1.0, 0.0]
    assert mc_correct([None], ["Answer: E"], correct_answer=["E"]) == [0.0]  # default ABCD
    assert mc_correct([None], ["Answer: E"], correct_answer=["E"], letters="ABCDE") == [1.0]


def test_mc_correct_reads_chat_completions():
    completion = [{"role": "assistant", "content": "答案：D"}]
    assert mc_correct([None], [completion], correct_answer=["D"]) == [1.0]


def test_mc_correct_without_the_column_says_which_data_it_needs():
    with pytest.raises(RewardError, match="mc_correct needs a 'correct_answer' column"):
        mc_correct([None], ["Answer: A"])


def test_mc_correct_column_of_wrong_length():
    with pytest.raises(RewardError, match="'correct_answer' has 1 values for 2 completions"):
        mc_correct([None] * 2, ["A", "B"], correct_answer=["A"])


def test_format_reward_default_pattern():
    completions = ["理由：因为……\n答案：B", "Answer: C", "answer: c", "The answer is B", "答案:A"]
    assert format_reward([None] * 5, completions, **EXTRA) == [1.0, 1.0, 0.0, 0.0, 1.0]


def test_format_reward_custom_pattern_and_bad_regex():
    assert format_reward([None] * 2, ["理由：x", "y"], pattern="理由|因为|根据") == [1.0, 0.0]
    with pytest.raises(RewardError, match=r"pattern '\(' is not a valid regular expression"):
        format_reward([None], ["x"], pattern="(")


def test_length_penalty_from_token_lengths():
    lengths = [10, 64, 80, 96, 128, 500]
    scores = length_penalty([None] * 6, ["x"] * 6, target_length=64, completion_lengths=lengths,
                            truncated=[False] * 6)
    assert scores == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]


def test_length_penalty_accepts_a_tensor_of_lengths_and_max_length():
    scores = length_penalty([None] * 2, ["x"] * 2, target_length=10, max_length=20,
                            completion_lengths=torch.tensor([15, 30]))
    assert scores == [-0.5, -1.0]


def test_length_penalty_falls_back_to_words_with_cjk_characters_as_words():
    completions = ["one two three four", "答案B因为", "a b c d e f"]
    assert length_penalty([None] * 3, completions, target_length=4, max_length=6) == [
        0.0, -0.5, -1.0
    ]


@pytest.mark.parametrize("kwargs", [{"target_length": 10, "max_length": 10},
                                    {"target_length": -1}])
def test_length_penalty_bad_kwargs(kwargs):
    with pytest.raises(RewardError, match="length_penalty: need 0 <= target_length < max_length"):
        length_penalty([None], ["x"], **kwargs)
