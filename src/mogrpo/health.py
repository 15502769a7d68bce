"""Training health: named checks on every step's metrics that catch the silent failures of RL
fine-tuning (a run that looks alive while nothing is learned) and say what to try.

Each check has a threshold, a patience (consecutive steps the condition must hold; for
`non_finite` the number of bad steps) and an action: `warn` records and logs the alert, `stop`
also asks the trainer to end the run. An alert fires once when its patience is reached and
re-arms when the condition clears.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mogrpo.errors import MogrpoError

Action = Literal["warn", "stop"]


class _Section(BaseModel):
    # the same rules as mogrpo.config sections (not imported: config.py will import this module)
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True)


class CheckConfig(_Section):
    enabled: bool = True
    """Run this check."""
    patience: int = Field(5, ge=1)
    """Consecutive steps the condition must hold before the alert fires."""
    action: Action = "warn"
    """`warn`: log the alert and write it to metrics.jsonl; `stop`: also end the run."""


class NotLearningConfig(CheckConfig):
    patience: int = Field(10, ge=1)
    """Consecutive steps with KL and update size at 0 (while lr > 0 and advantages ≠ 0)."""
    action: Action = "stop"
    """`stop` (default: every further step is wasted GPU time) or `warn`."""
    kl_epsilon: float = Field(1e-8, ge=0)
    """KL at or below this is 0: the policy still equals the reference."""
    update_epsilon: float = Field(0.0, ge=0)
    """`policy/update_norm` (else `policy/grad_norm`) at or below this is no update."""


class KLExplosionConfig(CheckConfig):
    patience: int = Field(3, ge=1)
    """Consecutive steps above the ceiling or the growth factor."""
    ceiling: float = Field(1.0, gt=0)
    """Absolute KL ceiling per task (healthy runs sit around 0.02–0.3)."""
    growth_factor: float = Field(5.0, gt=1)
    """Alert when KL exceeds this × its median over the earlier half of the window."""
    window: int = Field(20, ge=4)
    """Steps of KL history for the growth test."""
    min_kl: float = Field(0.05, ge=0)
    """Growth only counts once KL is at least this (0.001 → 0.005 is not an explosion)."""


class LengthCollapseConfig(CheckConfig):
    patience: int = Field(3, ge=1)
    """Consecutive steps below the floor or the drop threshold."""
    floor: float = Field(2.0, ge=0)
    """Mean completion length (tokens) below which completions have collapsed."""
    drop_factor: float = Field(0.3, gt=0, lt=1)
    """Alert when the mean falls below this × its median over the window."""
    window: int = Field(20, ge=2)
    """Steps of length history for the drop test."""


class TruncationConfig(CheckConfig):
    threshold: float = Field(0.2, gt=0, le=1)
    """Fraction of completions cut at max_completion_length (healthy runs: ≈ 0)."""


class NoSignalConfig(CheckConfig):
    patience: int = Field(10, ge=1)
    """Consecutive steps with too many zero-variance groups."""
    threshold: float = Field(0.9, gt=0, le=1)
    """Fraction of a task's groups whose K rewards are all equal (no advantage, no gradient)."""


class NonFiniteConfig(CheckConfig):
    patience: int = Field(3, ge=1)
    """Steps (not necessarily consecutive) with NaN/inf in loss, grad norm, KL or logits."""
    action: Action = "stop"
    """`stop` (default: the run is diverging) or `warn`."""


class GradSpikeConfig(CheckConfig):
    patience: int = Field(1, ge=1)
    """Consecutive spiking steps."""
    factor: float = Field(10.0, gt=1)
    """A spike is a grad norm above this × the running median."""
    window: int = Field(50, ge=2)
    """Steps in the running median."""
    min_history: int = Field(10, ge=1)
    """Steps of history needed before spikes are judged."""


class SamplingIgnoredConfig(CheckConfig):
    entropy_floor: float = Field(0.01, ge=0)
    """Mean token entropy (nats) below which sampling looks greedy."""
    identical_threshold: float = Field(0.9, gt=0, le=1)
    """Fraction of groups with K identical completions (`rollout/identical_group_frac`)."""
    min_temperature: float = Field(0.3, ge=0)
    """Only judge runs sampling at least this hot (cold sampling is near-greedy by design)."""


