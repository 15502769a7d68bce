"""A task's KL control section (`tasks.NAME.kl`): how its β moves, and the band it is held in."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from mogrpo.algo.choices import KLControllerKind
from mogrpo.config.base import Section


class KLControlConfig(Section):
    kind: KLControllerKind = "fixed"
    """How this task's β moves: `fixed`; `dual` (the default when `low`/`high` are given: β as
    the multiplier of the KL constraint, a PI law on log β toward the band's quiet middle — it
    enters the band within a bounded number of updates and stays); `band` (KL below `low` →
    β × (1 − rate), above `high` → β × (1 + rate)); `proportional` (Ziegler et al. 2019,
    toward `target`)."""
    low: float | None = None
    """band, dual: lower edge of the healthy KL range (e.g. 0.02)."""
    high: float | None = None
    """band, dual: upper edge of the healthy KL range (e.g. 0.06)."""
    rate: float | None = None
    """band: relative change of β per adjustment (default 0.15)."""
    target: float | None = None
    """proportional: the KL to steer toward."""
    horizon: int | None = None
    """proportional: samples over which β may change by ±20 % (default 10000)."""
    kp: float | None = None
    """dual: proportional gain on the change of the log-error (default 0.3; 0 = pure dual
    ascent)."""
    ki: float | None = None
    """dual: integral gain, the dual-ascent step on ln β per unit of log-error: ln(KL) outside
    the band's quiet middle (default 0.2)."""
    max_step: float | None = None
    """dual: the largest change of ln β in one update (default ln 2: at most ×2 or ÷2)."""
    quiet: float | None = None
    """dual: the share of the band (in logs, around its geometric centre) where β stays put
    (default 0.5; 0 = steer to the centre itself)."""
    warmup_steps: int | None = None
    """dual: steps during which β may rise but not fall (default 0): the policy starts at the
    reference, so its first KL is near 0 whatever β is."""
    beta_min: float | None = None
    """Smallest β the controller may set (default 1e-4)."""
    beta_max: float | None = None
    """Largest β the controller may set (default 10)."""
    every_steps: int = Field(1, ge=1)
    """Adjust β every N steps, on the mean KL of those N steps."""

    @model_validator(mode="before")
    @classmethod
    def _band_means_dual(cls, data: Any) -> Any:
        """A band without a kind is held by the `dual` controller."""
        if isinstance(data, dict) and "kind" not in data and (
                data.get("low") is not None or data.get("high") is not None):
            return {**data, "kind": "dual"}
        return data

    def options(self) -> dict[str, Any]:
        """The controller's options that are set (the rest keep the controller's defaults)."""
        names = ("low", "high", "rate", "target", "horizon", "kp", "ki", "max_step", "quiet",
                 "warmup_steps", "beta_min", "beta_max")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def band(self) -> tuple[float, float] | None:
        """(low, high) for the controllers that hold a band (`band`, `dual`), else None."""
        if self.kind in ("band", "dual") and self.low is not None and self.high is not None:
            return self.low, self.high
        return None

    def kl_budget(self) -> float | None:
        """The most KL this task is meant to reach (band, dual: `high`; proportional:
        `target`)."""
        return {"band": self.high, "dual": self.high, "proportional": self.target}.get(self.kind)
