"""Per-task controllers of the KL coefficient beta.

Each task keeps its own beta and its own controller, fed with the KL measured on that task's
completions. ``update`` returns a :class:`BetaChange` only when beta actually moved, so the
trainer logs one line per change and nothing otherwise. Controllers are plain objects with
JSON-safe ``state_dict()`` / ``load_state_dict()``, so beta survives a resume exactly.

A non-finite KL (NaN: no completions of that task this step; inf: a numerical failure,
which the health checks report) is a missing measurement, not a signal: beta is left alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from mogrpo.algo.choices import KL_CONTROLLERS
from mogrpo.errors import ConfigError


@dataclass
class BetaChange:
    """One change of a task's beta, as logged."""

    task: str
    """Task whose beta changed."""
    step: int
    """Trainer step of the KL measurement."""
    kl: float
    """The measured KL that triggered the change."""
    old: float
    """Beta before the change."""
    new: float
    """Beta after the change (already clamped to the controller's bounds)."""
    reason: str
    """Why it changed, e.g. ``KL 0.018 < 0.020`` or ``KL 0.030 vs target 0.050``."""

    def format(self) -> str:
        """``[KL@20] fairness KL 0.018 < 0.020: beta 0.1000 -> 0.0850``."""
        return f"[KL@{self.step}] {self.task} {self.reason}: beta {self.old:.4f} -> {self.new:.4f}"


def _num(x: float) -> str:
    """3 decimals, or scientific below 1e-3 so a tiny KL never prints as a false 0.000."""
    return f"{x:.3f}" if x == 0 or abs(x) >= 1e-3 else f"{x:.1e}"


def _field(task: str, name: str) -> str:
    return f"tasks.{task}.kl.{name}"


