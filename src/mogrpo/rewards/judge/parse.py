"""Turn a judge's reply text into a score in [0, 1], or None when the reply does not say.

Three kinds, chosen by the `parser` option of a judge reward:

- `{kind: number, min: 1, max: 10}`: the first number in the reply (or the first group of an
  optional `pattern` regex), which must lie in [min, max], scaled to [0, 1];
- `{kind: json, field: score, min: 0, max: 5}`: a number at `field` (dotted for nesting) of the
  JSON object in the reply (code fences and text around the object are tolerated);
- `{kind: labels, map: {biased: 0.0, "not biased": 1.0}}`: the label found earliest in the
  reply (case-insensitive, whole words; the longest wins a tie), mapped to its score.

A reasoning model's `<think>…</think>` block is removed before parsing. Out-of-range numbers
are unparseable, not clamped: a "7" on a 1–5 scale means the template is not being followed.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from mogrpo.errors import ConfigError

_THINK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
_KINDS = ("number", "json", "labels")


@dataclass
class ScoreParser:
    """A validated `parser` option; `parse(reply)` gives a score in [0, 1] or None."""

    kind: str
    min: float = 0.0
    max: float = 1.0
    json_field: str = "score"
    pattern: re.Pattern[str] | None = None
    labels: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_options(cls, options: Any, where: str) -> ScoreParser:
        """Validate `options` (the judge's `parser` value); `where` names it in errors."""
        if not isinstance(options, dict) or options.get("kind") not in _KINDS:
            raise ConfigError(
                f"{where} = {options!r}: give a dict with kind one of {list(_KINDS)}, e.g. "
                "{kind: number, min: 1, max: 10} or {kind: labels, map: {yes: 1.0, no: 0.0}}"
            )
        kind = options["kind"]
        allowed = {
            "number": {"kind", "min", "max", "pattern"},
            "json": {"kind", "field", "min", "max"},
            "labels": {"kind", "map"},
        }[kind]
        unknown = sorted(set(options) - allowed)
        if unknown:
            raise ConfigError(
                f"{where}: unknown key(s) {unknown} for kind {kind!r}; allowed: {sorted(allowed)}"
            )
        if kind == "labels":
            return cls(kind=kind, labels=_label_map(options.get("map"), where))
        low, high = options.get("min", 0.0), options.get("max", 1.0)
        if not all(_is_number(v) for v in (low, high)) or not low < high:
            raise ConfigError(f"{where}: min ({low!r}) and max ({high!r}) must be numbers, min < max")
        parser = cls(kind=kind, min=float(low), max=float(high))
        if kind == "json":
            name = options.get("field", "score")
            if not isinstance(name, str) or not name:
                raise ConfigError(f"{where}.field = {name!r}: give the JSON key holding the score")
            parser.json_field = name
        elif options.get("pattern") is not None:
            parser.pattern = _compile(options["pattern"], f"{where}.pattern")
        return parser

    def parse(self, reply: str | None) -> float | None:
        """The reply's score in [0, 1], or None when it holds no valid score."""
        if not reply:
            return None
        text = _THINK.sub("", reply).strip()
        if self.kind == "labels":
            return _match_label(text, self.labels)
        if self.kind == "json":
            return self._scale(_json_field(text, self.json_field))
        if self.pattern is not None:
            match = self.pattern.search(text)
            if not match:
                return None
            text = match.group(1) if self.pattern.groups else match.group(0)
            if text is None:  # an optional group that took no part in the match
                return None
        number = _NUMBER.search(text)
        return self._scale(float(number.group(0)) if number else None)

    def _scale(self, value: Any) -> float | None:
        if not _is_number(value) or not math.isfinite(value):
            return None
        if not self.min <= value <= self.max:
            return None
        return (float(value) - self.min) / (self.max - self.min)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _compile(pattern: Any, where: str) -> re.Pattern[str]:
    if not isinstance(pattern, str):
        raise ConfigError(f"{where} = {pattern!r} must be a regular expression string")
    try:
        compiled = re.compile(pattern, re.IGNORECASE)
    except re.error as err:
        raise ConfigError(f"{where} = {pattern!r} is not a valid regular expression: {err}") from err
    if compiled.groups > 1:
        raise ConfigError(
            f"{where} = {pattern!r} has {compiled.groups} groups; use one group around the number, "
            "e.g. 'Score:\\s*([0-9.]+)' (use (?:...) for the others)"
        )
    return compiled


def _label_map(mapping: Any, where: str) -> dict[str, float]:
    if not isinstance(mapping, dict) or not mapping:
        raise ConfigError(
            f"{where}.map = {mapping!r}: give labels with their scores in [0, 1], e.g. "
            "{map: {biased: 0.0, 'not biased': 1.0}}"
        )
    labels: dict[str, float] = {}
    for label, value in mapping.items():
        key = str(label).strip().lower()
        if not key or not _is_number(value) or not 0.0 <= value <= 1.0:
            raise ConfigError(
                f"{where}.map: label {label!r} → {value!r}; labels must be non-empty and scores "
                "numbers in [0, 1]"
            )
        labels[key] = float(value)
    return labels


def _match_label(text: str, labels: dict[str, float]) -> float | None:
    lowered = text.lower()
    stripped = lowered.strip(" \t\n.!\"'`*")
    if stripped in labels:
        return labels[stripped]
    best: tuple[int, int, str] | None = None  # (start, -length, label): earliest, then longest
    for label in labels:
        match = re.search(rf"(?<!\w){re.escape(label)}(?!\w)", lowered)
        if match:
            candidate = (match.start(), -len(label), label)
            best = candidate if best is None or candidate < best else best
    return labels[best[2]] if best else None


def _json_field(text: str, name: str) -> Any:
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end <= start:
        return None
    try:
        value: Any = json.loads(text[start : end + 1])
    except ValueError:
        return None
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    if isinstance(value, str):  # {"score": "4"} is common enough to accept
        try:
            return float(value.strip())
        except ValueError:
            return None
    return value
