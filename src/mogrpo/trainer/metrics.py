"""A step's reward metrics and the console line a user watches."""

from __future__ import annotations

import torch

from mogrpo.algo.advantages import reward_stats
from mogrpo.tracking import names


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
        out[names.OBJECTIVE_MEAN.of(name, label)] = stats["mean"][j]
        out[names.OBJECTIVE_STD.of(name, label)] = stats["std"][j]
        out[names.OBJECTIVE_MISSING_FRAC.of(name, label)] = stats["missing_frac"][j]
        out[names.OBJECTIVE_ZERO_VAR_FRAC.of(name, label)] = stats["zero_var_frac"][j]
        out[names.OBJECTIVE_WEIGHT.of(name, label)] = weights[j]
        # an objective that scored nothing (a judge outage) leaves the weighted mean unknown:
        # NaN, not the sum of the other objectives as if it had scored 0
        if weights[j]:
            combined += weights[j] * stats["mean"][j]
    out[names.TASK_REWARD.of(name)] = combined
    # A group whose advantages are all zero carries no learning signal.
    out[names.TASK_ZERO_VAR_FRAC.of(name)] = float((adv.abs().amax(dim=1) < 1e-8).float().mean())
    return out


def format_step(metrics: dict[str, float], tasks: list[str], total: int) -> str:
    """One console line per step: the figures a user watches."""
    parts = [f"step {metrics[names.STEP]}/{total}", f"loss {metrics[names.LOSS]:+.4f}"]
    for name in tasks:
        if names.TASK_REWARD.of(name) in metrics:
            parts.append(
                f"{name}: reward {metrics[names.TASK_REWARD.of(name)]:.3f} "
                f"kl {metrics[names.TASK_KL.of(name)]:.4f} "
                f"beta {metrics[names.TASK_BETA.of(name)]:.4f}"
            )
    parts.append(f"len {metrics[names.COMPLETION_LENGTH]:.1f}")
    parts.append(f"trunc {metrics[names.TRUNCATED_FRAC]:.0%}")
    parts.append(f"{metrics[names.TIME_STEP]:.2f}s")
    return " | ".join(parts)
