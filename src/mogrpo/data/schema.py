"""Turn records into prompts: plain prompts, chat conversations and multiple-choice questions.

Every column that is not the prompt travels with the example in `columns` and reaches the
reward functions as a keyword argument (TRL-style), so `correct_answer` or `reasoning` are
available where scores are computed.

Every problem of every row is recorded in a `ProblemLog` (file, row, column, value, fix) and
reported at once; values read differently from how they are written (an answer `b` read as
`B`, stripped whitespace) are counted as warnings, or are errors in strict mode.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import random
import re
import string
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from mogrpo.data.problems import NO_VALUE, Problem, ProblemLog
from mogrpo.data.readers import Record, read_records
from mogrpo.errors import ConfigError, DataError
from mogrpo.templates import placeholders

log = logging.getLogger(__name__)

DATA_FORMATS = ("auto", "prompt", "chat", "multiple_choice")
CHAT_ROLES = ("system", "user", "assistant")
# Names the trainer itself passes to reward functions; a column with one of them would clash.
RESERVED_COLUMNS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra",
                    "log_metric", "completion_lengths", "truncated")
MC_INSTRUCTION = "Answer with the letter of the correct option."

_OPTION_COLUMN = re.compile(r"option_([A-Za-z])")
_ANSWER_LETTER = re.compile(r"[\s(\[（【\"'“‘]*([A-Za-z])[\s)\]）】.。:：,，\"'”’]*")
_FULLWIDTH = str.maketrans(
    "ＡＢＣＤＥＦＧＨＩＪＫＬＭＮＯＰＱＲＳＴＵＶＷＸＹＺａｂｃｄｅｆｇｈｉｊｋｌｍｎｏｐｑｒｓｔｕｖｗｘｙｚ",
    string.ascii_uppercase + string.ascii_lowercase,
)
_REQUIRED_HINT = {
    "prompt": "format 'prompt' needs a 'prompt' column (text)",
    "chat": "format 'chat' needs a 'messages' column (a list of {role, content})",
    "multiple_choice": "format 'multiple_choice' needs 'question', 'option_A', 'option_B', … "
    "and 'correct_answer' columns",
}
_EMPTY_FIX = ("fill it, remove the row, or set `drop_incomplete: true` to skip rows with empty "
              "fields")


@dataclass
class Example:
    """One prompt with the columns its reward functions receive; `source` is "file:row"."""

    prompt: str | list[dict[str, str]]
    columns: dict[str, Any]
    source: str


class _RowFailed(Exception):
    """The row cannot be read further; its problems are recorded in its `_Row`."""


class _TemplateProblem(Exception):
    """prompt_template cannot be filled in for a row: (what, fix)."""

    def __init__(self, what: str, fix: str) -> None:
        super().__init__(f"{what}; {fix}")
        self.what, self.fix = what, fix


class _Row:
    """One record being parsed: its problems, empty fields and repaired values, recorded."""

    def __init__(self, rec: Record) -> None:
        self.rec = rec
        self.data = rec.data
        self.errors: list[tuple[Problem, bool]] = []  # (problem, merge with repeats)
        self.empty: list[str] = []
        self.repaired: list[tuple[str, Any, Any, list[str]]] = []  # column, raw, read as, kinds

    @property
    def ok(self) -> bool:
        return not self.errors and not self.empty

    def bad(self, column: str | None, what: str, fix: str, *, value: Any = NO_VALUE,
            merge: bool = False) -> None:
        """Record a problem; `merge` for one that repeats on every row (a header problem)."""
        problem = Problem(self.rec.source, self.rec.row, column, what, fix, value)
        self.errors.append((problem, merge))

    def fail(self, column: str | None, what: str, fix: str, *, value: Any = NO_VALUE,
             merge: bool = False) -> NoReturn:
        self.bad(column, what, fix, value=value, merge=merge)
        raise _RowFailed


def normalize_choice_letter(value: Any) -> str | None:
    """"B", " b ", "B.", "(B)", "（Ｂ）" → "B"; anything that is not one letter → None."""
    if not isinstance(value, str):
        return None
    match = _ANSWER_LETTER.fullmatch(value.translate(_FULLWIDTH))
    return match.group(1).upper() if match else None


def _answer_repairs(raw: str) -> list[str]:
    """Which normalisations turned `raw` into its letter (keys of NORMALISATIONS)."""
    kinds = []
    stripped = raw.strip()
    if stripped != raw:
        kinds.append("whitespace")
    ascii_ = stripped.translate(_FULLWIDTH)
    if ascii_ != stripped:
        kinds.append("full_width")
    letter = _ANSWER_LETTER.fullmatch(ascii_).group(1)  # type: ignore[union-attr]
    if ascii_ != letter:
        kinds.append("decoration")
    if letter.islower():
        kinds.append("case")
    return kinds


def render_multiple_choice(
    question: str,
    options: Mapping[str, str],
    template: str | None = None,
    *,
    columns: Mapping[str, Any] | None = None,
) -> str:
    """The prompt text of a multiple-choice question.

    The default lists the options as "A. …" lines under the question, followed by an instruction
    to answer with a letter. A custom `template` uses `{question}`, `{options}` (the option
    block) and any column name in `columns` as str.format placeholders.
    """
    try:
        return _render_mc(question, options, template, columns or {})
    except _TemplateProblem as e:
        raise DataError(f"prompt_template: {e}") from None


def _render_mc(
    question: str, options: Mapping[str, str], template: str | None, columns: Mapping[str, Any],
) -> str:
    block = "\n".join(f"{letter}. {text}" for letter, text in options.items())
    if template is None:
        return f"{question}\n{block}\n{MC_INSTRUCTION}"
    return _format(template, {**columns, "question": question, "options": block})


def _template_fields(template: str) -> list[str]:
    """Root names of the placeholders in `template`; ConfigError if it is not a format string."""
    try:
        fields = placeholders(template)
    except ValueError as e:
        raise ConfigError(
            f"prompt_template is not a valid format string ({e}); write literal braces as "
            "{{ and }}"
        ) from None
    roots = []
    for name, root in fields:
        if not root or root.isdigit():
            raise ConfigError(
                f"prompt_template has a positional placeholder {{{name}}}; use column names, "
                "e.g. {question}"
            )
        roots.append(root)
    return roots


def _format(template: str, values: Mapping[str, Any]) -> str:
    for name in _template_fields(template):
        if name not in values:
            raise _TemplateProblem(
                f"prompt_template uses the placeholder {{{name}}} but there is no such column; "
                f"available placeholders: {', '.join(values)}",
                "fix the template or add the column")
    try:
        return template.format_map(values)
    except (KeyError, IndexError, ValueError, AttributeError, TypeError) as e:
        raise _TemplateProblem(f"prompt_template cannot be filled in ({type(e).__name__}: {e})",
                               "use plain {column} placeholders") from None


def _fill(row: _Row, render: Any) -> str:
    """Run a template rendering; a problem with it fails the row (once per file, merged)."""
    try:
        return render()
    except _TemplateProblem as e:
        row.fail(None, e.what, e.fix, merge=True)


def _is_empty(value: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, float) and math.isnan(value):
        return True
    if isinstance(value, str | list | dict):
        return not (value.strip() if isinstance(value, str) else value)
    return False


def _required(row: _Row, column: str, fmt: str) -> Any:
    """The column's value; None (recorded) when the column is missing or the value empty."""
    if column not in row.data:
        row.bad(column, f"required column is missing (the row has columns: "
                f"{', '.join(row.data) or '(none)'})", _REQUIRED_HINT[fmt], merge=True)
        return None
    value = row.data[column]
    if _is_empty(value):
        row.empty.append(column)
        return None
    return value


