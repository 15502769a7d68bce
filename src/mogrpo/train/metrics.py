"""Metric names and the console lines a user watches."""

from __future__ import annotations

import math

import torch

from mogrpo.algo.advantages import reward_stats


def reward_metrics(name: str, labels: list[str], weights: list[float],
                   grouped: torch.Tensor, adv: torch.Tensor) -> dict[str, float]:
    """Per objective of a task: mean, std, missing fraction, zero-variance group fraction;
    the weighted mean over objectives; the fraction of groups with no advantage signal.

    grouped: [n, K, J] rewards (NaN = could not score); adv: [n, K] advantages.
    """
    stats = reward_stats(grouped)
    out: dict[str, float] = {}
    combined = 0.0
    for j, label in enumerate(labels):
        prefix = f"task/{name}/reward/{label}"
        out[f"{prefix}/mean"] = stats["mean"][j]
        out[f"{prefix}/std"] = stats["std"][j]
        out[f"{prefix}/missing_frac"] = stats["missing_frac"][j]
        out[f"{prefix}/zero_var_frac"] = stats["zero_var_frac"][j]
        out[f"{prefix}/weight"] = weights[j]
        if not math.isnan(stats["mean"][j]):
            combined += weights[j] * stats["mean"][j]
    out[f"task/{name}/reward/mean"] = combined
    # A group whose advantages are all zero carries no learning signal.
    out[f"task/{name}/zero_var_frac"] = float((adv.abs().amax(dim=1) < 1e-8).float().mean())
    return out


def format_step(metrics: dict[str, float], tasks: list[str], total: int) -> str:
    """One console line per step: the figures a user watches."""
    parts = [f"step {metrics['step']}/{total}", f"loss {metrics['loss']:+.4f}"]
    for name in tasks:
        if f"task/{name}/reward/mean" in metrics:
            parts.append(
                f"{name}: reward {metrics[f'task/{name}/reward/mean']:.3f} "
                f"kl {metrics[f'task/{name}/kl']:.4f} beta {metrics[f'task/{name}/beta']:.4f}"
            )
    parts.append(f"len {metrics['rollout/completion_length']:.1f}")
    parts.append(f"trunc {metrics['rollout/truncated_frac']:.0%}")
    parts.append(f"{metrics['time/step_s']:.2f}s")
    return " | ".join(parts)


def _initials(tasks: list[str]) -> list[str]:
    """Short column labels: first letters, lengthened until they are unique."""
    for n in range(1, max(len(t) for t in tasks) + 1):
        short = [t[:n].upper() for t in tasks]
        if len(set(short)) == len(short):
            return short
    return tasks


def format_quick_eval(step: int | str, evals: dict[str, dict[str, float]],
                      kl: dict[str, float], beta: dict[str, float]) -> str:
    """The compact per-eval table::

        [QuickEval@20] greedy   fairness 0.452  hallucination 0.497
          truncated  F 0.0%  H 0.0%  | length  F 64.5  H 51.4
          KL         F 0.035 H 0.095 | beta    F 0.1000 H 0.3000
    """
    tasks = list(evals)
    short = dict(zip(tasks, _initials(tasks), strict=True))

    def row(values: dict[str, float], fmt: str) -> str:
        return " ".join(f"{short[t]} {format(values[t], fmt)}" if t in values and not
                        math.isnan(values[t]) else f"{short[t]} -" for t in tasks)

    scores = "  ".join(f"{t} {evals[t]['score']:.3f}" for t in tasks)
    truncated = row({t: evals[t]["truncated_frac"] for t in tasks}, ".1%")
    length = row({t: evals[t]["mean_length"] for t in tasks}, ".1f")
    return (
        f"[QuickEval@{step}] greedy   {scores}\n"
        f"  truncated  {truncated} | length  {length}\n"
        f"  KL         {row(kl, '.3f')} | beta    {row(beta, '.4f')}"
    )
