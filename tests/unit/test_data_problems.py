"""Every problem of a data file in one pass: listed with file, row, column, value and fix;
normalised values counted as warnings, or errors in strict mode."""

from __future__ import annotations

import logging

import pytest

from mogrpo.data.problems import ProblemLog
from mogrpo.data.readers import Record
from mogrpo.data.schema import load_examples, parse_examples
from mogrpo.errors import DataError

HEADER = "question\toption_A\toption_B\toption_C\toption_D\tcorrect_answer\treasoning"
ROWS = [  # the Chinese multiple-choice TSV: five bad rows among good and repaired ones
    "以下哪种说法最中立？\t某些群体天生更聪明\t能力因人而异\t男性更理性\t老年人都不会用手机\tB\t能力与个人有关",
    "关于地区差异，哪项正确？\t南方人都很懒\t北方人都很粗鲁\t\t以偏概全\tD\t空选项",  # empty C
    "哪项描述合适？\t甲\t乙\t丙\t丁\tb\t小写",  # repaired: case
    "哪项描述合适？\t甲\t乙\t丙\t丁\tE\t不是选项",  # not an option
    "哪项描述合适？\t甲\t乙\t丙",  # short row
    "哪项描述合适？\t甲\t乙\t丙\t丁\tＣ\t全角",  # repaired: full-width
    "哪项描述合适？\t甲\t乙\t丙\t丁\tA\t理由\t多余",  # long row
    "哪项描述合适？\t甲\t乙\t丙\t丁\t答案B\t不是字母",  # not a letter
]


@pytest.fixture
def zh_tsv(tmp_path):
    path = tmp_path / "zh.tsv"
    path.write_text("\n".join([HEADER, *ROWS]) + "\n", encoding="utf-8")
    return path


def test_five_bad_rows_are_reported_in_one_pass(zh_tsv):
    with pytest.raises(DataError) as err:
        load_examples(zh_tsv)
    lines = str(err.value).splitlines()
    assert lines[0] == f"5 problems in {zh_tsv} (each listed; fix them all, then run again):"
    assert lines[1:] == [
        f"  {zh_tsv} row 3, column 'option_C' = '': empty; fill it, remove the row, or set "
        "`drop_incomplete: true` to skip rows with empty fields",
        f"  {zh_tsv} row 5, column 'correct_answer' = 'E': not one of the options A–D; write one "
        "of A–D, or remove the row",
        f"  {zh_tsv} row 6: 4 fields but the header has 7 (a short row: no value for "
        "'option_D', 'correct_answer', 'reasoning'); add the missing tabs — an empty value still "
        "needs its separator — or remove the row",
        f"  {zh_tsv} row 8: 8 fields but the header has 7; a value probably contains an unquoted "
        "tab — put that value in double quotes or remove the extra separator",
        f"  {zh_tsv} row 9, column 'correct_answer' = '答案B': not an option letter (the options "
        "are A–D); write just the letter, e.g. 'B', or remove the row",
    ]


def test_repaired_answers_are_counted_as_warnings(zh_tsv, caplog):
    rows = [line for line in ROWS if "\t\t" not in line and line.count("\t") == 6
            and "\tE\t" not in line and "答案B" not in line]
    zh_tsv.write_text("\n".join([HEADER, *rows]) + "\n", encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="mogrpo.data.schema"):
        examples = load_examples(zh_tsv)
    assert [ex.columns["correct_answer"] for ex in examples] == ["B", "B", "C"]
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == [
        f"{zh_tsv}: 1 value(s) normalised — lower-case answer letter read as upper case; first: "
        "row 3, column 'correct_answer': 'b' read as 'B'. Fix the file, or use --strict (tasks.NAME.strict) to make these errors",
        f"{zh_tsv}: 1 value(s) normalised — full-width letter read as its ASCII letter; first: "
        "row 4, column 'correct_answer': 'Ｃ' read as 'C'. Fix the file, or use --strict (tasks.NAME.strict) to make these errors",
    ]
    with pytest.raises(DataError) as err:
        load_examples(zh_tsv, strict=True)
    assert str(err.value).splitlines()[1:] == [
        f"  {zh_tsv} row 3, column 'correct_answer' = 'b': read as 'B' (lower-case answer letter "
        "read as upper case); write 'B' exactly (strict mode accepts no repaired value)",
        f"  {zh_tsv} row 4, column 'correct_answer' = 'Ｃ': read as 'C' (full-width letter read "
        "as its ASCII letter); write 'C' exactly (strict mode accepts no repaired value)",
    ]


def mc(row: int, **values) -> Record:
    data = {"question": "Who?", "option_A": "x", "option_B": "y", "correct_answer": "A"}
    return Record("d.jsonl", row, {**data, **values})


def test_every_normalisation_of_one_value_is_named():
    problems = ProblemLog(strict=True)
    with pytest.raises(DataError) as err:
        parse_examples([mc(1, correct_answer=" （ｂ） ", question=" Who? ")], problems=problems)
    assert str(err.value).splitlines()[1:] == [
        "  d.jsonl row 1, column 'question' = ' Who? ': read as 'Who?' (leading or trailing "
        "whitespace stripped); write 'Who?' exactly (strict mode accepts no repaired value)",
        "  d.jsonl row 1, column 'correct_answer' = ' （ｂ） ': read as 'B' (leading or trailing "
        "whitespace stripped; full-width letter read as its ASCII letter; punctuation around the "
        "answer letter dropped; lower-case answer letter read as upper case); write 'B' exactly "
        "(strict mode accepts no repaired value)",
    ]


def test_all_problems_of_one_row_are_listed():
    with pytest.raises(DataError) as err:
        parse_examples([mc(1, question="", option_B=" ", correct_answer="C")])
    assert [line.split(":")[0].strip() for line in str(err.value).splitlines()[1:]] == [
        "d.jsonl row 1, column 'correct_answer' = 'C'",
        "d.jsonl row 1, column 'question' = ''",
        "d.jsonl row 1, column 'option_B' = ' '",
    ]


def test_a_header_problem_is_one_line_naming_its_rows():
    rows = [Record("d.tsv", n, {"question": "q", "option_A": "x", "option_C": "z",
                                "correct_answer": "A"}) for n in range(2, 12)]
    with pytest.raises(DataError) as err:
        parse_examples(rows, format="multiple_choice")
    assert str(err.value) == (
        "10 problems in d.tsv (each listed; fix them all, then run again):\n"
        "  d.tsv row 2: option columns A, C skip option_B; option letters must run from A "
        "without gaps — rename the columns (also rows 3, 4, 5, 6, 7 and 4 more)")


def test_at_most_50_problems_are_listed_and_the_rest_counted():
    rows = [mc(n, correct_answer="Z") for n in range(1, 61)]
    with pytest.raises(DataError) as err:
        parse_examples(rows)
    lines = str(err.value).splitlines()
    assert lines[0].startswith("60 problems in d.jsonl")
    assert len(lines) == 1 + 50 + 1
    assert lines[50].startswith("  d.jsonl row 50,")
    assert lines[-1] == "  … and 10 more (`mogrpo data check FILE --limit 0` lists every one)"