def _required_text(row: _Row, column: str, fmt: str) -> str | None:
    value = _required(row, column, fmt)
    if value is None:
        return None
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        row.bad(column, f"must be text but is a {type(value).__name__}",
                "fix the row or remove it", value=value)
        return None
    stripped = value.strip()
    if stripped != value:
        row.repaired.append((column, value, stripped, ["whitespace"]))
    return stripped


def _option_columns(row: _Row) -> dict[str, str]:
    """Option letter → column name, checking the letters run A, B, C, … without gaps."""
    found: dict[str, str] = {}
    for key in row.data:
        match = _OPTION_COLUMN.fullmatch(key)
        if not match:
            continue
        letter = match.group(1).upper()
        if letter in found:
            row.fail(key, f"both {found[letter]!r} and {key!r} are present", "keep one",
                     merge=True)
        found[letter] = key
    letters = sorted(found)
    if len(letters) < 2:
        row.fail(None, "a multiple-choice row needs at least two option columns (option_A, "
                 f"option_B, …); found {', '.join(found.values()) or 'none'}",
                 "add the option columns", merge=True)
    expected = string.ascii_uppercase[: len(letters)]
    if "".join(letters) != expected:
        gap = next(c for c in expected if c not in found)
        row.fail(None, f"option columns {', '.join(letters)} skip option_{gap}",
                 "option letters must run from A without gaps — rename the columns", merge=True)
    return {letter: found[letter] for letter in letters}


