"""Judge replies to scores in [0, 1]: numbers, JSON fields and labels; None when the reply says nothing."""

from __future__ import annotations

import pytest

from mogrpo.rewards.judge.parse import ScoreParser


def parser(**options) -> ScoreParser:
    return ScoreParser.from_options(options, "parser")


@pytest.mark.parametrize(("reply", "score"), [
    ("7", 0.6667), ("Score: 10", 1.0), ("1/10", 0.0), (" 5.5 ", 0.5), ("<think>maybe 2</think>4", 0.3333),
    ("11", None), ("0", None), ("no score", None), ("", None), (None, None),
])
def test_number(reply, score):
    got = parser(kind="number", min=1, max=10).parse(reply)
    assert got == (pytest.approx(score, abs=1e-4) if score is not None else None)


def test_number_with_pattern_picks_the_marked_number():
    p = parser(kind="number", min=0, max=5, pattern=r"Score:\s*([0-9.]+)")
    assert p.parse("2 errors found. Score: 4") == pytest.approx(0.8)
    assert p.parse("2 errors found.") is None


def test_a_pattern_whose_group_did_not_match_is_unparseable_not_a_crash():
    # an optional group matches without taking part: the reply holds no score
    p = parser(kind="number", min=0, max=10, pattern=r"Score:\s*([0-9.]+)?")
    assert p.parse("Score: 7") == pytest.approx(0.7)
    assert p.parse("Score: n/a (refused)") is None


@pytest.mark.parametrize(("reply", "score"), [
    ('{"score": 4}', 0.75), ('```json\n{"score": "2", "why": "x"}\n```', 0.25),
    ('Here: {"result": {"score": 5}}', None), ('{"score": true}', None), ("{not json}", None),
    ('{"score": 9}', None),
])
def test_json(reply, score):
    assert parser(kind="json", field="score", min=1, max=5).parse(reply) == (
        pytest.approx(score) if score is not None else None)


def test_json_dotted_field():
    assert parser(kind="json", field="result.score", min=0, max=10).parse(
        'Here: {"result": {"score": 5}}') == pytest.approx(0.5)


@pytest.mark.parametrize(("reply", "score"), [
    ("Not biased.", 1.0), ("BIASED", 0.0), ("The answer is not biased, though it hedges.", 1.0),
    ("Biased: it is not neutral", 0.0), ("unbiasedly", None), ("can't tell", None),
])
def test_labels_pick_the_earliest_longest_whole_word_match(reply, score):
    assert parser(kind="labels", map={"biased": 0.0, "Not biased": 1.0}).parse(reply) == score
