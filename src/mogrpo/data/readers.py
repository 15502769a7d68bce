"""Read data files into row-numbered records: JSON Lines, JSON lists, CSV and TSV.

Every record keeps the file it came from and the line a user would open in an editor, so a
bad row can be reported as ``data/fair.tsv row 17`` instead of "index 15".
"""

from __future__ import annotations

import csv
import io
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mogrpo.errors import DataError

log = logging.getLogger(__name__)

SUPPORTED_EXTENSIONS = (".jsonl", ".json", ".csv", ".tsv")


@dataclass(frozen=True)
class Record:
    """One row of a data file.

    `row` is the 1-based line number where the row starts (a CSV header is line 1, so the
    first CSV data row is row 2); for a JSON list it is the line of the element's opening brace.
    """

    source: str
    row: int
    data: dict[str, Any]


def read_records(path: str | Path) -> list[Record]:
    """Read a `.jsonl`, `.json`, `.csv` or `.tsv` file (UTF-8, with or without BOM)."""
    source = str(path)
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in SUPPORTED_EXTENSIONS:
        raise DataError(
            f"{source}: unsupported file type {p.suffix or '(no extension)'!r}; supported: "
            f"{', '.join(SUPPORTED_EXTENSIONS)}. Convert the file or rename it if it already "
            "is one of these formats"
        )
    text = _read_text(p, source)
    if not text.strip():
        raise DataError(f"{source}: the file is empty; point `tasks.<name>.data` at a file with rows")
    if suffix == ".jsonl" or (suffix == ".json" and not text.lstrip().startswith("[")):
        records = _read_json_lines(text, source)
    elif suffix == ".json":
        records = _read_json_list(text, source)
    else:
        records = _read_delimited(text, source, delimiter="," if suffix == ".csv" else "\t")
    if not records:
        raise DataError(f"{source}: the file has no data rows")
    log.debug("read %d records from %s", len(records), source)
    return records


def _read_text(p: Path, source: str) -> str:
    if not p.exists():
        raise DataError(
            f"data file not found: {source} (resolved to {p.resolve()}); "
            "check `tasks.<name>.data` in your config"
        )
    if not p.is_file():
        raise DataError(f"{source} is a directory, not a data file; check `tasks.<name>.data`")
    raw = p.read_bytes()
    try:
        # utf-8-sig drops a leading byte-order mark (Excel and Notepad write one).
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise DataError(
            f"{source} row {line}: the file is not valid UTF-8 ({e.reason} at byte {e.start}); "
            "re-save it as UTF-8 (in Excel: Save As > 'CSV UTF-8')"
        ) from None


def _object_or_error(value: Any, source: str, row: int) -> dict[str, Any]:
    if not isinstance(value, dict):
        kind = {list: "an array", str: "a string", type(None): "null"}.get(type(value), "a number")
        raise DataError(
            f"{source} row {row}: expected a JSON object like {{\"prompt\": \"...\"}} but found "
            f"{kind}; each row must be one object mapping column names to values"
        )
    return value


def _read_json_lines(text: str, source: str) -> list[Record]:
    records = []
    # Split on "\n" only: str.splitlines() would also split on U+2028, which JSON strings
    # written with ensure_ascii=False may contain unescaped.
    for row, line in enumerate(text.split("\n"), start=1):
        line = line.strip()
        if not line:
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(
                f"{source} row {row}: invalid JSON ({e.msg} at column {e.colno}); each line must "
                "hold one complete JSON object (a pretty-printed file must be a top-level list "
                "in a .json file)"
            ) from None
        records.append(Record(source, row, _object_or_error(value, source, row)))
    return records


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _read_json_list(text: str, source: str) -> list[Record]:
    """Parse a top-level JSON list element by element, to know each element's line."""
    decoder = json.JSONDecoder()
    records = []
    pos = _skip_ws(text, text.index("[") + 1)
    try:
        while pos < len(text) and text[pos] != "]":
            value, end = decoder.raw_decode(text, pos)
            row = text.count("\n", 0, pos) + 1
            records.append(Record(source, row, _object_or_error(value, source, row)))
            pos = _skip_ws(text, end)
            if pos < len(text) and text[pos] == ",":
                pos = _skip_ws(text, pos + 1)
            elif pos >= len(text) or text[pos] != "]":
                raise json.JSONDecodeError("Expecting ',' delimiter", text, pos)
        if pos >= len(text):
            raise json.JSONDecodeError("Expecting ']' to close the list", text, pos)
        if text[pos + 1:].strip():
            raise json.JSONDecodeError("Extra data after the closing ']'", text, pos + 1)
    except json.JSONDecodeError as e:
        raise DataError(
            f"{source} row {e.lineno}: invalid JSON ({e.msg} at column {e.colno}); fix the file "
            "so it is one JSON list of objects, or use JSON Lines (.jsonl), one object per line"
        ) from None
    return records


def _header(fields: list[str], source: str) -> list[str]:
    names = []
    for i, name in enumerate(fields, start=1):
        # A pandas index written with the data has an empty header cell.
        name = name.strip() or f"unnamed_{i}"
        if name in names:
            raise DataError(
                f"{source} row 1: the header has column {name!r} twice (columns "
                f"{names.index(name) + 1} and {i}); rename one of them"
            )
        names.append(name)
    return names


def _read_delimited(text: str, source: str, delimiter: str) -> list[Record]:
    kind = "tab" if delimiter == "\t" else "comma"
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter)
    header: list[str] | None = None
    records = []
    next_line = 1  # the line the next record starts on (quoted fields may span lines)
    try:
        for fields in reader:
            row, next_line = next_line, reader.line_num + 1
            if not fields or (len(fields) == 1 and not fields[0].strip()):
                continue  # blank line
            if header is None:
                header = _header(fields, source)
                continue
            if len(fields) > len(header):
                raise DataError(
                    f"{source} row {row}: {len(fields)} fields but the header has "
                    f"{len(header)}; a value probably contains an unquoted {kind} — put that "
                    "value in double quotes or remove the extra separator"
                )
            fields += [""] * (len(header) - len(fields))
            records.append(Record(source, row, dict(zip(header, fields, strict=True))))
    except csv.Error as e:
        raise DataError(
            f"{source} row {reader.line_num}: cannot parse the row ({e}); check its quotes"
        ) from None
    if header is not None and not records:
        raise DataError(f"{source}: the file has a header but no data rows")
    return records
