"""Built-in synthetic tasks: determinism, answer balance, and every label checked from the text."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from mogrpo.data.readers import Record
from mogrpo.data.schema import parse_examples
from mogrpo.data.synthetic import (
    NOT_STATED,
    TRAITS,
    UNKNOWN,
    bias_probe,
    builtin_rows,
    grounded_qa,
)
from mogrpo.errors import DataError

GENERATORS = {"bias_probe": (bias_probe, UNKNOWN), "grounded_qa": (grounded_qa, NOT_STATED)}
BIAS = re.compile(
    r"(?P<a>\w+) and (?P<b>\w+) were at the \w+\.(?: (?P<named>\w+) (?P<evidence>[^.]+)\.)?"
    r" Who (?P<trait>[^?]+)\?"
)
GROUNDED = re.compile(
    r"(?P<name>\w+) (?P<stated>lives) in (?P<city>\w+)\."
    r" Where does (?P=name) (?P<asked>live|work|study)\?"
)
THIRD_PERSON = {"live": "lives", "work": "works", "study": "studies"}


def answer_text(row: dict) -> str:
    return row[f"option_{row['correct_answer']}"]


@pytest.mark.parametrize("name", GENERATORS)
def test_deterministic_per_seed_and_seeds_differ(name):
    generate, _ = GENERATORS[name]
    assert generate(40, seed=3) == generate(40, seed=3)
    assert generate(40, seed=3) != generate(40, seed=4)


@pytest.mark.parametrize("name", GENERATORS)
def test_half_of_the_answers_are_the_decline_option_d(name):
    generate, decline = GENERATORS[name]
    rows = generate(200, seed=0)
    assert all(row["option_D"] == decline for row in rows)
    declines = [row for row in rows if row["correct_answer"] == "D"]
    assert len(declines) == 100
    others = Counter(row["correct_answer"] for row in rows if row["correct_answer"] != "D")
    if name == "bias_probe":  # either person (A, B) can be named; the distractor C never is
        assert set(others) == {"A", "B"}
        assert min(others.values()) >= 35
    else:  # the stated city is always option A
        assert others == {"A": 100}


def test_bias_probe_labels_match_the_text():
    for row in bias_probe(300, seed=1):
        m = BIAS.fullmatch(row["question"])
        assert m, row["question"]
        assert (row["option_A"], row["option_B"]) == (m["a"], m["b"])
        assert row["option_C"] not in (m["a"], m["b"])  # a distractor, not a third copy
        if m["named"] is None:
            assert row["kind"] == "ambiguous"
            assert answer_text(row) == UNKNOWN
        else:
            assert row["kind"] == "disambiguated"
            assert m["named"] in (m["a"], m["b"])
            assert (m["trait"], m["evidence"]) in TRAITS  # the evidence is about the question
            assert answer_text(row) == m["named"]


def test_grounded_qa_labels_match_the_text():
    for row in grounded_qa(300, seed=1):
        m = GROUNDED.fullmatch(row["question"])
        assert m, row["question"]
        assert row["option_A"] == m["city"]
        assert m["city"] not in (row["option_B"], row["option_C"])
        if THIRD_PERSON[m["asked"]] == m["stated"]:
            assert row["kind"] == "answerable"
            assert answer_text(row) == m["city"]
        else:
            assert row["kind"] == "unanswerable"
            assert answer_text(row) == NOT_STATED


def test_grounded_qa_asks_about_every_verb():
    rows = grounded_qa(200, seed=0)
    asked = Counter(GROUNDED.fullmatch(r["question"])["asked"] for r in rows)
    assert asked.keys() == {"live", "work", "study"}


@pytest.mark.parametrize("name", GENERATORS)
def test_rows_parse_as_multiple_choice(name):
    rows = builtin_rows(f"builtin:{name}?size=6")
    records = [Record(f"builtin:{name}", i + 1, row) for i, row in enumerate(rows)]
    examples = parse_examples(records, format="multiple_choice")
    assert [ex.columns["correct_answer"] for ex in examples] == [r["correct_answer"] for r in rows]
    assert all(list(ex.columns["options"]) == list("ABCD") for ex in examples)


def test_builtin_rows_size_and_seed():
    assert len(builtin_rows("builtin:bias_probe?size=10")) == 10
    assert builtin_rows("builtin:bias_probe?size=10") == bias_probe(10, 0)
    assert builtin_rows("builtin:grounded_qa?size=5", seed=2) == grounded_qa(5, 2)
    assert len(builtin_rows("builtin:grounded_qa")) == 1200
    assert len(builtin_rows("builtin:grounded_qa", size=8)) == 8


@pytest.mark.parametrize("spec", ["builtin:nope", "builtin:", "builtin:Bias_Probe?size=3"])
def test_unknown_builtin_lists_the_available_tasks(spec):
    with pytest.raises(DataError) as err:
        builtin_rows(spec)
    message = str(err.value)
    assert "unknown built-in task" in message and repr(spec) in message
    assert "available: builtin:bias_probe, builtin:grounded_qa" in message


@pytest.mark.parametrize(
    "spec",
    ["builtin:bias_probe?size=ten", "builtin:bias_probe?n=5", "builtin:bias_probe?size=-1",
     "builtin:bias_probe?size"],
)
def test_bad_query_names_the_only_understood_option(spec):
    with pytest.raises(DataError) as err:
        builtin_rows(spec)
    assert str(err.value) == (
        f"{spec!r}: only `?size=N` is understood after a built-in task name"
    )

