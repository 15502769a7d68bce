"""Reward-weight schedules: an objective's weight as a function of the trainer step.

In the config a weight is a plain number (constant) or a mapping, e.g. a format reward that
fades out while correctness takes over::

    weight: {kind: linear, start: 1.0, end: 0.2, start_step: 0, end_step: 200}
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from mogrpo.algo.choices import SCHEDULE_KINDS, ScheduleKind
from mogrpo.errors import ConfigError


def _finite(where: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{where}.{name}={value!r} must be a finite number")


def _step(where: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{where}.{name}={value!r} must be an integer step >= 0")


@dataclass(frozen=True)
class WeightSchedule:
    """A reward weight over training steps."""

    kind: ScheduleKind = "constant"
    """`constant`: always `value`; `linear`: `start` until `start_step`, a straight ramp to
    `end` at `end_step`, `end` afterwards."""
    value: float = 1.0
    """The weight of a `constant` schedule."""
    start: float | None = None
    """Weight up to `start_step` (`linear` only)."""
    end: float | None = None
    """Weight from `end_step` on (`linear` only)."""
    start_step: int = 0
    """Step where the ramp begins (`linear` only)."""
    end_step: int = 0
    """Step where the ramp reaches `end`; must be > `start_step` (`linear` only)."""
    where: str = field(default="weight", repr=False, compare=False)
    """Config path named in error messages, e.g. `tasks.fairness.rewards[0].weight`."""

    def __post_init__(self) -> None:
        w = self.where
        if self.kind not in SCHEDULE_KINDS:
            raise ConfigError(
                f"{w}.kind={self.kind!r} is not supported; choose one of {list(SCHEDULE_KINDS)}"
            )
        if self.kind == "constant":
            _finite(w, "value", self.value)
            if self.start is not None or self.end is not None:
                raise ConfigError(
                    f"{w}: start/end are set but kind is 'constant'; set kind: linear for a "
                    "ramp, or give only value"
                )
            return
        for name in ("start", "end"):
            if getattr(self, name) is None:
                raise ConfigError(
                    f"{w}.{name} is required for kind 'linear', e.g. "
                    "{kind: linear, start: 1.0, end: 0.2, start_step: 0, end_step: 200}"
                )
            _finite(w, name, getattr(self, name))
        _step(w, "start_step", self.start_step)
        _step(w, "end_step", self.end_step)
        if self.end_step <= self.start_step:
            raise ConfigError(
                f"{w}.end_step={self.end_step!r} must be after start_step={self.start_step!r}; "
                "set end_step to the step where the weight should reach `end`"
            )

    def at(self, step: int) -> float:
        """The weight at trainer ``step``."""
        if self.kind == "constant":
            return float(self.value)
        start, end = float(self.start), float(self.end)  # type: ignore[arg-type]
        if step <= self.start_step:
            return start
        if step >= self.end_step:
            return end
        frac = (step - self.start_step) / (self.end_step - self.start_step)
        return start + (end - start) * frac


_KEYS = tuple(f.name for f in fields(WeightSchedule) if f.name != "where")


def from_config(obj: float | dict[str, Any], where: str = "weight") -> WeightSchedule:
    """A schedule from a config value: a number means constant, a mapping gives the fields.

    ``where`` is the config path used in error messages.
    """
    if isinstance(obj, int | float) and not isinstance(obj, bool):
        return WeightSchedule(kind="constant", value=obj, where=where)
    if not isinstance(obj, dict):
        raise ConfigError(
            f"{where}={obj!r} must be a number or a mapping such as "
            "{kind: linear, start: 1.0, end: 0.2, start_step: 0, end_step: 200}"
        )
    unknown = [k for k in obj if k not in _KEYS]
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]} is not a schedule field; use one of {list(_KEYS)}")
    if obj.get("kind", "constant") == "linear" and "value" in obj:
        raise ConfigError(
            f"{where}.value does not apply to kind 'linear'; give start and end instead"
        )
    return WeightSchedule(**obj, where=where)
