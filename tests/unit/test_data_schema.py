"""Schemas: prompt, chat and multiple-choice rows, auto-detection, templates and row errors."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from mogrpo.data.readers import Record
from mogrpo.data.schema import (
    Example,
    load_examples,
    normalize_choice_letter,
    parse_examples,
    render_multiple_choice,
    split_examples,
)
from mogrpo.errors import ConfigError, DataError

FIXTURES = Path(__file__).parent / "fixtures"
SRC = "data/fair.tsv"


def mc_row(**overrides) -> dict:
    row = {
        "question": "Who was late?",
        "option_A": "Anna",
        "option_B": "Ben",
        "option_C": "Cannot be determined",
        "option_D": "Carl",
        "correct_answer": "C",
    }
    row.update(overrides)
    return row


def records(*rows: dict, source: str = SRC, first_row: int = 2) -> list[Record]:
    return [Record(source, first_row + i, row) for i, row in enumerate(rows)]


# --- multiple choice -----------------------------------------------------------------------


def test_multiple_choice_default_prompt_and_columns():
    [ex] = parse_examples(records(mc_row(reasoning="no info", id="q7")))
    assert ex.prompt == (
        "Who was late?\nA. Anna\nB. Ben\nC. Cannot be determined\nD. Carl\n"
        "Answer with the letter of the correct option."
    )
    assert ex.columns == {
        "question": "Who was late?",
        "options": {"A": "Anna", "B": "Ben", "C": "Cannot be determined", "D": "Carl"},
        "correct_answer": "C",
        "reasoning": "no info",
        "id": "q7",
    }
    assert ex.source == "data/fair.tsv:2"


@pytest.mark.parametrize("raw", ["B", " b ", "B.", "(B)", "（Ｂ）", "b)", "[B]"])
def test_correct_answer_is_normalised(raw):
    [ex] = parse_examples(records(mc_row(correct_answer=raw)), format="multiple_choice")
    assert ex.columns["correct_answer"] == "B"


@pytest.mark.parametrize("raw,expected", [
    ("B", "B"), (" d.", "D"), ("答案B", None), ("AB", None), (1, None), ("", None),
])
def test_normalize_choice_letter(raw, expected):
    assert normalize_choice_letter(raw) == expected


def test_correct_answer_outside_options_names_file_row_and_fix():
    rows = records(mc_row(), mc_row(correct_answer="E"), first_row=16)
    with pytest.raises(DataError) as err:
        parse_examples(rows)
    assert str(err.value) == (
        "data/fair.tsv row 17, column 'correct_answer' = 'E': not one of the options A–D; "
        "write one of A–D, or remove the row"
    )


def test_a_test_set_may_leave_the_answer_out_when_predicting():
    without = {k: v for k, v in mc_row().items() if k != "correct_answer"}
    rows = records(without, mc_row(correct_answer=""), mc_row(correct_answer="b"))
    examples = parse_examples(rows, require_answer=False)
    assert [ex.columns["correct_answer"] for ex in examples] == [None, None, "B"]
    # an answer that is given must still be an option
    with pytest.raises(DataError, match="row 2, column 'correct_answer' = 'E': not one of the options"):
        parse_examples(records(mc_row(correct_answer="E")), require_answer=False)
    # training data still needs it
    with pytest.raises(DataError, match="column 'correct_answer' = '': empty"):
        parse_examples(records(mc_row(correct_answer="")))


def test_correct_answer_that_is_not_a_letter_says_to_write_the_letter():
    with pytest.raises(DataError, match=r"row 2, column 'correct_answer' = '答案B': not an option "
                                        r"letter \(the options are A–D\); write just the letter, "
                                        r"e.g. 'B'"):
        parse_examples(records(mc_row(correct_answer="答案B")))


def test_lowercase_option_columns_and_more_than_four_options():
    row = {"question": "Pick", "option_a": "1", "option_b": "2", "option_c": "3",
           "option_d": "4", "option_e": "5", "correct_answer": "e"}
    [ex] = parse_examples(records(row))
    assert list(ex.columns["options"]) == ["A", "B", "C", "D", "E"]
    assert ex.columns["correct_answer"] == "E"
    assert "E. 5\n" in ex.prompt


def test_two_options_are_enough_and_numbers_become_text():
    row = {"question": "2+2?", "option_A": 4, "option_B": 5, "correct_answer": "A"}
    [ex] = parse_examples(records(row, source="d.jsonl", first_row=1))
    assert ex.columns["options"] == {"A": "4", "B": "5"}


def test_option_letters_must_not_skip():
    row = mc_row()
    del row["option_C"]
    with pytest.raises(DataError, match=r"row 2: option columns A, B, D skip option_C"):
        parse_examples(records(row), format="multiple_choice")


def test_fewer_than_two_options():
    row = {"question": "q", "option_A": "x", "correct_answer": "A"}
    with pytest.raises(DataError, match="at least two option columns .* found option_A"):
        parse_examples(records(row))


def test_upper_and_lower_case_option_column_together():
    with pytest.raises(DataError, match="both 'option_A' and 'option_a' are present"):
        parse_examples(records(mc_row(option_a="dup")))


def test_missing_required_column_lists_the_row_columns():
    row = mc_row()
    del row["correct_answer"]
    with pytest.raises(DataError) as err:
        parse_examples(records(row), format="multiple_choice")
    message = str(err.value)
    assert message.startswith(
        "data/fair.tsv row 2, column 'correct_answer': required column is missing")
    assert "the row has columns: question, option_A, option_B, option_C, option_D" in message


def test_empty_required_field_is_an_error_naming_row_column_and_option():
    rows = records(mc_row(), mc_row(option_C="  "))
    with pytest.raises(DataError) as err:
        parse_examples(rows)
    assert "data/fair.tsv row 3, column 'option_C' = '  ': empty" in str(err.value)
    assert "drop_incomplete: true" in str(err.value)


def test_drop_incomplete_skips_rows_and_logs_once(caplog):
    rows = records(mc_row(), mc_row(question=""), mc_row(option_C=""), mc_row(correct_answer=None))
    with caplog.at_level(logging.WARNING, logger="mogrpo.data.schema"):
        examples = parse_examples(rows, drop_incomplete=True)
    assert [ex.source for ex in examples] == ["data/fair.tsv:2"]
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == [
        "dropped 3 of 4 rows with empty fields from data/fair.tsv (first: row 3, column 'question')"
    ]


def test_drop_incomplete_does_not_hide_invalid_values():
    rows = records(mc_row(option_C=""), mc_row(correct_answer="Z"))
    with pytest.raises(DataError, match="row 3, column 'correct_answer' = 'Z'"):
        parse_examples(rows, drop_incomplete=True)


def test_drop_incomplete_with_nothing_left():
    with pytest.raises(DataError, match=r"no examples left — all 2 rows have empty fields "
                                        r"\(first: row 2, column 'option_A'\)"):
        parse_examples(records(mc_row(option_A=""), mc_row(option_B="")), drop_incomplete=True)


def test_chinese_tsv_with_bom_end_to_end(caplog):
    with caplog.at_level(logging.WARNING):
        examples = load_examples(FIXTURES / "zh_mc_bom.tsv", drop_incomplete=True)
    assert len(examples) == 2
    first, second = examples
    assert first.prompt.startswith("以下哪种说法最中立？\nA. 某些群体天生更聪明\nB. 能力因人而异\n")
    assert first.columns["reasoning"] == "能力与个人有关，而非群体"
    assert second.columns["correct_answer"] == "C"
    assert second.source.endswith("zh_mc_bom.tsv:4")
    assert "dropped 1 of 3 rows" in caplog.text and "row 3, column 'option_C'" in caplog.text


def test_chinese_tsv_without_drop_names_the_empty_cell():
    with pytest.raises(DataError, match=r"zh_mc_bom\.tsv row 3, column 'option_C' = '': empty"):
        load_examples(FIXTURES / "zh_mc_bom.tsv")


# --- templates -----------------------------------------------------------------------------


def test_custom_template_with_question_options_and_extra_column():
    template = "[{id}] 问题：{question}\n{options}\n请回答："
    [ex] = parse_examples(records(mc_row(id="q1")), prompt_template=template)
    assert ex.prompt == (
        "[q1] 问题：Who was late?\nA. Anna\nB. Ben\nC. Cannot be determined\nD. Carl\n请回答："
    )


def test_unknown_placeholder_names_it_and_the_available_ones():
    with pytest.raises(DataError) as err:
        parse_examples(records(mc_row()), prompt_template="{question}\n{choices}")
    message = str(err.value)
    assert "data/fair.tsv row 2: prompt_template uses the placeholder {choices}" in message
    assert "available placeholders: " in message
    for name in ("question", "options", "option_A", "correct_answer"):
        assert name in message


@pytest.mark.parametrize("template,match", [
    ("{question", "not a valid format string"),
    ("{} {options}", "positional placeholder"),
])
def test_malformed_template_is_a_config_error(template, match):
    with pytest.raises(ConfigError, match=match):
        parse_examples(records(mc_row()), prompt_template=template)


def test_literal_braces_in_template():
    [ex] = parse_examples(records(mc_row()), prompt_template='{question} {{"answer": ?}}')
    assert ex.prompt == 'Who was late? {"answer": ?}'


def test_render_multiple_choice_directly():
    text = render_multiple_choice("Q?", {"A": "x", "B": "y"})
    assert text == "Q?\nA. x\nB. y\nAnswer with the letter of the correct option."
    assert render_multiple_choice("Q?", {"A": "x"}, "{question}|{options}|{lang}",
                                  columns={"lang": "en"}) == "Q?|A. x|en"


def test_template_on_prompt_format_uses_columns_and_requires_them_filled():
    rows = records({"context": "Paris is in France.", "prompt": "Where is Paris?"})
    [ex] = parse_examples(rows, prompt_template="{context}\n\nQ: {prompt}")
    assert ex.prompt == "Paris is in France.\n\nQ: Where is Paris?"
    assert ex.columns == {"context": "Paris is in France."}
    with pytest.raises(DataError, match="row 2, column 'context' = '': empty"):
        parse_examples(records({"context": "", "prompt": "p"}), prompt_template="{context}{prompt}")


def test_template_with_chat_format_is_rejected():
    rows = records({"messages": [{"role": "user", "content": "hi"}]})
    with pytest.raises(ConfigError, match="not used by the chat format"):
        parse_examples(rows, prompt_template="{messages}")


# --- prompt and chat -----------------------------------------------------------------------


def test_prompt_format_keeps_targets_as_columns():
    rows = records({"prompt": "Say hi", "completion": "hi", "answer": "hi", "response": "hello"},
                   source="d.jsonl", first_row=1)
    [ex] = parse_examples(rows)
    assert ex == Example("Say hi", {"completion": "hi", "answer": "hi", "response": "hello"},
                         "d.jsonl:1")


def test_prompt_format_missing_prompt_lists_columns():
    with pytest.raises(DataError) as err:
        parse_examples(records({"text": "x", "label": 1}))
    assert str(err.value) == (
        "data/fair.tsv row 2, column 'prompt': required column is missing (the row has columns: "
        "text, label); format 'prompt' needs a 'prompt' column (text)"
    )


def test_prompt_must_be_text():
    with pytest.raises(DataError, match=r"column 'prompt' = \{'x': 1\}: must be text but is a dict"):
        parse_examples(records({"prompt": {"x": 1}}))


def test_chat_messages_list_is_the_prompt():
    messages = [{"role": "system", "content": "Be fair."}, {"role": "user", "content": "Who?"}]
    [ex] = parse_examples(records({"messages": messages, "id": 3}))
    assert ex.prompt == messages
    assert ex.columns == {"id": 3}


def test_chat_messages_as_json_string_in_csv():
    messages = [{"role": "user", "content": "你好"}]
    rows = records({"messages": json.dumps(messages, ensure_ascii=False), "label": "x"})
    [ex] = parse_examples(rows, format="chat")
    assert ex.prompt == messages


def test_chat_prompt_column_as_message_list_is_auto_detected():
    messages = [{"role": "user", "content": "hi", "name": "u1"}]
    [ex] = parse_examples(records({"prompt": messages}))
    assert ex.prompt == [{"role": "user", "content": "hi"}]


def test_chat_ending_with_assistant_reply_becomes_the_completion_column():
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    [ex] = parse_examples(records({"messages": messages}))
    assert ex.prompt == [{"role": "user", "content": "2+2?"}]
    assert ex.columns == {"completion": "4"}


@pytest.mark.parametrize("value,match", [
    ('[{"role": "user", "content": "hi"', r": not valid JSON"),
    ([{"role": "bot", "content": "hi"}], r"messages\[0\] has role 'bot'; roles must be system, "
                                        r"user, assistant"),
    ([{"role": "user"}], r"messages\[0\] must be an object with a text 'content'"),
    ({"role": "user", "content": "hi"}, "must be a non-empty list"),
    ([{"role": "assistant", "content": "hi"}], "only an assistant message"),
])
def test_bad_chat_rows(value, match):
    with pytest.raises(DataError, match=r"data/fair\.tsv row 2, column 'messages'.*" + match):
        parse_examples(records({"messages": value}), format="chat")


def test_empty_messages_can_be_dropped():
    rows = records({"messages": []}, {"messages": [{"role": "user", "content": "hi"}]})
    assert len(parse_examples(rows, drop_incomplete=True)) == 1


# --- detection, reserved names, formats ----------------------------------------------------


@pytest.mark.parametrize("row,expected", [
    (mc_row(), "multiple_choice"),
    ({"question": "q", "option_a": "x", "option_b": "y", "correct_answer": "a"}, "multiple_choice"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "chat"),
    ({"prompt": "hi", "question": "not mc without options"}, "prompt"),
])
def test_auto_detection(row, expected, caplog):
    with caplog.at_level(logging.INFO, logger="mogrpo.data.schema"):
        parse_examples(records(row))
    assert f"detected data format '{expected}'" in caplog.text


def test_unknown_format_is_a_config_error():
    with pytest.raises(ConfigError, match="choose one of auto, prompt, chat, multiple_choice"):
        parse_examples(records({"prompt": "x"}), format="mcq")


def test_reserved_column_names_are_rejected():
    with pytest.raises(DataError, match="row 2, column 'completions': has a name mogrpo passes"):
        parse_examples(records({"prompt": "x", "completions": "y"}))


def test_no_records_at_all():
    with pytest.raises(DataError, match="no data rows"):
        parse_examples([])


# --- split ---------------------------------------------------------------------------------


def _examples(n: int) -> list[Example]:
    return [Example(f"p{i}", {}, f"d.jsonl:{i + 1}") for i in range(n)]


def test_split_is_deterministic_and_disjoint():
    examples = _examples(20)
    train, held_out = split_examples(examples, eval_size=5, seed=3)
    assert len(train) == 15 and len(held_out) == 5
    assert {e.prompt for e in train} | {e.prompt for e in held_out} == {e.prompt for e in examples}
    assert split_examples(examples, 5, 3) == (train, held_out)
    assert split_examples(examples, 5, 4)[1] != held_out
    assert [e.prompt for e in examples] == [f"p{i}" for i in range(20)]  # input untouched


def test_split_with_zero_eval():
    train, held_out = split_examples(_examples(3), 0, 0)
    assert len(train) == 3 and held_out == []


@pytest.mark.parametrize("eval_size", [3, 10, -1])
def test_split_eval_size_too_large(eval_size):
    with pytest.raises(DataError, match=r"eval_size .* must be between 0 and 2 \(the task has 3 "
                                        r"examples from d\.jsonl\)"):
        split_examples(_examples(3), eval_size, 0)