class RewardStalledConfig(CheckConfig):
    patience: int = Field(200, ge=1)
    """Steps without improvement of a task's smoothed reward mean."""
    min_delta: float = Field(0.01, ge=0)
    """Improvement that counts (in reward units)."""
    smooth: int = Field(10, ge=1)
    """Steps in the moving average the best value is taken over."""


class HealthConfig(_Section):
    enabled: bool = True
    """Watch every step's metrics; alerts go to the log, metrics.jsonl and the run summary."""
    not_learning: NotLearningConfig = Field(default_factory=NotLearningConfig)
    """KL to the reference and the update size stay 0 (accumulation bug, frozen parameters)."""
    kl_explosion: KLExplosionConfig = Field(default_factory=KLExplosionConfig)
    """KL above a ceiling, or growing by a factor within a window."""
    length_collapse: LengthCollapseConfig = Field(default_factory=LengthCollapseConfig)
    """Mean completion length below a floor, or falling sharply."""
    truncation: TruncationConfig = Field(default_factory=TruncationConfig)
    """Too many completions cut by the length budget."""
    no_signal: NoSignalConfig = Field(default_factory=NoSignalConfig)
    """Too many groups whose K completions all score the same."""
    non_finite: NonFiniteConfig = Field(default_factory=NonFiniteConfig)
    """NaN/inf in loss, grad norm, KL or logits."""
    grad_spike: GradSpikeConfig = Field(default_factory=GradSpikeConfig)
    """Gradient norm far above its running median."""
    sampling_ignored: SamplingIgnoredConfig = Field(default_factory=SamplingIgnoredConfig)
    """Entropy or in-group diversity inconsistent with the sampling temperature."""
    reward_stalled: RewardStalledConfig = Field(default_factory=RewardStalledConfig)
    """No improvement of a task's reward over a long window."""


@dataclass
class StepContext:
    """What the metrics do not say: the run's settings at this step."""

    lr: float | None = None
    """Learning rate of this step; None = read `lr` from the metrics."""
    temperature: float | None = None
    """Sampling temperature (rollout.temperature)."""
    kl_measured: bool = True
    """Whether KL is computed at all (some task has β > 0); else `kl` is always 0."""
    max_completion_length: int | None = None
    """The completion budget, named in truncation alerts."""


@dataclass
class Alert:
    """One fired check: a readable one-line message and what the trainer should do."""

    check: str
    step: int
    message: str
    action: str

    def as_event(self) -> dict[str, Any]:
        """The record written to metrics.jsonl next to the step's metrics."""
        return {"event": "health_alert", **asdict(self)}


class HealthStop(MogrpoError):
    """A `stop` check fired; raised by the trainer after saving its checkpoint and metrics."""

    exit_code = 3

    def __init__(self, alerts: list[Alert]) -> None:
        self.alerts = alerts
        super().__init__("run stopped by the health monitor: " + "; ".join(
            a.message for a in alerts) + " (checkpoint and metrics.jsonl are kept; set "
            f"health.{alerts[0].check}.action: warn to only warn)")


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def _series(metrics: Mapping[str, Any], suffix: str) -> list[str]:
    """Per-task keys `task/NAME/<suffix>`, sorted."""
    return sorted(k for k in metrics if k.startswith("task/") and k.endswith("/" + suffix)
                  and k.count("/") == suffix.count("/") + 2)


def _task(key: str) -> str:
    return key.split("/")[1] if key.startswith("task/") else "all tasks"


