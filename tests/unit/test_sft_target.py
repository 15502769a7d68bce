"""SFT warm-up targets: templates over columns, the default precedence, and the errors."""

from __future__ import annotations

import pytest

from mogrpo.data.schema import Example
from mogrpo.errors import ConfigError
from mogrpo.trainer.sft import sft_target


def example(**columns) -> Example:
    return Example("the prompt", columns, "data/fair.jsonl:3")


def test_template_is_filled_from_the_columns():
    ex = example(question="Who?", correct_answer="B", reason="the context says so")
    assert sft_target(ex, "Answer: {correct_answer} ({reason})", "fair") == (
        "Answer: B (the context says so)"
    )
    # A template wins over a completion column.
    ex = example(completion="ignored", correct_answer="C")
    assert sft_target(ex, "答案：{correct_answer}", "fair") == "答案：C"
    assert sft_target(ex, "Answer: {{{correct_answer}}}", "fair") == "Answer: {C}"


def test_template_may_index_a_column():
    ex = example(options={"A": "Paris", "B": "Rome"}, correct_answer="B")
    assert sft_target(ex, "{options[B]}. Answer: {correct_answer}", "geo") == "Rome. Answer: B"


def test_template_with_a_missing_column_names_it_the_source_and_the_columns():
    ex = example(question="Who?", correct_answer="B")
    with pytest.raises(ConfigError) as err:
        sft_target(ex, "Answer: {correct_answer} because {rationale}", "fair")
    assert str(err.value) == (
        "tasks.fair.sft_target uses {rationale} but data/fair.jsonl:3 has no such column; "
        "available: correct_answer, question"
    )


@pytest.mark.parametrize("template", ["Answer: {correct_answer", "Answer: }{correct_answer}"])
def test_malformed_template_is_a_config_error(template):
    with pytest.raises(ConfigError, match=r"tasks\.fair\.sft_target .* not a valid format string"):
        sft_target(example(correct_answer="B"), template, "fair")


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{options[E]}", r"cannot be filled in for data/fair\.jsonl:3 \(KeyError: 'E'\)"),
        ("Answer: {}", r"uses \{\} but data/fair\.jsonl:3 has no such column"),
    ],
)
def test_template_that_cannot_be_filled_is_a_config_error(template, message):
    ex = example(options={"A": "Paris", "B": "Rome"}, correct_answer="B")
    with pytest.raises(ConfigError, match=message):
        sft_target(ex, template, "geo")


@pytest.mark.parametrize(
    ("columns", "expected"),
    [
        ({"completion": "c", "response": "r", "answer": "a", "correct_answer": "B"}, "c"),
        ({"response": "r", "answer": "a", "correct_answer": "B"}, "r"),
        ({"answer": "a", "correct_answer": "B"}, "a"),
        ({"correct_answer": "B"}, "Answer: B"),
        # Blank or missing values do not count as a target; the next one in line is used.
        ({"completion": "  ", "response": "r"}, "r"),
        ({"completion": None, "answer": "a"}, "a"),
    ],
)
def test_default_target_precedence(columns, expected):
    assert sft_target(example(**columns), None, "fair") == expected


def test_no_target_is_a_config_error_with_the_fix():
    with pytest.raises(ConfigError) as err:
        sft_target(example(topic="geography", completion=""), None, "geo")
    message = str(err.value)
    assert message.startswith("tasks.geo: SFT warm-up needs a target for data/fair.jsonl:3")
    assert "add a `completion` column or set tasks.<name>.sft_target" in message
