"""Training health: named checks on every step's metrics that catch the silent failures of RL
fine-tuning (a run that looks alive while nothing is learned) and say what to try.

Each check has a threshold, a patience (consecutive steps the condition must hold; for
`non_finite` the number of bad steps) and an action: `warn` records and logs the alert, `stop`
also asks the trainer to end the run. An alert fires once when its patience is reached and
re-arms when the condition clears.

Two checks ask whether the run is getting *worse* (`reward_regression`, `eval_regression`,
see `mogrpo.health.regression`); `eval_regression` may also ask the trainer to roll back to
the best checkpoint (`rollback_alert`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from mogrpo.config.health import HealthConfig
from mogrpo.errors import ExitCode, MogrpoError
from mogrpo.health.regression import EvalRegression, Finding, RewardRegression, RunFacts
from mogrpo.tracking import names


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
    kl_budgets: dict[str, float] = field(default_factory=dict)
    """Per task, the KL its controller steers toward (band `high`, proportional `target`):
    KL growing up to its budget is what the user asked for, not an explosion."""
    kl_bands: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Per task held in a band (`band`, `dual`): (low, high), for `kl_out_of_band`."""
    full_finetune: bool | None = None
    """All weights trained (True) or adapters (False): the learning rate a regression alert
    calls too high, and suggests, depends on it."""
    learning_rate: float | None = None
    """The run's peak learning rate (train.learning_rate, × lr_factor per rollback), which a
    fix names; None = this step's `lr` (lower during warm-up)."""
    max_grad_norm: float | None = None
    """The clipping threshold (train.max_grad_norm): a spike it cuts to a few typical norms is
    contained (`grad_spike`); None = unknown, every spike counts."""


@dataclass
class Alert:
    """One fired check: a readable one-line message and what the trainer should do, with the
    message's parts for the report: what was seen, the likely causes (most likely first, each
    with its fix) and the fix to try first."""

    check: str
    step: int
    message: str
    action: str
    evidence: str = ""
    causes: list[str] = field(default_factory=list)
    fix: str = ""
    best_step: int | None = None
    """eval_regression: the evaluated step to go back to (best on the Pareto front)."""

    def as_event(self) -> dict[str, Any]:
        """The record written to metrics.jsonl next to the step's metrics."""
        return {"event": "health_alert", **asdict(self)}


class HealthStop(MogrpoError):
    """A `stop` check fired; raised by the trainer after saving its checkpoint and metrics."""

    exit_code = ExitCode.FOUND_PROBLEM

    def __init__(self, alerts: list[Alert]) -> None:
        self.alerts = alerts
        super().__init__("run stopped by the health monitor: " + "; ".join(
            a.message for a in alerts) + " (checkpoint and metrics.jsonl are kept; set "
            f"health.{alerts[0].check}.action: warn to only warn)")


def _split(text: str) -> tuple[str, list[str], str]:
    """A message `EVIDENCE. Likely: CAUSES. Try: FIX` as its three parts."""
    evidence, _, rest = text.partition(". Likely: ")
    causes, _, fix = rest.partition(". Try: ")
    if not rest:
        evidence, _, fix = text.partition(". Try: ")
    return evidence, [causes] if causes else [], fix


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


CHECKS = ("not_learning", "reward_regression", "eval_regression", "task_stalled",
          "kl_explosion", "kl_out_of_band", "length_collapse", "truncation", "no_signal",
          "non_finite", "grad_spike", "sampling_ignored", "reward_stalled")
"""Every check, in the order they run on a step."""