def _answer(row: _Row, options: Mapping[str, str | None], require: bool) -> str | None:
    """The row's correct_answer as an option letter (None when absent and not required)."""
    raw = _required(row, "correct_answer", "multiple_choice") if require \
        else row.data.get("correct_answer")
    if _is_empty(raw):
        return None
    answer = normalize_choice_letter(raw)
    if answer not in options:
        letters = next(iter(options)) + "–" + next(reversed(options))
        if answer is not None:
            what, fix = f"not one of the options {letters}", f"write one of {letters}"
        else:
            what = f"not an option letter (the options are {letters})"
            fix = f"write just the letter, e.g. {list(options)[1]!r}"
        row.bad("correct_answer", what, fix + ", or remove the row", value=raw)
        return None
    if raw != answer:
        row.repaired.append(("correct_answer", raw, answer, _answer_repairs(raw)))
    return answer


def _parse_multiple_choice(row: _Row, template: str | None, *,
                           require_answer: bool = True) -> Example | None:
    fmt = "multiple_choice"
    question = _required_text(row, "question", fmt)
    option_columns = _option_columns(row)
    options = {
        letter: _required_text(row, column, fmt) for letter, column in option_columns.items()
    }
    answer = _answer(row, options, require_answer)
    if not row.ok:
        return None
    taken = {"question", "correct_answer", *option_columns.values()}
    columns = {"question": question, "options": options, "correct_answer": answer}
    columns.update((k, v) for k, v in row.data.items() if k not in taken)
    prompt = _fill(row, lambda: _render_mc(question, options, template, row.data))
    return Example(prompt, columns, f"{row.rec.source}:{row.rec.row}")


def _parse_prompt(row: _Row, template: str | None) -> Example | None:
    if template is None:
        if isinstance(row.data.get("prompt"), list):
            row.fail("prompt", "holds a list of messages", "use format 'chat' or 'auto'")
        prompt = _required_text(row, "prompt", "prompt")
    else:
        for name in _template_fields(template):
            if name in row.data:
                _required(row, name, "prompt")
        if not row.ok:
            return None
        prompt = _fill(row, lambda: _format(template, row.data))
    if not row.ok:
        return None
    columns = {k: v for k, v in row.data.items() if k != "prompt"}
    return Example(prompt, columns, f"{row.rec.source}:{row.rec.row}")


