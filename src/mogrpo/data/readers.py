"""Read data files into row-numbered records: JSON Lines, JSON lists, CSV and TSV.

Every record keeps the file it came from and the line a user would open in an editor, so a
bad row can be reported as ``data/fair.tsv row 17`` instead of "index 15". A bad row (invalid
JSON, too few or too many fields) is recorded in a `ProblemLog` and skipped, so one read
reports every bad row; a file that cannot be read at all (missing, not UTF-8, an unbalanced
JSON list) is one error at once.
"""

from __future__ import annotations

import csv
import io
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mogrpo.data.problems import Problem, ProblemLog
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


def read_records(path: str | Path, problems: ProblemLog | None = None) -> list[Record]:
    """Read a `.jsonl`, `.json`, `.csv` or `.tsv` file (UTF-8, with or without BOM).

    Bad rows are recorded in `problems` and skipped (the caller raises them, together with
    what it finds later); without a log they are raised here, all at once.
    """
    own = problems is None
    problems = ProblemLog() if problems is None else problems
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
        records = _read_json_lines(text, source, problems)
    elif suffix == ".json":
        records = _read_json_list(text, source, problems)
    else:
        delimiter = "," if suffix == ".csv" else "\t"
        records = _read_delimited(text, source, delimiter, problems)
    if own:
        problems.raise_errors()
    if not records and not problems.ok:
        return []  # every row was bad: the caller reports them
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


def _not_an_object(value: Any) -> str | None:
    """What is wrong with a JSON row that is not an object (None when it is one)."""
    if isinstance(value, dict):
        return None
    kind = {list: "an array", str: "a string", type(None): "null"}.get(type(value), "a number")
    return f"expected a JSON object like {{\"prompt\": \"...\"}} but found {kind}"


_OBJECT_FIX = "each row must be one object mapping column names to values"


def _read_json_lines(text: str, source: str, problems: ProblemLog) -> list[Record]:
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
            problems.error(Problem(
                source, row, None, f"invalid JSON ({e.msg} at column {e.colno})",
                "each line must hold one complete JSON object (a pretty-printed file must be a "
                "top-level list in a .json file)", kind="invalid_json"))
            continue
        what = _not_an_object(value)
        if what is not None:
            problems.error(Problem(source, row, None, what, _OBJECT_FIX, kind="invalid_json"))
            continue
        records.append(Record(source, row, value))
    return records


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _read_json_list(text: str, source: str, problems: ProblemLog) -> list[Record]:
    """Parse a top-level JSON list element by element, to know each element's line."""
    decoder = json.JSONDecoder()
    records = []
    pos = _skip_ws(text, text.index("[") + 1)
    try:
        while pos < len(text) and text[pos] != "]":
            value, end = decoder.raw_decode(text, pos)
            row = text.count("\n", 0, pos) + 1
            what = _not_an_object(value)
            if what is None:
                records.append(Record(source, row, value))
            else:
                problems.error(Problem(source, row, None, what, _OBJECT_FIX, kind="invalid_json"))
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


def _field_count(fields: list[str], header: list[str], kind: str) -> tuple[str, str] | None:
    """(what, fix) for a row with too few or too many fields; None when the count is right."""
    if len(fields) > len(header):
        return (f"{len(fields)} fields but the header has {len(header)}",
                f"a value probably contains an unquoted {kind} — put that value in double "
                "quotes or remove the extra separator")
    if len(fields) < len(header):
        missing = ", ".join(repr(name) for name in header[len(fields):])
        return (f"{len(fields)} fields but the header has {len(header)} (a short row: no value "
                f"for {missing})",
                f"add the missing {kind}s — an empty value still needs its separator — or "
                "remove the row")
    return None


def _read_delimited(text: str, source: str, delimiter: str, problems: ProblemLog) -> list[Record]:
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
            wrong = _field_count(fields, header, kind)
            if wrong is not None:
                short = len(fields) < len(header)
                problems.error(Problem(source, row, None, *wrong,
                                       kind="short_row" if short else "long_row"))
                continue
            records.append(Record(source, row, dict(zip(header, fields, strict=True))))
    except csv.Error as e:
        raise DataError(
            f"{source} row {reader.line_num}: cannot parse the row ({e}); check its quotes"
        ) from None
    if header is not None and not records and problems.ok:
        raise DataError(f"{source}: the file has a header but no data rows")
    return records
