"""A step's reward metrics and the console line a user watches."""

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