def _messages(row: _Row, value: Any, column: str) -> list[dict[str, str]]:
    if isinstance(value, str):  # CSV/TSV cells hold the conversation as a JSON string
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            row.fail(column, f"not valid JSON ({e.msg} at character {e.pos})",
                     'write the conversation as [{"role": "user", "content": "..."}]')
    if not isinstance(value, list) or not value:
        row.fail(column, 'must be a non-empty list of {"role": ..., "content": ...} messages',
                 "fix the row or remove it", value=value)
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            row.fail(column, f"{column}[{i}] must be an object with a text 'content' and a "
                     f"'role'; got {message!r:.80}", "fix the row or remove it")
        if message.get("role") not in CHAT_ROLES:
            row.fail(column, f"{column}[{i}] has role {message.get('role')!r}; roles must be "
                     f"{', '.join(CHAT_ROLES)}", "fix the row or remove it")
        messages.append({"role": message["role"], "content": message["content"]})
    return messages


def _parse_chat(row: _Row, template: str | None) -> Example | None:
    column = "messages" if "messages" in row.data or "prompt" not in row.data else "prompt"
    value = _required(row, column, "chat")
    if value is None:
        return None
    messages = _messages(row, value, column)
    columns = {k: v for k, v in row.data.items() if k != column}
    if messages[-1]["role"] == "assistant":
        # A finished conversation: everything before the last reply is the prompt and the
        # reply becomes the `completion` column (the SFT target).
        if "completion" in columns:
            row.fail(column, "ends with an assistant message and the row also has a "
                     "'completion' column", "keep only one of them")
        if len(messages) == 1:
            row.fail(column, "holds only an assistant message", "add the user turn")
        columns["completion"] = messages.pop()["content"]
    return Example(messages, columns, f"{row.rec.source}:{row.rec.row}")


_PARSERS = {
    "prompt": _parse_prompt,
    "chat": _parse_chat,
    "multiple_choice": _parse_multiple_choice,
}


def detect_format(records: list[Record]) -> str:
    keys = set().union(*(r.data for r in records))
    if "question" in keys and ({"option_A", "option_a"} & keys):
        return "multiple_choice"
    if "messages" in keys or any(isinstance(r.data.get("prompt"), list) for r in records):
        return "chat"
    return "prompt"


def _parse_row(rec: Record, parse: Any, template: str | None) -> tuple[_Row, Example | None]:
    """The row's findings, and its Example when it has no problem."""
    row = _Row(rec)
    reserved = [c for c in RESERVED_COLUMNS if c in rec.data]
    if reserved:
        row.bad(reserved[0], "has a name mogrpo passes to reward functions itself "
                f"({', '.join(RESERVED_COLUMNS)})", "rename the column", merge=True)
        return row, None
    try:
        example = parse(row, template)
    except _RowFailed:
        return row, None
    return row, example if row.ok else None


def collect_examples(
    records: list[Record],
    problems: ProblemLog,
    *,
    format: str = "auto",
    prompt_template: str | None = None,
    drop_incomplete: bool = False,
    require_answer: bool = True,
) -> tuple[list[Example], list[tuple[Record, str]]]:
    """Parse every record, recording each problem in `problems` instead of raising.

    Returns the good examples and the rows dropped for empty fields (`drop_incomplete`) with
    their first empty column. Config mistakes (format, template syntax) still raise at once.
    """
    if format not in DATA_FORMATS:
        raise ConfigError(f"unknown data format {format!r}; choose one of {', '.join(DATA_FORMATS)}")
    fmt = detect_format(records) if format == "auto" else format
    if format == "auto" and records:
        log.info("%s: detected data format %r", records[0].source, fmt)
    if prompt_template is not None:
        if fmt == "chat":
            raise ConfigError(
                "prompt_template is not used by the chat format (the messages are the prompt); "
                "remove prompt_template or use format 'prompt' / 'multiple_choice'"
            )
        _template_fields(prompt_template)  # syntax errors before any row is read
    parse = _PARSERS[fmt]
    if fmt == "multiple_choice" and not require_answer:
        parse = functools.partial(_parse_multiple_choice, require_answer=False)
    examples: list[Example] = []
    dropped: list[tuple[Record, str]] = []
    for rec in records:
        row, example = _parse_row(rec, parse, prompt_template)
        if example is not None:
            for column, raw, new, kinds in row.repaired:
                problems.normalised(rec.source, rec.row, column, raw, new, kinds)
            examples.append(example)
            continue
        for problem, merge in row.errors:
            problems.error(problem, merge)
        if drop_incomplete:
            if not row.errors:
                dropped.append((rec, row.empty[0]))
            continue
        for column in row.empty:
            problems.error(Problem(rec.source, rec.row, column, "empty", _EMPTY_FIX,
                                   rec.data.get(column), kind="empty"))
    return examples, dropped


