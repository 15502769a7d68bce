"""Is the run getting worse? The two regression tests of the health monitor.

`RewardRegression`: per task and objective, the sampled reward of the last `window` steps
against the best `window` consecutive steps before them (a one-sided Mann–Whitney rank test
plus a minimum effect in units of one step's noise). It also looks at the task's KL and its
other objectives over the same two windows, to name the likely cause.

`EvalRegression`: each quick-eval score against the start and the best eval so far, by more
than their sampling error (binomial on the eval size); it names the best evaluated step on the
Pareto front, the checkpoint to go back to.

Both only measure and word their findings; the monitor decides when an alert fires.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mogrpo.config.health import EvalRegressionConfig, RewardRegressionConfig
from mogrpo.eval.pareto import Point, pareto_front
from mogrpo.health.stats import StepNoise, mann_whitney_greater, score_error
from mogrpo.tracking import names

# KL growth and another objective's rise are evidence added to a reward alert that has already
# passed its own test, so a looser level suffices (p < 0.05, a rise of one step's noise): KL
# often starts to rise inside the best reward window itself, and a hacked objective rises
# about as fast as the other falls, so it is rarely as far along when the alert fires.
SECONDARY_P_VALUE = 0.05
# Learning rates above these are high for GRPO (typical: 1e-6–1e-5 full, 1e-5–1e-4 LoRA).
HIGH_LR = {"full": 1e-5, "lora": 2e-4}


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _steps(rows: list[list[Any]]) -> str:
    return f"steps {rows[0][0]}–{rows[-1][0]}"


@dataclass
class Finding:
    """What an alert says: the evidence, then the likely causes (each with its fix), most
    likely first."""

    evidence: str
    causes: list[str] = field(default_factory=list)
    best_step: int | None = None
    kl_grew: bool = False


@dataclass
class RunFacts:
    """The run's settings a cause is judged and a fix is worded with."""

    lr: float | None = None
    full_finetune: bool | None = None
    fixed_beta: bool = True
    beta: float | None = None


