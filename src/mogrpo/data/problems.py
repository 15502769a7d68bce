"""Problems found in data files, collected in one pass: errors, and warnings for normalised values.

A reader or a schema does not stop at the first bad row: it records each problem (file, row,
column, value, what is wrong, the fix) in a `ProblemLog` and moves on, so one run lists every
row to fix. Values mogrpo silently repairs — an answer written `b` or `Ｂ` or ` B `, text with
stray whitespace — are counted as warnings; with `strict` each of them is an error instead.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from mogrpo.errors import DataError

LISTED = 50
"""Problems listed in an error message; the rest are counted."""

NORMALISATIONS = {
    "case": "lower-case answer letter read as upper case",
    "full_width": "full-width letter read as its ASCII letter",
    "decoration": "punctuation around the answer letter dropped",
    "whitespace": "leading or trailing whitespace stripped",
}
"""Kinds of silently repaired values, each counted and reported as a warning."""

NO_VALUE = object()


def show_value(value: Any, width: int = 40) -> str:
    """A value as a user would recognise it, cut to `width` characters."""
    text = repr(value)
    return text if len(text) <= width else text[: width - 1] + "…"


@dataclass
class Problem:
    """One problem in one row (or, with `also`, the same problem in several rows)."""

    source: str
    row: int | None
    column: str | None
    what: str
    fix: str
    value: Any = NO_VALUE
    kind: str = "invalid"
    """`invalid`, `empty`, `short_row`, `long_row`, or a key of NORMALISATIONS."""
    also: list[int] = field(default_factory=list)
    """Further rows with exactly this problem (a header-level problem repeats on every row)."""

    def where(self) -> str:
        where = self.source if self.row is None else f"{self.source} row {self.row}"
        if self.column is not None:
            where += f", column {self.column!r}"
        if self.value is not NO_VALUE:
            where += f" = {show_value(self.value)}"
        return where

    def __str__(self) -> str:
        if self.kind == "file":  # the whole file is unreadable: `what` is the reader's message
            return self.what
        text = f"{self.where()}: {self.what}; {self.fix}"
        if self.also:
            shown = ", ".join(map(str, self.also[:5]))
            more = f" and {len(self.also) - 5} more" if len(self.also) > 5 else ""
            text += f" (also rows {shown}{more})"
        return text


class ProblemLog:
    """Every problem of one or more data files; `raise_errors()` reports them all at once."""

    def __init__(self, strict: bool = False, listed: int = LISTED) -> None:
        self.strict = strict
        self.listed = listed
        self.errors: list[Problem] = []
        self.warnings: list[Problem] = []
        self._merged: dict[tuple[str, str | None, str], Problem] = {}

    def error(self, problem: Problem, merge: bool = False) -> None:
        """Record an error; with `merge`, a repeat of the same problem only adds its row."""
        key = (problem.source, problem.column, problem.what)
        if merge and key in self._merged:
            if problem.row is not None:
                self._merged[key].also.append(problem.row)
            return
        if merge:
            self._merged[key] = problem
        self.errors.append(problem)

    def normalised(self, source: str, row: int, column: str, raw: Any, new: Any,
                   kinds: list[str]) -> None:
        """A value read as `new` instead of `raw`: a warning, or an error when strict."""
        what = f"read as {show_value(new)} ({'; '.join(NORMALISATIONS[k] for k in kinds)})"
        if self.strict:
            fix = f"write {show_value(new)} exactly (strict mode accepts no repaired value)"
            self.errors.append(Problem(source, row, column, what, fix, raw, kinds[0]))
            return
        for kind in kinds:
            self.warnings.append(Problem(source, row, column, f"read as {show_value(new)}", "",
                                         raw, kind))

    @property
    def ok(self) -> bool:
        return not self.errors

    def error_text(self, limit: int | None = None) -> str:
        """All errors, one per line (at most `limit`, default `listed`; the rest counted)."""
        limit = self.listed if limit is None else limit
        # in file order: the reader's and the schema's problems of a row together
        ordered = sorted(self.errors, key=lambda p: (p.source, p.row or 0))
        shown = ordered if limit <= 0 else ordered[:limit]
        rows = sum(1 + len(p.also) for p in self.errors)
        if len(self.errors) == 1 and not self.errors[0].also:
            return str(self.errors[0])
        sources = sorted({p.source for p in self.errors})
        head = f"{rows} problems in {', '.join(sources)} (each listed; fix them all, then run again):"
        lines = [head, *(f"  {p}" for p in shown)]
        if len(shown) < len(self.errors):
            lines.append(f"  … and {len(self.errors) - len(shown)} more (`mogrpo data check "
                         f"FILE --limit 0` lists every one)")
        return "\n".join(lines)

    def raise_errors(self) -> None:
        """Raise one DataError listing every recorded error (nothing if there are none)."""
        if self.errors:
            raise DataError(self.error_text())

    def warning_lines(self) -> list[str]:
        """One line per (file, kind of normalisation): how many values, with the first one."""
        counts = Counter((p.source, p.kind) for p in self.warnings)
        lines = []
        for (source, kind), n in counts.items():
            first = next(p for p in self.warnings if (p.source, p.kind) == (source, kind))
            lines.append(f"{source}: {n} value(s) normalised — {NORMALISATIONS[kind]}; first: "
                         f"row {first.row}, column {first.column!r}: {show_value(first.value)} "
                         f"{first.what}. Fix the file, or use --strict (tasks.NAME.strict) to "
                         "make these errors")
        return lines

    def log_warnings(self, logger: logging.Logger) -> None:
        for line in self.warning_lines():
            logger.warning("%s", line)
