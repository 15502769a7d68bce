"""Group-relative advantages from multi-objective rewards, and reward statistics.

Rewards arrive as [N, K, J]: N prompts, K completions per prompt, J objectives. NaN marks a
reward function that could not score a completion (it returned None); such entries are
excluded per objective, never read as 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from mogrpo.algo.choices import COMBINE_MODES, SCALE_MODES
from mogrpo.errors import ConfigError


def _check_choice(field: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{field}={value!r} is not supported; choose one of {list(choices)}")


def _impute_missing(rewards: Tensor) -> Tensor:
    """Replace each NaN by the mean of its objective over the scored completions of its group.

    The imputed entry then sits exactly at the group mean, so it gets zero advantage on that
    objective. A (group, objective) with nothing scored becomes all zeros: a constant column,
    which centring removes, so that objective contributes nothing to the group.
    """
    scored = ~torch.isnan(rewards)  # [N, K, J]
    count = scored.sum(dim=1, keepdim=True)  # [N, 1, J]
    total = torch.where(scored, rewards, 0.0).sum(dim=1, keepdim=True)  # [N, 1, J]
    mean = total / count.clamp(min=1)  # [N, 1, J]; 0 where nothing was scored
    return torch.where(scored, rewards, mean)  # [N, K, J]


def _center_and_scale(values: Tensor, scale: str, eps: float) -> Tensor:
    """Subtract the group mean (dim 1) and divide by the chosen std; values [N, K, ...].

    Standard deviations are sample std (unbiased, ddof=1), as in TRL's GRPOTrainer.
    """
    centred = values - values.mean(dim=1, keepdim=True)
    if scale == "group":
        return centred / (values.std(dim=1, keepdim=True) + eps)
    if scale == "batch":
        return centred / (centred.std(dim=(0, 1), keepdim=True) + eps)
    return centred


def group_advantages(
    rewards: Tensor,
    weights: Tensor | Sequence[float],
    *,
    combine: str = "sum_then_normalize",
    scale: str = "group",
    eps: float = 1e-4,
) -> Tensor:
    """Per-completion advantages from rewards [N, K, J] -> [N, K] float32.

    Missing rewards (NaN) are handled per objective: a completion that one reward function
    could not score keeps its advantage from the others (see ``_impute_missing``).

    combine:
      - ``"sum_then_normalize"``: weighted sum of objectives, then group-normalise once
        (GRPO, DeepSeekMath arXiv 2402.03300).
      - ``"normalize_then_sum"``: group-normalise each objective on its own, then take the
        weighted sum, so an objective on a 0-100 scale cannot drown one on 0-1
        (MO-GRPO, arXiv 2509.22047; also GDPO).
    scale (applied per objective under ``normalize_then_sum``):
      - ``"group"``: divide by the group's std + eps (GRPO).
      - ``"batch"``: group mean, but divide by the std of the centred values over the whole
        batch + eps ("Lite PPO", Tricks or Traps? arXiv 2508.08221).
      - ``"none"``: centre only, no std division (Dr. GRPO, arXiv 2503.20783).
    All std are sample std (unbiased, ddof=1), as in TRL's GRPOTrainer, hence K >= 2.
    """
    _check_choice("combine", combine, COMBINE_MODES)
    _check_choice("scale", scale, SCALE_MODES)
    if rewards.ndim != 3:
        raise ValueError(f"rewards must be [N, K, J], got shape {tuple(rewards.shape)}")
    N, K, J = rewards.shape
    if K < 2:
        raise ConfigError(
            f"group advantages need at least 2 completions per prompt (K={K}): the group std "
            "is undefined for K=1 and every centred advantage would be 0; set K >= 2"
        )
    w = torch.as_tensor(weights, dtype=torch.float32, device=rewards.device).flatten()  # [J]
    if w.numel() != J:
        raise ConfigError(
            f"got {w.numel()} objective weights for {J} objectives; give one per objective"
        )
    if not torch.isfinite(w).all():
        raise ConfigError(f"objective weights must be finite, got {w.tolist()}")

    r = _impute_missing(rewards.to(torch.float32))  # [N, K, J]
    if combine == "sum_then_normalize":
        adv = _center_and_scale((r * w).sum(dim=-1), scale, eps)  # [N, K]
    else:
        adv = (_center_and_scale(r, scale, eps) * w).sum(dim=-1)  # [N, K]
    return adv


def zero_variance_fraction(values: Tensor) -> float:
    """Fraction of groups whose scored values are all equal or that have < 2 scored values.

    values [N, K], NaN ignored. Such groups yield zero advantage and hence no learning
    signal (the reason DAPO, arXiv 2503.14476, filters them with dynamic sampling).
    """
    if values.shape[0] == 0:
        return 0.0
    scored = ~torch.isnan(values)  # [N, K]
    hi = torch.where(scored, values, -math.inf).amax(dim=1)  # [N]
    lo = torch.where(scored, values, math.inf).amin(dim=1)  # [N]
    flat = (scored.sum(dim=1) < 2) | (hi == lo)  # [N]
    return flat.float().mean().item()


def reward_stats(rewards: Tensor) -> dict[str, list[float]]:
    """Per-objective statistics of rewards [N, K, J] for logging.

    Keys ``"mean"``, ``"std"`` (sample std over scored entries; NaN when fewer than two
    were scored, ``mean`` NaN when none), ``"missing_frac"`` and ``"zero_var_frac"``
    (:func:`zero_variance_fraction` of that objective), each a list of J floats.
    """
    stats: dict[str, list[float]] = {"mean": [], "std": [], "missing_frac": [], "zero_var_frac": []}
    for j in range(rewards.shape[-1]):
        col = rewards[..., j].to(torch.float32)  # [N, K]
        scored = col[~torch.isnan(col)]
        n = scored.numel()
        stats["mean"].append(scored.mean().item() if n >= 1 else math.nan)
        stats["std"].append(scored.std().item() if n >= 2 else math.nan)
        stats["missing_frac"].append(1.0 - n / col.numel() if col.numel() else 0.0)
        stats["zero_var_frac"].append(zero_variance_fraction(col))
    return stats