class RewardRegression:
    """Keeps, per task, the last 2 × window rows (step, each objective's mean, KL) and, per
    objective, the best window so far; JSON state."""

    def __init__(self, config: RewardRegressionConfig) -> None:
        self.config = config
        self.rows: dict[str, list[list[Any]]] = {}  # task -> [[step, {objective: mean}, kl]]
        self.best: dict[str, list[Any]] = {}  # "task/objective" -> [mean, rows of the window]
        self.first: dict[str, list[Any]] = {}  # "task/objective" -> [mean, rows]: the start
        self.noise: dict[str, StepNoise] = {}  # "task/objective" -> one step's noise
        self.weights: dict[str, float] = {}  # "task/objective" -> its latest weight

    def observe(self, step: int, metrics: Mapping[str, Any]) -> dict[str, tuple[str, str]]:
        """Record this step; returns {"task/objective": (task, objective)} of the objectives
        seen, whose test `test` may then be asked for."""
        seen: dict[str, tuple[str, str]] = {}
        per_task: dict[str, dict[str, float]] = {}
        for key, value in metrics.items():
            if names.OBJECTIVE_MEAN.matches(key) and _finite(value):
                parts = key.split("/")
                key = f"{parts[1]}/{parts[3]}"
                per_task.setdefault(parts[1], {})[parts[3]] = float(value)
                seen[key] = (parts[1], parts[3])
                self.noise.setdefault(key, StepNoise()).add(float(value))
                weight = metrics.get(names.OBJECTIVE_WEIGHT.of(parts[1], parts[3]))
                self.weights[key] = abs(float(weight)) if _finite(weight) else 1.0
        w = self.config.window
        for task, values in per_task.items():
            kl = metrics.get(names.TASK_KL.of(task))
            rows = self.rows.setdefault(task, [])
            rows.append([step, values, float(kl) if _finite(kl) else None])
            del rows[:-2 * w]
            if len(rows) == 2 * w:  # the window just before the recent one may be the best
                candidate = rows[:w]
                for objective in values:
                    vals = [r[1][objective] for r in candidate if objective in r[1]]
                    key = f"{task}/{objective}"
                    if len(vals) <= w // 2:
                        continue
                    window = [statistics.fmean(vals), [list(r) for r in candidate]]
                    self.first.setdefault(key, window)
                    if key not in self.best or window[0] > self.best[key][0]:
                        self.best[key] = window
        return seen

    def test(self, task: str, objective: str, facts: RunFacts) -> Finding | None:
        """The finding when the objective's recent window is below its first window, or below
        its best window by the larger `best_effect`."""
        cfg, key = self.config, f"{task}/{objective}"
        rows = self.rows.get(task, [])
        if len(rows) < 2 * cfg.window or key not in self.best:
            return None
        recent_rows = rows[-cfg.window:]
        recent = [r[1][objective] for r in recent_rows if objective in r[1]]
        if len(recent) <= cfg.window // 2:
            return None
        noise = self.noise[key].sigma
        for name, effect in (("first", cfg.min_effect), ("best", cfg.best_effect)):
            ref_rows = (self.first if name == "first" else self.best)[key][1]
            ref = [r[1][objective] for r in ref_rows if objective in r[1]]
            drop = statistics.fmean(ref) - statistics.fmean(recent)
            p = mann_whitney_greater(ref, recent)
            # min_drop is in the task's reward: a 0.1-weight bonus dipping 0.3 moves it 0.03
            if p < cfg.p_value and drop >= effect * noise \
                    and self.weights[key] * drop >= cfg.min_drop:
                break
        else:
            return None
        which = "the run's first window" if name == "first" else "its best window"
        evidence = (f"task {task}, objective {objective}: mean reward {statistics.fmean(recent):.3f}"
                    f" over {_steps(recent_rows)}, down from {statistics.fmean(ref):.3f} over "
                    f"{_steps(ref_rows)} ({which}; Mann–Whitney p = {p:.1g}, drop "
                    f"{drop:.3f} = {drop / noise if noise else math.inf:.1f}× one step's noise "
                    f"{noise:.3f})")
        kl = self._kl_growth(ref_rows, recent_rows) if facts.fixed_beta else None
        if kl:
            evidence += f", while {kl}"
        risen = self._risen(task, objective, ref_rows, recent_rows)
        return Finding(evidence, _reward_causes(task, objective, facts, kl, risen),
                       kl_grew=kl is not None)

    def _kl_growth(self, ref_rows: list[list[Any]], recent_rows: list[list[Any]]) -> str | None:
        """'KL rose from a to b (×r)' when the task's KL grew between the two windows."""
        cfg = self.config
        before = [r[2] for r in ref_rows if r[2] is not None]
        after = [r[2] for r in recent_rows if r[2] is not None]
        if len(before) < 2 or len(after) < 2:
            return None
        a, b = statistics.median(before), statistics.median(after)
        if b < cfg.min_kl or b < cfg.kl_growth * a or mann_whitney_greater(after, before) >= SECONDARY_P_VALUE:
            return None
        ratio = f"{b / a:.1f}×" if a > 0 else "from 0"
        return f"KL rose from {a:.3f} to {b:.3f} ({ratio}, medians of the same windows)"

    def _risen(self, task: str, objective: str, ref_rows: list[list[Any]],
               recent_rows: list[list[Any]]) -> list[str]:
        """Other objectives of the task that rose significantly over the same two windows."""
        cfg, out = self.config, []
        others = sorted({o for r in recent_rows for o in r[1]} - {objective})
        for other in others:
            before = [r[1][other] for r in ref_rows if other in r[1]]
            after = [r[1][other] for r in recent_rows if other in r[1]]
            if len(before) < 2 or len(after) < 2:
                continue
            noise = self.noise[f"{task}/{other}"].sigma
            gain = statistics.fmean(after) - statistics.fmean(before)
            if gain >= max(cfg.min_drop, noise) \
                    and mann_whitney_greater(after, before) < SECONDARY_P_VALUE:
                out.append(f"{other} {statistics.fmean(before):.3f} → {statistics.fmean(after):.3f}")
        return out

    def reset(self) -> None:
        """Forget every window (after a rollback the weights are another run's)."""
        self.rows.clear()
        self.best.clear()
        self.first.clear()
        self.noise.clear()
        self.weights.clear()

    def state_dict(self) -> dict[str, Any]:
        return {"rows": self.rows, "best": self.best, "first": self.first,
                "noise": {k: v.state() for k, v in self.noise.items()},
                "weights": dict(self.weights)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.rows = {k: [list(r) for r in v] for k, v in state.get("rows", {}).items()}
        self.best = {k: list(v) for k, v in state.get("best", {}).items()}
        self.first = {k: list(v) for k, v in state.get("first", {}).items()}
        self.noise = {k: StepNoise(list(v)) for k, v in state.get("noise", {}).items()}
        self.weights = dict(state.get("weights", {}))


def _reward_causes(task: str, objective: str, facts: RunFacts, kl: str | None,
                   risen: list[str]) -> list[str]:
    """The likely causes of a falling reward, each with its fix, most likely first.

    Default order: learning rate, then β (issue 18: a learning rate too high for full
    fine-tuning is the commonest way a GRPO run is wasted). β comes first when KL grew under a
    fixed β and the learning rate is not high. Reward hacking comes first when another objective
    of the task rose over the same steps: trading one objective for another is its signature,
    while a too-large step takes every objective down.
    """
    lr, mode = facts.lr, "full" if facts.full_finetune else "lora"
    high = lr is not None and lr > HIGH_LR[mode]
    what = "full fine-tuning" if facts.full_finetune else "LoRA" \
        if facts.full_finetune is False else "this run"
    if lr is not None:
        lr_cause = (f"the learning rate {lr:.2g} is {'too high' if high else 'perhaps too high'} "
                    f"for {what} (GRPO usually runs at 1e-6–1e-5 with full fine-tuning, "
                    f"1e-5–1e-4 with LoRA) → set train.learning_rate: {lr / 10:.2g} (÷10)")
    else:
        lr_cause = "the learning rate may be too high → divide train.learning_rate by 10"
    beta = facts.beta
    if not facts.fixed_beta:
        beta_cause = (f"the KL budget of task {task} lets the policy drift too far → lower "
                      f"tasks.{task}.kl.high (or kl.target)")
    elif beta is not None and beta <= 0:
        beta_cause = (f"task {task} has no KL penalty (β = 0), nothing holds the policy near the "
                      f"reference → set tasks.{task}.beta: 0.04")
    else:
        shown = f"{beta:.3g}" if beta is not None else "β"
        raised = f"{2.5 * beta:.3g}" if beta is not None else "2.5 × β"
        beta_cause = (f"β {shown} is too small for task {task}{' (its KL grew)' if kl else ''} → "
                      f"set tasks.{task}.beta: {raised}, or let a controller hold KL "
                      f"(tasks.{task}.kl.kind: band)")
    causes = [lr_cause, beta_cause]
    if kl and not high:
        causes.reverse()
    if risen:
        causes.insert(0, f"reward hacking: {', '.join(risen)} rose meanwhile, the policy trades "
                         f"{objective} for it → lower that objective's weight or make its "
                         f"reward impossible to earn without {objective}")
    return causes


class EvalRegression:
    """Every quick-eval score of the run, per task (score, eval size, std), and the steps whose
    checkpoint a rollback overwrote (no longer a place to go back to)."""

    def __init__(self, config: EvalRegressionConfig) -> None:
        self.config = config
        self.evals: dict[int, dict[str, list[float]]] = {}  # step -> task -> [score, n, std]
        self.overwritten: list[int] = []

    @staticmethod
    def scores(metrics: Mapping[str, Any]) -> dict[str, list[float]]:
        """{task: [score, n, std]} from the `eval/TASK/...` metrics of one eval."""
        out: dict[str, list[float]] = {}
        for key, value in metrics.items():
            parts = key.split("/")
            if len(parts) == 3 and key == names.eval_metric(parts[1], "score") and _finite(value):
                n = metrics.get(names.eval_metric(parts[1], "num_samples"))
                std = metrics.get(names.eval_metric(parts[1], "score_std"))
                out[parts[1]] = [float(value), float(n) if _finite(n) else math.nan,
                                 float(std) if _finite(std) else math.nan]
        return out

    def observe(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Finding | None]:
        """Record this eval (if the metrics hold one); per task, the finding or None."""
        now = self.scores(metrics)
        if not now:
            return {}
        earlier = {s: e for s, e in self.evals.items() if s < step}
        self.evals[step] = now
        return {task: self._test(task, step, score, earlier) for task, score in now.items()}

    def _test(self, task: str, step: int, now: list[float],
              earlier: dict[int, dict[str, list[float]]]) -> Finding | None:
        cfg = self.config
        history = sorted((s, e[task]) for s, e in earlier.items() if task in e)
        if not history:
            return None
        (s0, start), (sb, best) = history[0], max(history, key=lambda h: (h[1][0], -h[0]))
        err = score_error(now[0], int(now[1]) if _finite(now[1]) else 0,
                          now[2] if _finite(now[2]) else None)

        def margin(ref: list[float]) -> float:
            ref_err = score_error(ref[0], int(ref[1]) if _finite(ref[1]) else 0,
                                  ref[2] if _finite(ref[2]) else None)
            return cfg.z * math.sqrt(err**2 + ref_err**2)

        n = f"n = {now[1]:.0f}" if _finite(now[1]) else "eval size unknown"
        if start[0] - now[0] > max(cfg.min_drop, margin(start)):
            evidence = (f"task {task}: eval score {now[0]:.3f} at step {step} is below the start "
                        f"{start[0]:.3f} (step {s0}) by {start[0] - now[0]:.3f}, more than its "
                        f"sampling error allows ({cfg.z:g} × SE = {margin(start):.3f}, {n})")
        elif best[0] - now[0] > max(cfg.best_margin, margin(best)):
            evidence = (f"task {task}: eval score {now[0]:.3f} at step {step} is below the best "
                        f"so far {best[0]:.3f} (step {sb}) by {best[0] - now[0]:.3f} (margin "
                        f"{max(cfg.best_margin, margin(best)):.3f}, {n})")
        else:
            return None
        target = self.best_on_front(step)
        where = (f"best on the Pareto front: step {target}" +
                 (" (the model GRPO started from)" if target == min(self.evals) else ""))
        return Finding(f"{evidence}; {where}", [
            "the policy got worse while training (learning rate too high, β too small, or a "
            "reward the policy exploits; see the reward_regression alerts) → go back to step "
            f"{target} (health.eval_regression.action: rollback does it with a lower learning "
            "rate), then lower train.learning_rate or raise β"], best_step=target)

    def best_on_front(self, before: int | None = None) -> int | None:
        """The evaluated step to go back to: on the Pareto front of every eval so far, the one
        with the highest mean score over tasks (ties: the earliest); steps whose checkpoint a
        rollback overwrote are skipped."""
        points = [Point(f"step-{s}", s, {t: v[0] for t, v in e.items()})
                  for s, e in sorted(self.evals.items())
                  if s not in self.overwritten and (before is None or s <= before)]
        front = pareto_front(points)
        if not front:
            return None
        return max(front, key=lambda p: (statistics.fmean(p.scores.values()), -p.step)).step

    def state_dict(self) -> dict[str, Any]:
        return {"evals": {str(s): e for s, e in self.evals.items()},
                "overwritten": list(self.overwritten)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.evals = {int(s): {t: list(v) for t, v in e.items()}
                      for s, e in state.get("evals", {}).items()}
        self.overwritten = list(state.get("overwritten", []))