def _check_number(task: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{_field(task, name)}={value!r} must be a finite number")
    return float(value)


class KLController:
    """Base of the controllers: beta, its bounds, the log record and the (kind, beta) state."""

    kind: ClassVar[str]

    def __init__(self, task: str, beta: float, beta_min: float, beta_max: float) -> None:
        self.task = task
        self.beta = _check_number(task, "beta", beta)
        self.beta_min = _check_number(task, "beta_min", beta_min)
        self.beta_max = _check_number(task, "beta_max", beta_max)
        if not 0 <= self.beta_min <= self.beta_max:
            raise ConfigError(
                f"{_field(task, 'beta_min')}={beta_min!r} and {_field(task, 'beta_max')}="
                f"{beta_max!r} are not a valid range; need 0 <= beta_min <= beta_max"
            )
        if not self.beta_min <= self.beta <= self.beta_max:
            raise ConfigError(
                f"{_field(task, 'beta')}={beta!r} is outside [beta_min, beta_max] = "
                f"[{beta_min!r}, {beta_max!r}]; set beta inside the range or widen it "
                "(for no KL term use kind 'fixed' with beta 0)"
            )

    def update(self, kl: float, step: int, n: int = 1) -> BetaChange | None:
        """Feed the KL measured at ``step`` on ``n`` samples; a record only if beta moved."""
        raise NotImplementedError

    def _move(self, step: int, kl: float, target: float, reason: str) -> BetaChange | None:
        new = min(max(target, self.beta_min), self.beta_max)
        if new == self.beta:
            return None  # e.g. already at a bound
        old, self.beta = self.beta, new
        return BetaChange(self.task, step, float(kl), old, new, reason)

    def state_dict(self) -> dict[str, Any]:
        """``{"kind": ..., "beta": ...}``; the settings come from the config, not the state."""
        return {"kind": self.kind, "beta": self.beta}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != self.kind:
            raise ConfigError(
                f"{_field(self.task, 'kind')}={self.kind!r}, but the checkpoint holds the state "
                f"of a {state.get('kind')!r} controller; set kind back to "
                f"{state.get('kind')!r} to resume this run"
            )
        self.beta = float(state["beta"])


class FixedKL(KLController):
    """A constant beta (the GRPO default of DeepSeekMath, arXiv 2402.03300)."""

    kind = "fixed"

    def __init__(self, task: str, beta: float) -> None:
        if _check_number(task, "beta", beta) < 0:
            raise ConfigError(f"{_field(task, 'beta')}={beta!r} must be >= 0 (0 = no KL term)")
        super().__init__(task, beta, beta_min=beta, beta_max=beta)

    def update(self, kl: float, step: int, n: int = 1) -> BetaChange | None:
        return None


class BandKL(KLController):
    """Keep KL inside ``[low, high]``: below ``low`` beta *= 1 - rate, above ``high``
    beta *= 1 + rate, inside unchanged; beta is clamped to ``[beta_min, beta_max]``.

    A multiplicative band rule in the spirit of the adaptive KL of Ziegler et al. 2019
    (arXiv 1909.08593), with a dead zone so a healthy KL never moves beta.
    """

    kind = "band"

    def __init__(
        self,
        task: str,
        beta: float,
        low: float,
        high: float,
        rate: float = 0.15,
        beta_min: float = 1e-4,
        beta_max: float = 10.0,
    ) -> None:
        super().__init__(task, beta, beta_min, beta_max)
        self.low = _check_number(task, "low", low)
        self.high = _check_number(task, "high", high)
        self.rate = _check_number(task, "rate", rate)
        if not self.low < self.high:
            raise ConfigError(
                f"{_field(task, 'low')}={low!r} must be below {_field(task, 'high')}={high!r}; "
                "give the healthy KL band as low < high, e.g. low 0.02, high 0.06"
            )
        if not 0 < self.rate < 1:
            raise ConfigError(
                f"{_field(task, 'rate')}={rate!r} must be in (0, 1); it is the fraction beta "
                "moves per step outside the band, e.g. 0.15"
            )

    def update(self, kl: float, step: int, n: int = 1) -> BetaChange | None:
        """Move beta one notch if ``kl`` is outside the band; ``n`` is ignored."""
        if not math.isfinite(kl):
            return None
        if kl < self.low:
            reason = f"KL {_num(kl)} < {_num(self.low)}"
            return self._move(step, kl, self.beta * (1 - self.rate), reason)
        if kl > self.high:
            reason = f"KL {_num(kl)} > {_num(self.high)}"
            return self._move(step, kl, self.beta * (1 + self.rate), reason)
        return None


class ProportionalKL(KLController):
    """Adaptive KL of Ziegler et al. 2019 (arXiv 1909.08593, section 2.2):
    ``e = clip(KL / target - 1, -0.2, 0.2)``, ``beta *= 1 + e * n / horizon``, where ``n``
    is the number of samples since the last update; beta is clamped to
    ``[beta_min, beta_max]``.
    """

    kind = "proportional"

    def __init__(
        self,
        task: str,
        beta: float,
        target: float,
        horizon: float = 10000,
        beta_min: float = 1e-4,
        beta_max: float = 10.0,
    ) -> None:
        super().__init__(task, beta, beta_min, beta_max)
        self.target = _check_number(task, "target", target)
        self.horizon = _check_number(task, "horizon", horizon)
        if self.target <= 0:
            raise ConfigError(
                f"{_field(task, 'target')}={target!r} must be > 0; set the KL you want "
                "this task to hold, e.g. 0.05"
            )
        if self.horizon <= 0:
            raise ConfigError(
                f"{_field(task, 'horizon')}={horizon!r} must be > 0; it is the number of "
                "samples over which beta reacts, e.g. 10000"
            )

    def update(self, kl: float, step: int, n: int = 1) -> BetaChange | None:
        """One proportional step from ``kl`` measured on ``n`` samples."""
        if n < 0:
            raise ValueError(f"n (samples since the last update) must be >= 0, got {n}")
        if not math.isfinite(kl):
            return None
        error = min(max(kl / self.target - 1.0, -0.2), 0.2)
        reason = f"KL {_num(kl)} vs target {_num(self.target)}"
        return self._move(step, kl, self.beta * (1.0 + error * n / self.horizon), reason)


# `dual` moves beta a little at every update; a change is logged once beta is this far (in
# ln) from the last logged value: ln 1.1, a 10 % move
LOG_CHANGE = math.log(1.1)


class DualKL(KLController):
    """beta as the Lagrange multiplier of this task's KL constraint, holding the KL inside
    the band ``[low, high]`` by a PI law on log beta.

    The GRPO objective with a KL penalty, max E[A] - beta * KL, is the Lagrangian of
    max E[A] subject to KL <= budget; beta is its multiplier, and dual ascent raises it while
    the constraint is violated and lowers it while there is slack (Boyd & Vandenberghe,
    Convex Optimization, 5.5; RL with a KL budget: Stooke et al. 2020, arXiv 2007.03964, which
    adds a proportional term to damp the multiplier's oscillations). The error is measured in
    logs from the band's middle: the `quiet` share of the band's log-width around its
    geometric centre, where beta stays put (``quiet = 0``: the centre itself). Above it,
    ``e = ln(KL / quiet_high)``, below it ``e = ln(KL / quiet_low)``, clipped to +-1.5, so a KL
    10x off moves beta as much either way; in velocity form

        ln beta <- ln beta + ki * e_k + kp * (e_k - e_{k-1}),

    each change capped at ``max_step`` (ln 2: at most x2 or /2 per update) and beta clamped
    to ``[beta_min, beta_max]`` (the clamp is the integrator's state, so it does not wind up).
    The proportional term answers the KL's change, which leads its level: the policy moves
    toward a new beta over many steps, and an integral law alone overshoots. The quiet middle
    keeps beta from chasing the KL's noise, and leaves a margin to the band's edges. During the
    first ``warmup_steps`` steps beta may rise but not fall, and the proportional term starts
    after them: the policy starts at the reference, so an early KL near 0 says nothing about
    the slack, and its rise from 0 is not a change to answer.

    On a simulated plant (KL relaxing toward c / beta or c / beta^2 with a 10- or 20-step time
    constant, a 3-step delay and 60 % log-normal noise per step, updates on the mean of every
    10 steps, as in the demo) it settles into the band within 150 steps (15 updates) from beta
    10x too small or too large and stays in it; without noise beta settles to a constant, no
    limit cycle (`tests/unit/test_kl_dual.py`). A slower plant takes proportionally longer;
    larger gains settle faster on a quiet plant but let the KL's noise through to beta
    (kp 1.0 never settled at this noise).
    """

    kind = "dual"

    def __init__(
        self,
        task: str,
        beta: float,
        low: float,
        high: float,
        kp: float = 0.3,
        ki: float = 0.2,
        max_step: float = math.log(2),
        quiet: float = 0.5,
        warmup_steps: int = 0,
        beta_min: float = 1e-4,
        beta_max: float = 10.0,
    ) -> None:
        super().__init__(task, beta, beta_min, beta_max)
        self.low = _check_number(task, "low", low)
        self.high = _check_number(task, "high", high)
        self.kp = _check_number(task, "kp", kp)
        self.ki = _check_number(task, "ki", ki)
        self.max_step = _check_number(task, "max_step", max_step)
        self.quiet = _check_number(task, "quiet", quiet)
        self.warmup_steps = int(_check_number(task, "warmup_steps", warmup_steps))
        if not 0 < self.low < self.high:
            raise ConfigError(
                f"{_field(task, 'low')}={low!r} and {_field(task, 'high')}={high!r} must "
                "satisfy 0 < low < high; give the healthy KL band, e.g. low 0.02, high 0.06"
            )
        if self.kp < 0 or self.ki <= 0:
            raise ConfigError(
                f"{_field(task, 'kp')}={kp!r}, {_field(task, 'ki')}={ki!r}: need kp >= 0 and "
                "ki > 0 (defaults 0.3 and 0.2)"
            )
        if not 0 < self.max_step <= 2:
            raise ConfigError(
                f"{_field(task, 'max_step')}={max_step!r} must be in (0, 2]: the largest change "
                "of ln(beta) in one update (default ln 2 = 0.693: at most x2 or /2)"
            )
        if not 0 <= self.quiet < 1:
            raise ConfigError(
                f"{_field(task, 'quiet')}={quiet!r} must be in [0, 1): the share of the band "
                "(in logs, around its centre) where beta stays put (default 0.5)"
            )
        if self.warmup_steps < 0:
            raise ConfigError(f"{_field(task, 'warmup_steps')}={warmup_steps!r} must be >= 0")
        if self.beta <= 0 or self.beta_min <= 0:
            raise ConfigError(
                f"{_field(task, 'beta')}={beta!r} and {_field(task, 'beta_min')}={beta_min!r} "
                "must be > 0 for kind 'dual', which moves beta by factors"
            )
        # the quiet middle: `quiet` of the band's log-width around its geometric centre
        margin = (1 - self.quiet) / 2 * math.log(self.high / self.low)
        self.quiet_low, self.quiet_high = self.low * math.exp(margin), self.high / math.exp(margin)
        self._last_error: float | None = None
        self._logged: float | None = beta  # beta as the last logged change left it

    def update(self, kl: float, step: int, n: int = 1) -> BetaChange | None:
        """One PI step from the window's mean ``kl``; ``n`` is ignored. A record once beta is
        10 % or more from the last recorded value (the record's `old`)."""
        if not math.isfinite(kl):
            return None
        if kl > self.quiet_high:
            error = math.log(kl / self.quiet_high)
        elif kl < self.quiet_low:
            error = math.log(kl / self.quiet_low) if kl > 0 else -1.5
        else:
            error = 0.0
        error = min(max(error, -1.5), 1.5)
        last = error if self._last_error is None else self._last_error
        delta = self.ki * error + self.kp * (error - last)
        delta = min(max(delta, -self.max_step), self.max_step)
        if step <= self.warmup_steps:
            delta = max(delta, 0.0)  # (and no memory: the KL's rise from 0 is no error)
        else:
            self._last_error = error
        self.beta = min(max(self.beta * math.exp(delta), self.beta_min), self.beta_max)
        logged = self._logged if self._logged is not None else self.beta
        if abs(math.log(self.beta / logged)) < LOG_CHANGE:
            return None  # small moves every update: logged once they add up
        if kl < self.low:
            reason = f"KL {_num(kl)} < {_num(self.low)}"
        elif kl > self.high:
            reason = f"KL {_num(kl)} > {_num(self.high)}"
        else:
            reason = f"KL {_num(kl)} in band {_num(self.low)}-{_num(self.high)}"
        self._logged = self.beta
        return BetaChange(self.task, step, float(kl), logged, self.beta, reason)

    def state_dict(self) -> dict[str, Any]:
        """beta, the last error (the proportional term's memory) and the last logged beta."""
        return {**super().state_dict(), "last_error": self._last_error, "logged": self._logged}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        last, logged = state.get("last_error"), state.get("logged")
        self._last_error = None if last is None else float(last)
        self._logged = None if logged is None else float(logged)


_CLASSES: dict[str, type[KLController]] = {
    "fixed": FixedKL,
    "band": BandKL,
    "proportional": ProportionalKL,
    "dual": DualKL,
}
_REQUIRED = {"fixed": (), "band": ("low", "high"), "proportional": ("target",),
             "dual": ("low", "high")}
_OPTIONS = {
    "fixed": (),
    "band": ("low", "high", "rate", "beta_min", "beta_max"),
    "proportional": ("target", "horizon", "beta_min", "beta_max"),
    "dual": ("low", "high", "kp", "ki", "max_step", "quiet", "warmup_steps", "beta_min",
             "beta_max"),
}


def make_controller(task: str, kind: str, beta: float, **options: Any) -> KLController:
    """Build the controller ``kind`` for ``task``; every mistake is a ConfigError naming
    ``tasks.<task>.kl.<field>``, the bad value and the fix."""
    if kind not in _CLASSES:
        raise ConfigError(
            f"{_field(task, 'kind')}={kind!r} is not supported; choose one of {list(KL_CONTROLLERS)}"
        )
    allowed = _OPTIONS[kind]
    for name, value in options.items():
        if name not in allowed:
            hint = f"its options are {list(allowed)}" if allowed else "it takes no options"
            raise ConfigError(
                f"{_field(task, name)}={value!r} does not apply to kind {kind!r}; remove it "
                f"or change the kind ({hint})"
            )
    for name in _REQUIRED[kind]:
        if name not in options:
            raise ConfigError(
                f"{_field(task, name)} is required for kind {kind!r}; "
                + ("e.g. target: 0.05" if kind == "proportional" else "e.g. low: 0.02, high: 0.06")
            )
    return _CLASSES[kind](task, beta, **options)
