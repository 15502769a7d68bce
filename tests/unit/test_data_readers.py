"""Readers: every format, row numbers a user can find in an editor, and readable errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mogrpo.data.problems import ProblemLog
from mogrpo.data.readers import Record, read_records
from mogrpo.errors import DataError

FIXTURES = Path(__file__).parent / "fixtures"


def write(path: Path, text: str, encoding: str = "utf-8") -> Path:
    path.write_bytes(text.encode(encoding))
    return path


def test_jsonl_rows_are_line_numbers_and_blank_lines_are_skipped(tmp_path):
    path = write(tmp_path / "d.jsonl", '{"prompt": "a"}\n\n{"prompt": "b", "answer": 2}\n')
    records = read_records(path)
    assert records == [
        Record(str(path), 1, {"prompt": "a"}),
        Record(str(path), 3, {"prompt": "b", "answer": 2}),
    ]


def test_source_is_the_path_as_given(tmp_path, monkeypatch):
    write(tmp_path / "d.jsonl", '{"prompt": "a"}\n')
    monkeypatch.chdir(tmp_path)
    assert read_records("d.jsonl")[0].source == "d.jsonl"


def test_jsonl_chinese_with_bom_round_trips(tmp_path):
    row = {"prompt": "你好，世界", "answer": "答案：A"}
    path = write(tmp_path / "zh.jsonl", json.dumps(row, ensure_ascii=False) + "\n", "utf-8-sig")
    assert read_records(path)[0].data == row


def test_jsonl_keeps_unicode_line_separator_inside_strings(tmp_path):
    path = write(tmp_path / "d.jsonl", '{"prompt": "a\u2028b"}\n{"prompt": "c"}\n')
    records = read_records(path)
    assert [r.data["prompt"] for r in records] == ["a\u2028b", "c"]
    assert [r.row for r in records] == [1, 2]


def test_json_file_may_hold_json_lines(tmp_path):
    path = write(tmp_path / "d.json", '{"prompt": "a"}\n{"prompt": "b"}\n')
    assert [r.data["prompt"] for r in read_records(path)] == ["a", "b"]


def test_json_top_level_list_rows_are_lines_of_each_element(tmp_path):
    text = '[\n  {"prompt": "a"},\n  {\n    "prompt": "b"\n  }\n]\n'
    records = read_records(write(tmp_path / "d.json", text))
    assert [(r.row, r.data["prompt"]) for r in records] == [(2, "a"), (3, "b")]


def test_json_list_with_a_non_object_names_its_row(tmp_path):
    path = write(tmp_path / "d.json", '[\n{"prompt": "a"},\n["b"]\n]')
    with pytest.raises(DataError, match=r"d\.json row 3: expected a JSON object .* found an array"):
        read_records(path)


def test_json_list_syntax_error_names_its_row(tmp_path):
    path = write(tmp_path / "d.json", '[\n{"prompt": "a"}\n{"prompt": "b"}\n]')
    with pytest.raises(DataError, match=r"d\.json row 3: invalid JSON \(Expecting ',' delimiter"):
        read_records(path)


def test_csv_first_data_row_is_row_2(tmp_path):
    path = write(tmp_path / "d.csv", "prompt,answer\nhello,1\n\nbye,2\n")
    records = read_records(path)
    assert [(r.row, r.data) for r in records] == [
        (2, {"prompt": "hello", "answer": "1"}),
        (4, {"prompt": "bye", "answer": "2"}),
    ]


def test_csv_quoted_multiline_field_keeps_later_row_numbers_right(tmp_path):
    path = write(tmp_path / "d.csv", 'prompt,answer\n"line one\nline two",1\nbye,2\n')
    records = read_records(path)
    assert records[0].data["prompt"] == "line one\nline two"
    assert [r.row for r in records] == [2, 4]


def test_csv_with_windows_line_endings(tmp_path):
    path = write(tmp_path / "d.csv", "prompt,answer\r\nhello,1\r\nbye,2\r\n")
    assert [(r.row, r.data["answer"]) for r in read_records(path)] == [(2, "1"), (3, "2")]


def test_csv_short_row_is_reported_as_short_not_padded(tmp_path):
    path = write(tmp_path / "d.csv", "prompt,answer,id\nhello,1\n")
    with pytest.raises(DataError) as err:
        read_records(path)
    assert str(err.value) == (
        f"{path} row 2: 2 fields but the header has 3 (a short row: no value for 'id'); add the "
        "missing commas — an empty value still needs its separator — or remove the row")


def test_csv_row_with_too_many_fields_names_row_and_fix(tmp_path):
    path = write(tmp_path / "d.csv", "prompt,answer\nhello,1\nhi, there,2\n")
    with pytest.raises(DataError) as err:
        read_records(path)
    message = str(err.value)
    assert f"{path} row 3: 3 fields but the header has 2" in message
    assert "unquoted comma" in message and "double quotes" in message


def test_every_bad_row_is_reported_in_one_read(tmp_path):
    text = "q\ta\tb\nok\t1\t2\nshort\t1\nlong\t1\t2\t3\nok\t1\t2\nshort\n"
    path = write(tmp_path / "d.tsv", text)
    with pytest.raises(DataError) as err:
        read_records(path)
    lines = str(err.value).splitlines()
    assert lines[0] == f"3 problems in {path} (each listed; fix them all, then run again):"
    assert [line.split(":")[0].strip() for line in lines[1:]] == [
        f"{path} row 3", f"{path} row 4", f"{path} row 6"]
    assert "a short row: no value for 'b'" in lines[1] and "add the missing tabs" in lines[1]
    assert "4 fields but the header has 3" in lines[2] and "unquoted tab" in lines[2]
    assert "a short row: no value for 'a', 'b'" in lines[3]


def test_bad_rows_go_to_a_given_log_and_good_rows_are_kept(tmp_path):
    path = write(tmp_path / "d.jsonl", '{"prompt": "a"}\n{"prompt": \n"text"\n{"prompt": "b"}\n')
    problems = ProblemLog()
    records = read_records(path, problems)
    assert [r.row for r in records] == [1, 4]
    assert [(p.row, p.kind) for p in problems.errors] == [(2, "invalid_json"), (3, "invalid_json")]
    assert "found a string" in problems.errors[1].what


def test_tsv_header_names_are_stripped_and_empty_ones_named(tmp_path):
    path = write(tmp_path / "d.tsv", "\t prompt \tanswer\n0\thello\t1\n")
    assert read_records(path)[0].data == {"unnamed_1": "0", "prompt": "hello", "answer": "1"}


def test_tsv_duplicate_header_is_an_error(tmp_path):
    path = write(tmp_path / "d.tsv", "prompt\tprompt\na\tb\n")
    with pytest.raises(DataError, match=r"row 1: the header has column 'prompt' twice \(columns 1 and 2\)"):
        read_records(path)


def test_chinese_tsv_with_bom_round_trips():
    records = read_records(FIXTURES / "zh_mc_bom.tsv")
    assert len(records) == 3
    first = records[0]
    assert list(first.data)[0] == "question"  # the BOM is not part of the first column name
    assert first.data["question"] == "以下哪种说法最中立？"
    assert first.data["reasoning"] == "能力与个人有关，而非群体"
    assert [r.row for r in records] == [2, 3, 4]
    assert records[1].data["option_C"] == ""


def test_missing_file_names_path_and_config_field(tmp_path):
    with pytest.raises(DataError) as err:
        read_records(tmp_path / "nope.jsonl")
    assert "data file not found" in str(err.value)
    assert "nope.jsonl" in str(err.value)
    assert "check `tasks.<name>.data`" in str(err.value)


def test_directory_is_not_a_data_file(tmp_path):
    (tmp_path / "dir.jsonl").mkdir()
    with pytest.raises(DataError, match="is a directory"):
        read_records(tmp_path / "dir.jsonl")


@pytest.mark.parametrize("name", ["d.parquet", "d.txt", "data"])
def test_unsupported_extension_lists_supported_ones(tmp_path, name):
    path = write(tmp_path / name, "prompt\nx\n")
    with pytest.raises(DataError, match=r"unsupported file type .*\.jsonl, \.json, \.csv, \.tsv"):
        read_records(path)


def test_invalid_json_line_names_row_and_json_error(tmp_path):
    path = write(tmp_path / "d.jsonl", '{"prompt": "a"}\n{"prompt": "b",}\n')
    with pytest.raises(DataError) as err:
        read_records(path)
    assert f"{path} row 2: invalid JSON (Expecting property name" in str(err.value)


def test_jsonl_row_that_is_not_an_object(tmp_path):
    path = write(tmp_path / "d.jsonl", '{"prompt": "a"}\n"just text"\n')
    with pytest.raises(DataError, match=r"row 2: expected a JSON object .* found a string"):
        read_records(path)


@pytest.mark.parametrize("name,text", [
    ("e.jsonl", ""), ("e.csv", "  \n\n"), ("e.tsv", ""),
])
def test_empty_file(tmp_path, name, text):
    with pytest.raises(DataError, match="the file is empty"):
        read_records(write(tmp_path / name, text))


@pytest.mark.parametrize("name,text,match", [
    ("h.csv", "prompt,answer\n", "header but no data rows"),
    ("l.json", "[]", "no data rows"),
])
def test_files_without_rows(tmp_path, name, text, match):
    with pytest.raises(DataError, match=match):
        read_records(write(tmp_path / name, text))


def test_non_utf8_file_names_line_and_fix(tmp_path):
    path = write(tmp_path / "gbk.csv", "prompt\n你好\n", "gbk")
    with pytest.raises(DataError) as err:
        read_records(path)
    assert "row 2: the file is not valid UTF-8" in str(err.value)
    assert "re-save it as UTF-8" in str(err.value)