def parse_examples(
    records: list[Record],
    *,
    format: str = "auto",
    prompt_template: str | None = None,
    drop_incomplete: bool = False,
    require_answer: bool = True,
    strict: bool = False,
    problems: ProblemLog | None = None,
) -> list[Example]:
    """Validate records and build examples in `format` (one of DATA_FORMATS).

    Every problem of every row is raised together in one DataError (file, row, column, value,
    fix). A row with an empty required field is such a problem, or, with
    `drop_incomplete=True`, skipped (the count is logged once). `require_answer=False` accepts
    multiple-choice rows without a `correct_answer` (a test set to predict); theirs is None.
    Normalised values are logged as warnings, or are errors with `strict`. Pass `problems`
    to report them together with the reader's (see `load_examples`).
    """
    problems = ProblemLog(strict) if problems is None else problems
    if not records and problems.ok:
        raise DataError("no data rows to parse; check `tasks.<name>.data`")
    examples, dropped = collect_examples(
        records, problems, format=format, prompt_template=prompt_template,
        drop_incomplete=drop_incomplete, require_answer=require_answer)
    problems.raise_errors()
    problems.log_warnings(log)
    if dropped:
        first, column = dropped[0]
        log.warning(
            "dropped %d of %d rows with empty fields from %s (first: row %d, column %r)",
            len(dropped), len(records), first.source, first.row, column,
        )
    if not examples:
        first, column = dropped[0]
        raise DataError(
            f"{first.source}: no examples left — all {len(records)} rows have empty fields "
            f"(first: row {first.row}, column {column!r}); fill the fields or check the columns"
        )
    return examples


def parse_row(rec: Record, format: str, *, prompt_template: str | None = None,
              drop_incomplete: bool = False, strict: bool = False) -> Example | None:
    """One record of a known format (a streamed row), with the rules of `parse_examples`;
    None for an incomplete row when `drop_incomplete`. Its problems raise at once (a stream
    has no end to collect them at); repaired values are errors only when `strict`."""
    problems = ProblemLog(strict)
    examples, _ = collect_examples([rec], problems, format=format,
                                   prompt_template=prompt_template,
                                   drop_incomplete=drop_incomplete)
    problems.raise_errors()
    return examples[0] if examples else None


def load_examples(path: str | Path, *, strict: bool = False, **kwargs: Any) -> list[Example]:
    """Read a data file and parse it, reporting the reader's and the rows' problems together
    (`kwargs` as for `parse_examples`)."""
    problems = ProblemLog(strict)
    return parse_examples(read_records(path, problems), problems=problems, **kwargs)


def split_examples(
    examples: list[Example], eval_size: int, seed: int
) -> tuple[list[Example], list[Example]]:
    """Shuffle deterministically with `seed`; the last `eval_size` examples are held out."""
    source = examples[0].source.rsplit(":", 1)[0] if examples else "the data"
    if eval_size < 0 or eval_size >= len(examples):
        raise DataError(
            f"eval_size {eval_size} must be between 0 and {len(examples) - 1} (the task has "
            f"{len(examples)} examples from {source}); lower `tasks.<name>.eval_size` or add rows"
        )
    order = list(examples)
    random.Random(seed).shuffle(order)
    cut = len(order) - eval_size
    return order[:cut], order[cut:]
