"""Turn records into prompts: plain prompts, chat conversations and multiple-choice questions.

Every column that is not the prompt travels with the example in `columns` and reaches the
reward functions as a keyword argument (TRL-style), so `correct_answer` or `reasoning` are
available where scores are computed.
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
from typing import Any

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


@dataclass
class Example:
    """One prompt with the columns its reward functions receive; `source` is "file:row"."""

    prompt: str | list[dict[str, str]]
    columns: dict[str, Any]
    source: str


class _Incomplete(Exception):
    """A required field of a row is empty (the row may be dropped)."""

    def __init__(self, column: str) -> None:
        super().__init__(column)
        self.column = column


def normalize_choice_letter(value: Any) -> str | None:
    """"B", " b ", "B.", "(B)", "（Ｂ）" → "B"; anything that is not one letter → None."""
    if not isinstance(value, str):
        return None
    match = _ANSWER_LETTER.fullmatch(value.translate(_FULLWIDTH))
    return match.group(1).upper() if match else None


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
    return _render_mc(question, options, template, columns or {}, where="prompt_template")


def _render_mc(
    question: str, options: Mapping[str, str], template: str | None,
    columns: Mapping[str, Any], where: str,
) -> str:
    block = "\n".join(f"{letter}. {text}" for letter, text in options.items())
    if template is None:
        return f"{question}\n{block}\n{MC_INSTRUCTION}"
    return _format(template, {**columns, "question": question, "options": block}, where)


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


def _format(template: str, values: Mapping[str, Any], where: str) -> str:
    for name in _template_fields(template):
        if name not in values:
            raise DataError(
                f"{where}: prompt_template uses the placeholder {{{name}}} but there is no such "
                f"column; available placeholders: {', '.join(values)}. Fix the template or add "
                "the column"
            )
    try:
        return template.format_map(values)
    except (KeyError, IndexError, ValueError, AttributeError, TypeError) as e:
        raise DataError(
            f"{where}: prompt_template cannot be filled in ({type(e).__name__}: {e}); use plain "
            "{column} placeholders"
        ) from None


def _is_empty(value: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, float) and math.isnan(value):
        return True
    if isinstance(value, str | list | dict):
        return not (value.strip() if isinstance(value, str) else value)
    return False


def _missing(rec: Record, column: str, where: str, fmt: str) -> DataError:
    return DataError(
        f"{where}: required column {column!r} is missing; the row has columns: "
        f"{', '.join(rec.data) or '(none)'}. {_REQUIRED_HINT[fmt]}"
    )


def _required(rec: Record, column: str, where: str, fmt: str) -> Any:
    if column not in rec.data:
        raise _missing(rec, column, where, fmt)
    value = rec.data[column]
    if _is_empty(value):
        raise _Incomplete(column)
    return value


def _required_text(rec: Record, column: str, where: str, fmt: str) -> str:
    value = _required(rec, column, where, fmt)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        raise DataError(
            f"{where}: column {column!r} must be text but is a {type(value).__name__}; "
            "fix the row or remove it"
        )
    return value.strip()


def _option_columns(rec: Record, where: str) -> dict[str, str]:
    """Option letter → column name, checking the letters run A, B, C, … without gaps."""
    found: dict[str, str] = {}
    for key in rec.data:
        match = _OPTION_COLUMN.fullmatch(key)
        if not match:
            continue
        letter = match.group(1).upper()
        if letter in found:
            raise DataError(f"{where}: both {found[letter]!r} and {key!r} are present; keep one")
        found[letter] = key
    letters = sorted(found)
    if len(letters) < 2:
        raise DataError(
            f"{where}: a multiple-choice row needs at least two option columns (option_A, "
            f"option_B, …); found {', '.join(found.values()) or 'none'}"
        )
    expected = string.ascii_uppercase[: len(letters)]
    if "".join(letters) != expected:
        gap = next(c for c in expected if c not in found)
        raise DataError(
            f"{where}: option columns {', '.join(letters)} skip option_{gap}; option letters "
            "must run from A without gaps — rename the columns"
        )
    return {letter: found[letter] for letter in letters}


def _parse_multiple_choice(rec: Record, where: str, template: str | None, *,
                           require_answer: bool = True) -> Example:
    fmt = "multiple_choice"
    question = _required_text(rec, "question", where, fmt)
    option_columns = _option_columns(rec, where)
    options = {
        letter: _required_text(rec, column, where, fmt) for letter, column in option_columns.items()
    }
    raw = rec.data.get("correct_answer")
    if require_answer:
        raw = _required(rec, "correct_answer", where, fmt)
    answer = None if _is_empty(raw) else normalize_choice_letter(raw)
    if answer not in options and not (answer is None and _is_empty(raw)):
        letters = next(iter(options)) + "–" + next(reversed(options))
        hint = " (write just the letter, e.g. 'B')" if answer is None else ""
        raise DataError(
            f"{where}: column 'correct_answer' is {raw!r} but the options are {letters}{hint}; "
            "fix the row or remove it"
        )
    taken = {"question", "correct_answer", *option_columns.values()}
    columns = {"question": question, "options": options, "correct_answer": answer}
    columns.update((k, v) for k, v in rec.data.items() if k not in taken)
    prompt = _render_mc(question, options, template, rec.data, where)
    return Example(prompt, columns, f"{rec.source}:{rec.row}")


def _parse_prompt(rec: Record, where: str, template: str | None) -> Example:
    if template is None:
        value = rec.data.get("prompt")
        if isinstance(value, list):
            raise DataError(
                f"{where}: column 'prompt' holds a list of messages; use format 'chat' or 'auto'"
            )
        prompt = _required_text(rec, "prompt", where, "prompt")
    else:
        for name in _template_fields(template):
            if name in rec.data:
                _required(rec, name, where, "prompt")
        prompt = _format(template, rec.data, where)
    columns = {k: v for k, v in rec.data.items() if k != "prompt"}
    return Example(prompt, columns, f"{rec.source}:{rec.row}")


def _messages(value: Any, column: str, where: str) -> list[dict[str, str]]:
    if isinstance(value, str):  # CSV/TSV cells hold the conversation as a JSON string
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise DataError(
                f"{where}: column {column!r} is not valid JSON ({e.msg} at character {e.pos}); "
                'write the conversation as [{"role": "user", "content": "..."}]'
            ) from None
    if not isinstance(value, list) or not value:
        raise DataError(
            f"{where}: column {column!r} must be a non-empty list of "
            '{"role": ..., "content": ...} messages'
        )
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise DataError(
                f"{where}: {column}[{i}] must be an object with a text 'content' and a 'role'; "
                f"got {message!r:.80}"
            )
        if message.get("role") not in CHAT_ROLES:
            raise DataError(
                f"{where}: {column}[{i}] has role {message.get('role')!r}; roles must be "
                f"{', '.join(CHAT_ROLES)}"
            )
        messages.append({"role": message["role"], "content": message["content"]})
    return messages


def _parse_chat(rec: Record, where: str, template: str | None) -> Example:
    column = "messages" if "messages" in rec.data or "prompt" not in rec.data else "prompt"
    messages = _messages(_required(rec, column, where, "chat"), column, where)
    columns = {k: v for k, v in rec.data.items() if k != column}
    if messages[-1]["role"] == "assistant":
        # A finished conversation: everything before the last reply is the prompt and the
        # reply becomes the `completion` column (the SFT target).
        if "completion" in columns:
            raise DataError(
                f"{where}: {column!r} ends with an assistant message and the row also has a "
                "'completion' column; keep only one of them"
            )
        if len(messages) == 1:
            raise DataError(
                f"{where}: {column!r} holds only an assistant message; add the user turn"
            )
        columns["completion"] = messages.pop()["content"]
    return Example(messages, columns, f"{rec.source}:{rec.row}")


_PARSERS = {
    "prompt": _parse_prompt,
    "chat": _parse_chat,
    "multiple_choice": _parse_multiple_choice,
}


def _detect_format(records: list[Record]) -> str:
    keys = set().union(*(r.data for r in records))
    if "question" in keys and ({"option_A", "option_a"} & keys):
        return "multiple_choice"
    if "messages" in keys or any(isinstance(r.data.get("prompt"), list) for r in records):
        return "chat"
    return "prompt"


def parse_examples(
    records: list[Record],
    *,
    format: str = "auto",
    prompt_template: str | None = None,
    drop_incomplete: bool = False,
    require_answer: bool = True,
) -> list[Example]:
    """Validate records and build examples in `format` (one of DATA_FORMATS).

    A row with an empty required field is an error naming the row and column, or, with
    `drop_incomplete=True`, skipped (the count is logged once). `require_answer=False` accepts
    multiple-choice rows without a `correct_answer` (a test set to predict); theirs is None.
    """
    if format not in DATA_FORMATS:
        raise ConfigError(f"unknown data format {format!r}; choose one of {', '.join(DATA_FORMATS)}")
    if not records:
        raise DataError("no data rows to parse; check `tasks.<name>.data`")
    fmt = _detect_format(records) if format == "auto" else format
    if format == "auto":
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
        try:
            examples.append(_parse_one(parse, rec, prompt_template))
        except _Incomplete as e:
            if not drop_incomplete:
                raise DataError(
                    f"{rec.source} row {rec.row}: column {e.column!r} is empty; fill it, remove the row, or set "
                    "`drop_incomplete: true` to skip rows with empty fields (the row has columns: "
                    f"{', '.join(rec.data)})"
                ) from None
            dropped.append((rec, e.column))
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


def _parse_one(parse: Any, rec: Record, prompt_template: str | None) -> Example:
    where = f"{rec.source} row {rec.row}"
    reserved = [c for c in RESERVED_COLUMNS if c in rec.data]
    if reserved:
        raise DataError(
            f"{where}: column {reserved[0]!r} has a name mogrpo passes to reward functions "
            f"itself ({', '.join(RESERVED_COLUMNS)}); rename the column"
        )
    return parse(rec, where, prompt_template)


def detect_format(records: list[Record]) -> str:
    """The format `auto` resolves to for these records."""
    return _detect_format(records)


def parse_row(rec: Record, format: str, *, prompt_template: str | None = None,
              drop_incomplete: bool = False) -> Example | None:
    """One record of a known format (a streamed row), with the checks of `parse_examples`;
    None for an incomplete row when `drop_incomplete`."""
    try:
        return _parse_one(_PARSERS[format], rec, prompt_template)
    except _Incomplete as e:
        if not drop_incomplete:
            raise DataError(
                f"{rec.source} row {rec.row}: column {e.column!r} is empty; fill it, remove the "
                "row, or set `drop_incomplete: true` to skip rows with empty fields"
            ) from None
        return None


def load_examples(path: str | Path, **kwargs: Any) -> list[Example]:
    """Read a data file and parse it (`kwargs` as for `parse_examples`)."""
    return parse_examples(read_records(path), **kwargs)


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
