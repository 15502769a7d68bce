"""Answer extraction: which letter a completion chose, and which rule found it."""

from __future__ import annotations

import pytest

from mogrpo.errors import RewardError
from mogrpo.rewards.extract import Extraction, extract_choice

NONE = (None, None)

CASES = [
    # answer_marker: English
    ("Answer: B", ("B", "answer_marker")),
    ("Answer:B", ("B", "answer_marker")),
    ("The answer is (B).", ("B", "answer_marker")),
    ("The answer is B.", ("B", "answer_marker")),
    ("Final answer: b", ("B", "answer_marker")),
    ("The correct answer would be option D because ...", ("D", "answer_marker")),
    ("**Answer:** **C**", ("C", "answer_marker")),
    ("Answer:\n\nA) Anna", ("A", "answer_marker")),
    ("The final answer is $\\boxed{C}$", ("C", "answer_marker")),
    ("A and B are both wrong... Answer: C", ("C", "answer_marker")),
    ("Answer: A. Wait, let me re-check. The answer is D", ("D", "answer_marker")),
    # answer_marker: Chinese
    ("答案：A", ("A", "answer_marker")),
    ("答案: A", ("A", "answer_marker")),
    ("答案是A", ("A", "answer_marker")),
    ("答案为 A", ("A", "answer_marker")),
    ("正确答案是C，因为题目没有提供足够信息。", ("C", "answer_marker")),
    ("理由：根据题干……\n答案：Ｂ", ("B", "answer_marker")),
    ("答案是选项D", ("D", "answer_marker")),
    ("答案：A和B都不对，所以答案：C", ("C", "answer_marker")),
    # choose
    ("选D", ("D", "choose")),
    ("选择 D", ("D", "choose")),
    ("因为A和B都带有偏见，应选B", ("B", "choose")),
    ("我选择：（C），理由如下", ("C", "choose")),
    # parenthesized
    ("(C) seems right to me, given the context.", ("C", "parenthesized")),
    ("我认为是（C）吧，因为信息不足", ("C", "parenthesized")),
    ("Between (A) and (D), I prefer (D) here.", ("D", "parenthesized")),
    # final_letter
    ("Anna and Ben are mentioned, so the best is B", ("B", "final_letter")),
    ("B.", ("B", "final_letter")),
    ("B", ("B", "final_letter")),
    ("所以是B。", ("B", "final_letter")),
    ("A man walked in. The most neutral choice is **C**", ("C", "final_letter")),
    # negatives
    ("Bob", NONE),
    ("I asked Bob", NONE),
    ("A man walked into the bar", NONE),
    ("I am not sure", NONE),
    ("Answer: I am not sure", NONE),
    ("The answer is a bit unclear", NONE),
    ("answer: a lot depends on context", NONE),
    ("Answer: Because nobody knows", NONE),
    ("The answer is not B", NONE),
    ("选项B是错误的", NONE),
    ("不选A", NONE),
    ("f(C) is a function call", NONE),
    ("Answer: E", NONE),  # E is not one of the options
    ("", NONE),
]


@pytest.mark.parametrize("text,expected", CASES, ids=[c[0][:40] or "empty" for c in CASES])
def test_extract_choice(text, expected):
    got = extract_choice(text)
    assert (got.letter, got.rule) == expected


def test_enough_cases_for_each_rule():
    rules = [expected[1] for _, expected in CASES]
    assert len(CASES) >= 25
    for rule in ("answer_marker", "choose", "parenthesized", "final_letter", None):
        assert rules.count(rule) >= 3


def test_span_points_at_the_letter():
    text = "A and B are both wrong... Answer: C"
    got = extract_choice(text)
    assert got == Extraction("C", "answer_marker", (34, 35))
    assert text[slice(*got.span)] == "C"
    fullwidth = "答案：Ｂ"
    assert fullwidth[slice(*extract_choice(fullwidth).span)] == "Ｂ"


def test_no_match_is_all_none():
    assert extract_choice("no idea") == Extraction(None, None, None)


def test_letters_restrict_and_extend_the_choices():
    assert extract_choice("Answer: E").letter is None
    assert extract_choice("Answer: E", letters="ABCDE") == Extraction("E", "answer_marker", (8, 9))
    assert extract_choice("Answer: D", letters="abc").letter is None
    assert extract_choice("so it is C", letters="AB").letter is None


@pytest.mark.parametrize("letters", ["", "A-D", 4])
def test_bad_letters(letters):
    with pytest.raises(RewardError, match="letters must be a string of option letters"):
        extract_choice("Answer: A", letters=letters)