class HealthMonitor:
    """Runs the configured checks on each step's metrics; its state checkpoints as JSON."""

    def __init__(self, config: HealthConfig | None = None) -> None:
        self.config = config or HealthConfig()
        self.alerts: list[Alert] = []
        self._streak: dict[str, int] = {}
        self._history: dict[str, list[float]] = {}
        self._best: dict[str, list[float]] = {}  # reward key -> [best smoothed mean, its step]
        self._nonfinite = 0
        self._skipped = 0.0
        self._steps = 0
        self._stop = False

    @property
    def should_stop(self) -> bool:
        """True once a `stop` check has fired in this process (a resumed run starts afresh)."""
        return self._stop

    def observe(self, step: int, metrics: Mapping[str, Any],
                context: StepContext | Mapping[str, Any] | None = None) -> list[Alert]:
        """Feed one step's metrics; returns the alerts that fired at this step."""
        if not self.config.enabled:
            return []
        ctx = StepContext(**context) if isinstance(context, Mapping) else context or StepContext()
        self._steps += 1
        fired: list[Alert] = []
        checks: list[tuple[str, Callable[..., None]]] = [
            ("not_learning", self._not_learning), ("kl_explosion", self._kl_explosion),
            ("length_collapse", self._length_collapse), ("truncation", self._truncation),
            ("no_signal", self._no_signal), ("non_finite", self._non_finite),
            ("grad_spike", self._grad_spike), ("sampling_ignored", self._sampling_ignored),
            ("reward_stalled", self._reward_stalled)]
        for name, check in checks:
            if getattr(self.config, name).enabled:
                check(step, metrics, ctx, fired)
        self.alerts.extend(fired)
        self._stop = self._stop or any(a.action == "stop" for a in fired)
        return fired

    # ---------------------------------------------------------------- helpers

    def _held(self, check: str, series: str, condition: bool) -> bool:
        """Count consecutive steps of `condition`; True once, when the patience is reached."""
        key = f"{check}:{series}"
        if not condition:
            self._streak.pop(key, None)
            return False
        self._streak[key] = self._streak.get(key, 0) + 1
        return self._streak[key] == getattr(self.config, check).patience

    def _fire(self, check: str, step: int, text: str, fired: list[Alert]) -> None:
        action = getattr(self.config, check).action
        fired.append(Alert(check, step, f"[health] {check} at step {step}: {text}", action))

    def _push(self, key: str, value: float, window: int) -> list[float]:
        """The history of `key` before this value; appends it, keeping `window` values."""
        history = self._history.setdefault(key, [])
        before = list(history)
        history.append(value)
        del history[:-window]
        return before

    # ---------------------------------------------------------------- checks

    def _not_learning(self, step: int, m: Mapping[str, Any], ctx: StepContext,
                      fired: list[Alert]) -> None:
        cfg = self.config.not_learning
        lr = ctx.lr if ctx.lr is not None else m.get("lr")
        zero_var = [m[k] for k in _series(m, "zero_var_frac")]
        signal = not zero_var or min(zero_var) < 1.0  # some group has non-zero advantages
        kl, update = m.get("kl"), m.get("policy/update_norm")
        name = "update norm" if update is not None else "grad norm"
        size = update if update is not None else m.get("policy/grad_norm")
        # an update norm says whether parameters moved; a grad norm only when it is 0
        moved = None if not _finite(size) or (update is None and size > cfg.update_epsilon) \
            else size > cfg.update_epsilon
        if ctx.kl_measured and _finite(kl):
            stuck = kl <= cfg.kl_epsilon and moved is not True
        else:
            stuck = moved is False
        if self._held("not_learning", "policy", _finite(lr) and lr > 0 and signal and stuck):
            self._fire("not_learning", step, (
                f"KL {kl if _finite(kl) else 'n/a'} and {name} {size} have stayed at 0 for "
                f"{cfg.patience} steps while lr = {lr:.3g} and advantages are non-zero: the "
                "policy is not moving. Likely: gradients overwritten instead of accumulated or "
                "zero_grad/step inside the accumulation loop, frozen parameters, or an optimizer "
                "over other parameters. Try: check the trainable-parameter count in the startup "
                "log and lora.target_modules; accumulate gradients and step once per optimizer "
                "step"), fired)

    def _kl_explosion(self, step: int, m: Mapping[str, Any], ctx: StepContext,
                      fired: list[Alert]) -> None:
        cfg = self.config.kl_explosion
        for key in ["kl", *_series(m, "kl")]:
            value = m.get(key)
            if not _finite(value):
                continue
            before = self._push(key, value, cfg.window)
            full = len(before) >= cfg.window - 1
            base = statistics.median(before[: len(before) // 2]) if full else math.inf
            growing = full and value >= cfg.min_kl and value > cfg.growth_factor * base
            if not self._held("kl_explosion", key, value > cfg.ceiling or growing):
                continue
            how = (f"above the ceiling {cfg.ceiling:g}" if value > cfg.ceiling else
                   f"{value / base:.1f}× its earlier median {base:.3f}")
            self._fire("kl_explosion", step, (
                f"{'' if key == 'kl' else f'task {_task(key)} '}KL {value:.3f} is {how} for "
                f"{cfg.patience} steps. Likely: β too small for the learning rate, an unstable "
                "KL estimator (k1/k2 or a clamped log-ratio), log-probs at another temperature "
                "than sampling, or a reference that is not the starting model. Try: raise this "
                "task's beta or kl.kind: band, a lower train.learning_rate, "
                "algorithm.kl_estimator: k3"), fired)

    def _length_collapse(self, step: int, m: Mapping[str, Any], ctx: StepContext,
                         fired: list[Alert]) -> None:
        cfg = self.config.length_collapse
        for key in ["rollout/completion_length", *_series(m, "completion_length")]:
            value = m.get(key)
            if not _finite(value):
                continue
            before = self._push(key, value, cfg.window)
            median = statistics.median(before) if len(before) >= cfg.window - 1 else None
            dropped = median is not None and value < cfg.drop_factor * median
            if not self._held("length_collapse", key, value < cfg.floor or dropped):
                continue
            recent = f", median {median:.1f} over the {len(before)} steps before" if median else ""
            self._fire("length_collapse", step, (
                f"{_task(key)}: mean completion length {value:.1f} tokens (floor {cfg.floor:g}"
                f"{recent}) for {cfg.patience} steps. Likely: a reward that pays for short "
                "answers (length penalty, a format reward met by one token), an end-of-turn "
                "token sampled first (chat template or stop_token_ids mismatch), or a collapsed "
                "policy. Try: check the rendered prompts and stop ids, lower the length "
                "reward's weight, raise β"), fired)

    def _truncation(self, step: int, m: Mapping[str, Any], ctx: StepContext,
                    fired: list[Alert]) -> None:
        cfg, value = self.config.truncation, m.get("rollout/truncated_frac")
        if self._held("truncation", "rollout", _finite(value) and value > cfg.threshold):
            budget = f" = {ctx.max_completion_length}" if ctx.max_completion_length else ""
            self._fire("truncation", step, (
                f"{value:.0%} of completions hit rollout.max_completion_length{budget} "
                f"(threshold {cfg.threshold:.0%}) for {cfg.patience} steps. Likely: a budget "
                "too small for the task, repetition loops, or a stop token the model never "
                "emits. Try: raise max_completion_length, check stop_token_ids, add "
                "presence/frequency penalties or a length penalty"), fired)

    def _no_signal(self, step: int, m: Mapping[str, Any], ctx: StepContext,
                   fired: list[Alert]) -> None:
        cfg = self.config.no_signal
        for key in _series(m, "zero_var_frac"):
            value, task = m[key], _task(key)
            if not self._held("no_signal", key, _finite(value) and value > cfg.threshold):
                continue
            reward = m.get(f"task/{task}/reward/mean")
            mean = f" (reward mean {reward:.3f})" if _finite(reward) else ""
            self._fire("no_signal", step, (
                f"task {task}: {value:.0%} of groups score all K completions the same{mean} for "
                f"{cfg.patience} steps: no advantage, no gradient. Likely: the task is too easy "
                "(all pass) or too hard (all fail) for the model, or K is small. Try: more "
                "completions per prompt (rollout.num_generations), a graded reward with partial "
                "credit, algorithm.dynamic_sampling: true, or easier/harder prompts"), fired)

    def _non_finite(self, step: int, m: Mapping[str, Any], ctx: StepContext,
                    fired: list[Alert]) -> None:
        bad = [k for k in ("loss", "policy/grad_norm", "kl") if k in m and not _finite(m[k])]
        bad += [k for k in m if k.endswith("nonfinite_logits") and _finite(m[k]) and m[k] > 0]
        skipped = m.get("policy/skipped_updates")  # cumulative in the trainer
        if _finite(skipped) and skipped > self._skipped:
            bad.append("policy/skipped_updates")
            self._skipped = float(skipped)
        if not bad:
            return
        self._nonfinite += 1  # bad steps need not be consecutive
        if self._nonfinite == self.config.non_finite.patience:
            self._fire("non_finite", step, (
                f"NaN/inf on {self._nonfinite} steps, now in {', '.join(bad)}. Likely: float16 "
                "overflow, a learning rate too high, -inf log-probs of masked tokens reaching "
                "the loss, or a reward returning NaN/inf. Try: model.dtype bfloat16, a lower "
                "train.learning_rate, rewards that return a finite number or None"), fired)

    def _grad_spike(self, step: int, m: Mapping[str, Any], ctx: StepContext,
                    fired: list[Alert]) -> None:
        cfg, value = self.config.grad_spike, m.get("policy/grad_norm")
        if not _finite(value):
            return
        before = self._push("policy/grad_norm", value, cfg.window + 1)
        median = statistics.median(before) if len(before) >= cfg.min_history else 0.0
        spike = len(before) >= cfg.min_history and value > cfg.factor * max(median, 1e-12)
        if self._held("grad_spike", "policy", spike):
            self._fire("grad_spike", step, (
                f"grad norm {value:.3g} is {value / max(median, 1e-12):.0f}× its running median "
                f"{median:.3g} ({len(before)} steps). Likely: a group with a tiny reward std "
                "(huge advantages), one long completion dominating the loss, or an outlier "
                "reward; clipping contains one spike, repeated spikes precede divergence. Try: a "
                "lower train.learning_rate, algorithm.advantage_scaling: batch, check the "
                "reward scale"), fired)

    def _sampling_ignored(self, step: int, m: Mapping[str, Any], ctx: StepContext,
                          fired: list[Alert]) -> None:
        cfg, t = self.config.sampling_ignored, ctx.temperature
        entropy, same = m.get("policy/entropy"), m.get("rollout/identical_group_frac")
        low = _finite(entropy) and entropy < cfg.entropy_floor
        alike = _finite(same) and same > cfg.identical_threshold
        hot = t is not None and t >= cfg.min_temperature
        if self._held("sampling_ignored", "rollout", hot and (low or alike)):
            seen = f"token entropy {entropy:.4f} nats" if _finite(entropy) else "no entropy"
            if _finite(same):
                seen += f" and {same:.0%} of groups with K identical completions"
            self._fire("sampling_ignored", step, (
                f"sampling at temperature {t:g} but {seen} for {cfg.patience} steps. Likely: "
                "sampling flags dropped before generate() (watch for 'generation flags are not "
                "valid and may be ignored'), greedy decoding, or a policy collapsed to one "
                "answer. Try: check the generation warnings and settings in the log; if KL is "
                "high too, raise β"), fired)

    def _reward_stalled(self, step: int, m: Mapping[str, Any], ctx: StepContext,
                        fired: list[Alert]) -> None:
        cfg = self.config.reward_stalled
        for key in _series(m, "reward/mean"):
            value = m[key]
            if not _finite(value):
                continue
            recent = self._push(key, value, cfg.smooth) + [value]
            if len(recent) < cfg.smooth:
                continue
            smoothed = statistics.fmean(recent[-cfg.smooth:])
            best = self._best.get(key)
            improved = best is None or smoothed > best[0] + cfg.min_delta
            if improved:
                self._best[key] = [smoothed, step]
            if self._held("reward_stalled", key, not improved):
                best_value, best_step = self._best[key]
                self._fire("reward_stalled", step, (
                    f"task {_task(key)}: reward mean (smoothed over {cfg.smooth} steps) "
                    f"{smoothed:.3f} has not beaten its best {best_value:.3f} (step "
                    f"{best_step:.0f}) by {cfg.min_delta:g} for {cfg.patience} steps. Likely: the "
                    "task has converged or its reward is saturated, β holds the policy at the "
                    "reference, or the learning rate is too low. Try: compare the eval scores; "
                    "if it is a plateau, stop or move the curriculum on, else lower β or raise "
                    "the learning rate"), fired)

    # ---------------------------------------------------------------- reporting and state

    def summary(self) -> str:
        """Every alert of the run, one per line, for the end-of-run report."""
        if not self.alerts:
            return f"health: no alerts in {self._steps} steps"
        lines = [f"health: {len(self.alerts)} alert(s) in {self._steps} steps"]
        lines += [f"  step {a.step} {a.check} ({a.action}): {a.message}" for a in self.alerts]
        return "\n".join(lines)

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe state: counters, histories, best rewards and the alerts so far."""
        return {"alerts": [asdict(a) for a in self.alerts], "streak": dict(self._streak),
                "history": {k: list(v) for k, v in self._history.items()},
                "best": {k: list(v) for k, v in self._best.items()},
                "nonfinite": self._nonfinite, "skipped": self._skipped, "steps": self._steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.alerts = [Alert(**a) for a in state["alerts"]]
        self._streak = dict(state["streak"])
        self._history = {k: list(v) for k, v in state["history"].items()}
        self._best = {k: list(v) for k, v in state["best"].items()}
        self._nonfinite, self._skipped = state["nonfinite"], state["skipped"]
        self._steps = state["steps"]