class HealthMonitor:
    """Runs the configured checks on each step's metrics; its state checkpoints as JSON."""

    def __init__(self, config: HealthConfig | None = None) -> None:
        self.config = config or HealthConfig()
        self.alerts: list[Alert] = []
        self._streak: dict[str, int] = {}
        self._spikes: list[int] = []  # steps of the recent grad spikes
        self._history: dict[str, list[float]] = {}
        self._best: dict[str, list[float]] = {}  # reward key -> [best smoothed mean, its step]
        self._nonfinite = 0
        self._skipped = 0.0
        self._steps = 0
        self._stop = False
        self._rollback: Alert | None = None
        self.rollbacks = 0
        self.reward_regression = RewardRegression(self.config.reward_regression)
        self._kl_told: list[str] = []  # tasks whose reward alert holds their KL growth
        self.eval_regression = EvalRegression(self.config.eval_regression)
        self._scores: dict[str, list[float]] = {}  # task -> its quick-eval scores so far

    @property
    def should_stop(self) -> bool:
        """True once a `stop` check has fired in this process (a resumed run starts afresh)."""
        return self._stop

    @property
    def rollback_alert(self) -> Alert | None:
        """The `rollback` alert of the last observed step, if one fired."""
        return self._rollback

    def observe(self, step: int, metrics: Mapping[str, Any],
                context: StepContext | Mapping[str, Any] | None = None) -> list[Alert]:
        """Feed one step's metrics; returns the alerts that fired at this step."""
        if not self.config.enabled:
            return []
        ctx = StepContext(**context) if isinstance(context, Mapping) else context or StepContext()
        self._steps += 1
        fired: list[Alert] = []
        for name in CHECKS:
            if getattr(self.config, name).enabled:
                check: Callable[..., None] = getattr(self, f"_{name}")
                check(step, metrics, ctx, fired)
        return self._record(fired)

    def observe_eval(self, step: int, metrics: Mapping[str, Any], final: bool = False
                     ) -> list[Alert]:
        """Feed a quick-eval that is not part of a training step: the one before GRPO, or
        the one after it (`final`: its alerts only warn, the run is over)."""
        if not self.config.enabled:
            return []
        fired: list[Alert] = []
        if self.config.eval_regression.enabled:
            self._eval_regression(step, metrics, StepContext(), fired)
        if self.config.task_stalled.enabled:
            self._task_stalled(step, metrics, StepContext(), fired)
        for alert in fired:
            alert.action = "warn" if final else alert.action
        return self._record(fired)

    def stop(self) -> None:
        """End the run at this step (a rollback that found nothing to go back to)."""
        self._stop = True
        self._rollback = None

    def note_rollback(self, step: int, restored: int) -> None:
        """The trainer went back to step `restored` at `step`: the reward windows start afresh
        and step `step`'s checkpoint (saved after the rollback) is no longer its eval's."""
        self.rollbacks += 1
        self.reward_regression.reset()
        # a regression after the rollback is a new one: it must be able to fire again
        self._streak = {k: v for k, v in self._streak.items()
                        if not k.startswith(("reward_regression:", "eval_regression:"))}
        self.eval_regression.overwritten.append(step)
        self._rollback = None

    def _record(self, fired: list[Alert]) -> list[Alert]:
        self.alerts.extend(fired)
        self._stop = self._stop or any(a.action == "stop" for a in fired)
        self._rollback = next((a for a in fired if a.action == "rollback"), None)
        return fired

    # ---------------------------------------------------------------- helpers

    def _held(self, check: str, series: str, condition: bool) -> bool:
        """Count consecutive steps of `condition`; True once, when the patience is reached."""
        return self._count(check, series, condition) == getattr(self.config, check).patience

    def _count(self, check: str, series: str, condition: bool) -> int:
        """Consecutive steps of `condition` up to this one (0 when it does not hold)."""
        key = f"{check}:{series}"
        if not condition:
            self._streak.pop(key, None)
            return 0
        self._streak[key] = self._streak.get(key, 0) + 1
        return self._streak[key]

    def _fire(self, check: str, step: int, text: str, fired: list[Alert]) -> None:
        action = getattr(self.config, check).action
        evidence, causes, fix = _split(text)
        fired.append(Alert(check, step, f"[health] {check} at step {step}: {text}", action,
                           evidence, causes, fix))

    def _fire_finding(self, check: str, step: int, finding: Finding, fired: list[Alert],
                      action: str | None = None) -> None:
        """An alert from a regression finding: causes numbered, most likely first."""
        action = action or getattr(self.config, check).action
        numbered = " ".join(f"({i}) {c};" for i, c in enumerate(finding.causes, 1)).rstrip(";")
        message = (f"[health] {check} at step {step}: {finding.evidence}. Likely, most likely "
                   f"first: {numbered}")
        fix = finding.causes[0].partition(" → ")[2] if finding.causes else ""
        fired.append(Alert(check, step, message, action, finding.evidence,
                           list(finding.causes), fix, finding.best_step))

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
        lr = ctx.lr if ctx.lr is not None else m.get(names.LR)
        zero_var = [m[k] for k in names.TASK_ZERO_VAR_FRAC.keys(m)]
        signal = not zero_var or min(zero_var) < 1.0  # some group has non-zero advantages
        kl, update = m.get(names.KL), m.get(names.UPDATE_NORM)
        name = "update norm" if update is not None else "grad norm"
        size = update if update is not None else m.get(names.GRAD_NORM)
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

    def _task_stalled(self, step: int, m: Mapping[str, Any], ctx: StepContext,
                      fired: list[Alert]) -> None:
        cfg = self.config.task_stalled
        now = EvalRegression.scores(m)
        for task, (score, _, _) in now.items():
            self._scores.setdefault(task, []).append(score)
        span = cfg.patience + 1  # the evals compared: this one and `patience` before it
        lag = min(cfg.lag, cfg.patience)  # the other task had risen by `lag` evals ago
        rising = {t: s[-1 - lag] - s[-span] for t, s in self._scores.items() if len(s) >= span}
        for task in sorted(now):
            scores, start = self._scores[task][-span:], self._scores[task][0]
            # not moved, and not above where it started: a task that learned and then
            # levelled off (or sits at the top of its scale) has converged, not stalled
            flat = len(scores) == span and max(scores) - min(scores) <= cfg.min_delta \
                and scores[-1] < start + cfg.min_rise
            others = {t: r for t, r in rising.items() if t != task and r >= cfg.min_rise}
            # once per stall (the patience is the span of evals): re-armed when it moves
            if self._count("task_stalled", task, flat and bool(others)) != 1:
                continue
            other = max(others, key=others.get)
            rise = self._scores[other][-1] - self._scores[other][-span]  # up to now
            kl = m.get(names.TASK_KL.of(task))
            self._fire("task_stalled", step, (
                f"task {task}: eval score {scores[-1]:.3f} has not moved by more than "
                f"{cfg.min_delta:g} over the last {span} evals while {other} rose by {rise:.3f}"
                + (f" (its KL {kl:.3f})" if _finite(kl) else "") + ". Likely: β holds it at the "
                "reference (its KL budget is below what learning it needs), its reward gives no "
                "signal (every completion of a group scores the same), or the other task takes "
                "the batch. Try: widen its KL band or lower its β, check its "
                "reward/*/zero_var_frac, raise its share (tasks.NAME.weight)"), fired)

    def _kl_out_of_band(self, step: int, m: Mapping[str, Any], ctx: StepContext,
                        fired: list[Alert]) -> None:
        cfg = self.config.kl_out_of_band
        for task, (low, high) in sorted(ctx.kl_bands.items()):
            value = m.get(names.TASK_KL.of(task))
            if not _finite(value):
                continue
            key = f"kl_out_of_band:{task}"
            window = [*self._push(key, value, cfg.window), value][-cfg.window:]
            above = sum(v > high * cfg.factor for v in window)
            below = sum(v < low / cfg.factor for v in window)
            far = len(window) == cfg.window and max(above, below) >= cfg.fraction * cfg.window
            if not self._held("kl_out_of_band", task, far):
                continue
            where = (f"above {cfg.factor:g} × its high {high:g}" if above >= below else
                     f"below its low {low:g} / {cfg.factor:g}")
            beta = m.get(names.TASK_BETA.of(task))
            self._fire("kl_out_of_band", step, (
                f"task {task}: KL {where} in {max(above, below)} of the last {cfg.window} steps "
                f"(median {statistics.median(window):.3f}, band {low:g}–{high:g}"
                + (f", β {beta:.4g}" if _finite(beta) else "") + "). Likely: β cannot move far "
                "enough (kind `band` moves it by a few % per update, or it sits at beta_min / "
                "beta_max), or the band is not the KL this task needs to learn. Try: kind `dual` "
                "(the default with a band), widen beta_min / beta_max, or set the band to the "
                "KL the task reaches when it learns"), fired)

    def _kl_explosion(self, step: int, m: Mapping[str, Any], ctx: StepContext,
                      fired: list[Alert]) -> None:
        cfg = self.config.kl_explosion
        for key in [names.KL, *names.TASK_KL.keys(m)]:
            value = m.get(key)
            if not _finite(value):
                continue
            budget = (max(ctx.kl_budgets.values(), default=0.0) if key == names.KL
                      else ctx.kl_budgets.get(names.task_of(key), 0.0))
            ceiling = max(cfg.ceiling, cfg.budget_factor * budget)
            before = self._push(key, value, max(cfg.window, cfg.smooth))
            level = statistics.median([*before, value][-cfg.smooth:])
            full = len(before) >= cfg.window - 1
            base = statistics.median(before[: len(before) // 2]) if full else math.inf
            # with a budget, the controller owns KL's course: only the ceiling applies
            growing = (not budget and full and level >= cfg.min_kl
                       and level > cfg.growth_factor * base
                       and not (names.task_of(key) in self._kl_told
                                or (key == names.KL and self._kl_told)))
            if not self._held("kl_explosion", key, level > ceiling or growing):
                continue
            how = (f"above the ceiling {ceiling:g}" if level > ceiling else
                   f"{level / base:.1f}× its earlier median {base:.3f}")
            n = min(cfg.smooth, len(before) + 1)
            mean = f" (median of the last {n} steps)" if n > 1 else ""
            self._fire("kl_explosion", step, (
                f"{'' if key == names.KL else f'task {names.task_of(key)} '}KL {level:.3f}{mean} is {how} "
                f"for {cfg.patience} steps. Likely: β too small for the learning rate, an unstable "
                "KL estimator (k1/k2 or a clamped log-ratio), log-probs at another temperature "
                "than sampling, or a reference that is not the starting model. Try: raise this "
                "task's beta or kl.kind: band, a lower train.learning_rate, "
                "algorithm.kl_estimator: k3"), fired)

    def _reward_regression(self, step: int, m: Mapping[str, Any], ctx: StepContext,
                           fired: list[Alert]) -> None:
        lr = ctx.learning_rate or (ctx.lr if ctx.lr is not None else m.get(names.LR))
        falling: set[str] = set()
        seen = self.reward_regression.observe(step, m)
        for key, (task, objective) in sorted(seen.items()):
            beta = m.get(names.TASK_BETA.of(task))
            facts = RunFacts(lr=lr if _finite(lr) else None, full_finetune=ctx.full_finetune,
                             fixed_beta=task not in ctx.kl_budgets,
                             beta=beta if _finite(beta) else None)
            finding = self.reward_regression.test(task, objective, facts)
            if finding is not None:
                falling.add(task)
            if self._held("reward_regression", key, finding is not None):
                self._fire_finding("reward_regression", step, finding, fired)
                if finding.kl_grew and task not in self._kl_told:
                    self._kl_told.append(task)
        # while a task's reward keeps falling, its KL growth has been said: kl_explosion's
        # growth test stays quiet for it (one alert with both signals, not two)
        tasks = {task for task, _ in seen.values()}
        self._kl_told = [t for t in self._kl_told if t in falling or t not in tasks]

    def _eval_regression(self, step: int, m: Mapping[str, Any], ctx: StepContext,
                         fired: list[Alert]) -> None:
        cfg = self.config.eval_regression
        for task, finding in sorted(self.eval_regression.observe(step, m).items()):
            if not self._held("eval_regression", task, finding is not None):
                continue
            action = cfg.action
            if action == "rollback" and self.rollbacks >= cfg.max_rollbacks:
                action = "stop"
                finding.causes.append(f"{self.rollbacks} rollback(s) did not help "
                                      "(health.eval_regression.max_rollbacks) → the run stops")
            self._fire_finding("eval_regression", step, finding, fired, action)

    def _length_collapse(self, step: int, m: Mapping[str, Any], ctx: StepContext,
                         fired: list[Alert]) -> None:
        cfg = self.config.length_collapse
        for key in [names.COMPLETION_LENGTH, *names.TASK_COMPLETION_LENGTH.keys(m)]:
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
                f"{names.task_of(key)}: mean completion length {value:.1f} tokens (floor {cfg.floor:g}"
                f"{recent}) for {cfg.patience} steps. Likely: a reward that pays for short "
                "answers (length penalty, a format reward met by one token), an end-of-turn "
                "token sampled first (chat template or stop_token_ids mismatch), or a collapsed "
                "policy. Try: check the rendered prompts and stop ids, lower the length "
                "reward's weight, raise β"), fired)

    def _truncation(self, step: int, m: Mapping[str, Any], ctx: StepContext,
                    fired: list[Alert]) -> None:
        cfg, value = self.config.truncation, m.get(names.TRUNCATED_FRAC)
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
        for key in names.TASK_ZERO_VAR_FRAC.keys(m):
            value, task = m[key], names.task_of(key)
            if not self._held("no_signal", key, _finite(value) and value > cfg.threshold):
                continue
            reward = m.get(names.TASK_REWARD.of(task))
            mean = f" (reward mean {reward:.3f})" if _finite(reward) else ""
            self._fire("no_signal", step, (
                f"task {task}: {value:.0%} of groups score all K completions the same{mean} for "
                f"{cfg.patience} steps: no advantage, no gradient. Likely: the task is too easy "
                "(all pass) or too hard (all fail) for the model, or K is small. Try: more "
                "completions per prompt (rollout.num_generations), a graded reward with partial "
                "credit, algorithm.dynamic_sampling: true, or easier/harder prompts"), fired)

    def _non_finite(self, step: int, m: Mapping[str, Any], ctx: StepContext,
                    fired: list[Alert]) -> None:
        bad = [k for k in (names.LOSS, names.GRAD_NORM, names.KL) if k in m and not _finite(m[k])]
        scale = m.get(names.LOSS_SCALE)
        if _finite(scale) and scale >= 1 and names.GRAD_NORM in bad:
            # fp16-mixed: gradients that overflowed at the loss scale; the scaler skipped the
            # update and halved the scale, as it is meant to (below 1, even the unscaled
            # gradients overflow: that is real)
            bad.remove(names.GRAD_NORM)
        bad += [k for k in (names.NONFINITE_LOGITS,) if _finite(m.get(k)) and m[k] > 0]
        skipped = m.get(names.SKIPPED_UPDATES)  # cumulative in the trainer
        if _finite(skipped) and skipped > self._skipped:
            bad.append(names.SKIPPED_UPDATES)
            self._skipped = float(skipped)
        if not bad:
            return
        self._nonfinite += 1  # bad steps need not be consecutive
        if self._nonfinite == self.config.non_finite.patience:
            self._fire("non_finite", step, (
                f"NaN/inf on {self._nonfinite} steps, now in {', '.join(bad)}. Likely: float16 "
                "overflow, a learning rate too high, -inf log-probs of masked tokens reaching "
                "the loss, or a reward returning NaN/inf. Try: model.precision bf16-mixed, a lower "
                "train.learning_rate, rewards that return a finite number or None"), fired)

    def _grad_spike(self, step: int, m: Mapping[str, Any], ctx: StepContext,
                    fired: list[Alert]) -> None:
        cfg, value = self.config.grad_spike, m.get(names.GRAD_NORM)
        if not _finite(value):
            return
        before = self._push(names.GRAD_NORM, value, cfg.window + 1)
        median = statistics.median(before) if len(before) >= cfg.min_history else 0.0
        spike = len(before) >= cfg.min_history and value > cfg.factor * max(median, 1e-12)
        if spike and ctx.max_grad_norm is not None and \
                min(value, ctx.max_grad_norm) <= cfg.contained * median:
            spike = False  # clipped to a few typical norms: the optimizer saw no spike
        if self._count("grad_spike", "policy", spike) < cfg.patience:
            return
        # clipping contains a lone spike: the alert waits for `repeats` within the window
        self._spikes = [s for s in self._spikes if s > step - cfg.window] + [step]
        if len(self._spikes) == cfg.repeats:
            earlier = ", ".join(str(s) for s in self._spikes[:-1])
            self._fire("grad_spike", step, (
                f"grad norm {value:.3g} is {value / max(median, 1e-12):.0f}× its running median "
                f"{median:.3g} ({len(before)} steps)"
                + (f", after spikes at steps {earlier}" if earlier else "") + ". Likely: a group "
                "with a tiny reward std "
                "(huge advantages), one long completion dominating the loss, or an outlier "
                "reward; clipping contains one spike, repeated spikes precede divergence. Try: a "
                "lower train.learning_rate, algorithm.advantage_scaling: batch, check the "
                "reward scale"), fired)

    def _sampling_ignored(self, step: int, m: Mapping[str, Any], ctx: StepContext,
                          fired: list[Alert]) -> None:
        cfg, t = self.config.sampling_ignored, ctx.temperature
        entropy, same = m.get(names.ENTROPY), m.get(names.IDENTICAL_GROUP_FRAC)
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
        for key in names.TASK_REWARD.keys(m):
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
                    f"task {names.task_of(key)}: reward mean (smoothed over {cfg.smooth} steps) "
                    f"{smoothed:.3f} has not beaten its best {best_value:.3f} (step "
                    f"{best_step:.0f}) by {cfg.min_delta:g} for {cfg.patience} steps. Likely: the "
                    "task has converged or its reward is saturated, β holds the policy at the "
                    "reference, or the learning rate is too low. Try: compare the eval scores; "
                    "if it is a plateau, stop or move the curriculum on, else lower β or raise "
                    "the learning rate"), fired)

    # ---------------------------------------------------------------- reporting and state

    def summary(self) -> str:
        """Every alert of the run, for the end-of-run log: its step and check, what was seen,
        the likely causes and the fix to try first; says so when the checks were off (no alert
        then means nothing was watched, not a healthy run)."""
        if not self.config.enabled:
            return "health: checks were off (health.enabled: false); no step was watched"
        off = [name for name in CHECKS if not getattr(self.config, name).enabled]
        if len(off) == len(CHECKS):
            return "health: every check was off (health.CHECK.enabled: false); no step was watched"
        unwatched = f" (checks off: {', '.join(off)})" if off else ""
        if not self.alerts:
            return f"health: no alerts in {self._steps} steps{unwatched}"
        lines = [f"health: {len(self.alerts)} alert(s) in {self._steps} steps{unwatched}"]
        for a in self.alerts:
            lines.append(f"  step {a.step} {a.check} ({a.action}): {a.evidence or a.message}")
            lines += [f"    likely: {c}" for c in a.causes]
            if a.fix:
                lines.append(f"    fix: {a.fix}")
        if self.rollbacks:
            lines.append(f"  {self.rollbacks} rollback(s) to the best checkpoint")
        return "\n".join(lines)

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe state: counters, histories, best rewards and the alerts so far."""
        return {"alerts": [asdict(a) for a in self.alerts], "streak": dict(self._streak),
                "spikes": list(self._spikes),
                "history": {k: list(v) for k, v in self._history.items()},
                "best": {k: list(v) for k, v in self._best.items()},
                "nonfinite": self._nonfinite, "skipped": self._skipped, "steps": self._steps,
                "rollbacks": self.rollbacks, "kl_told": list(self._kl_told),
                "scores": {k: list(v) for k, v in self._scores.items()},
                "reward_regression": self.reward_regression.state_dict(),
                "eval_regression": self.eval_regression.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.alerts = [Alert(**a) for a in state["alerts"]]
        self._streak = dict(state["streak"])
        self._spikes = list(state.get("spikes", []))  # (older states: none kept)
        self._history = {k: list(v) for k, v in state["history"].items()}
        self._best = {k: list(v) for k, v in state["best"].items()}
        self._nonfinite, self._skipped = state["nonfinite"], state["skipped"]
        self._steps = state["steps"]
        # states saved before the regression checks existed hold none of theirs
        self.rollbacks = state.get("rollbacks", 0)
        self._kl_told = list(state.get("kl_told", []))
        self._scores = {k: list(v) for k, v in state.get("scores", {}).items()}
        self.reward_regression.load_state_dict(state.get("reward_regression", {}))
        self.eval_regression.load_state_dict(state.get("eval_regression", {}))
