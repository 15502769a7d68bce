"""The per-token policy terms of every GRPO loss variant TRL 1.16 ships, as pure functions.

Each takes the importance weights (token level `[B, T]` or sequence level `[B, 1]`, see
:func:`importance_weights`) and advantages `[B, 1]` and returns the per-token loss before
masking and aggregation (that is `mogrpo.algo.loss`). Papers:

- ``grpo`` / ``bnpo`` / ``dr_grpo`` / ``dapo`` / ``luspo``: the PPO clipped surrogate
  (DeepSeekMath, arXiv 2402.03300), optionally two-sided (``delta``, INTELLECT-2,
  arXiv 2505.07291); they differ only in aggregation;
- ``cispo``: clipped importance-sampling weight times the log-prob (MiniMax-M1,
  arXiv 2506.13585; ε_max as in ScaleRL, arXiv 2510.13786);
- ``sapo``: a soft sigmoid gate instead of the hard clip (arXiv 2511.20347);
- ``vespo``: a Gamma weighting of the sequence-level ratio (arXiv 2602.10693);
- sequence-level importance weights: GSPO (arXiv 2507.18071).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mogrpo.algo.choices import IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES
from mogrpo.errors import ConfigError

CLIPPED_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
# Each loss type's own aggregation (as TRL aggregates it); see mogrpo.algo.loss.
DEFAULT_AGGREGATION = {
    "grpo": "seq_mean", "sapo": "seq_mean",
    "bnpo": "micro_token_mean",
    "dr_grpo": "fixed_length",
    "dapo": "token_mean", "cispo": "token_mean", "vespo": "token_mean",
    "luspo": "seq_sum",
}
_LOG_EPS = math.log(1e-8)  # VESPO's lower clamp of log w (its reference implementation's)


def resolve_aggregation(loss_type: str, aggregation: str | None) -> str:
    """The aggregation a run uses: the one configured, else the loss type's own."""
    return aggregation or DEFAULT_AGGREGATION[loss_type]


@dataclass(frozen=True)
class LossVariant:
    """Which policy term `grpo_loss` uses, with its parameters (defaults as in TRL 1.16)."""

    loss_type: str = "grpo"
    importance_sampling_level: str = "token"
    delta: float | None = None
    cispo_max_ratio: float = 5.0
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ConfigError(
                f"loss_type={self.loss_type!r} is not supported; choose one of {list(LOSS_TYPES)}")
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ConfigError(
                f"importance_sampling_level={self.importance_sampling_level!r} is not supported; "
                f"choose one of {list(IMPORTANCE_SAMPLING_LEVELS)}")

    @classmethod
    def from_config(cls, algorithm: Any) -> LossVariant:
        """The variant an `AlgorithmConfig` asks for."""
        return cls(**{name: getattr(algorithm, name) for name in cls.__dataclass_fields__})


def importance_weights(logp: Tensor, old_logp: Tensor, mask: Tensor, level: str = "token"
                       ) -> tuple[Tensor, Tensor]:
    """(log w, w) with w = π/π_old per token `[B, T]`, or per sequence `[B, 1]` as the
    exponential of the mean token log-ratio (GSPO, arXiv 2507.18071)."""
    log_ratio = logp - old_logp  # [B, T]
    if level == "token":
        log_w = log_ratio
    elif level == "sequence":
        maskf = mask.to(log_ratio.dtype)
        log_w = ((log_ratio * maskf).sum(-1) / maskf.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    else:
        raise ConfigError(f"importance_sampling_level={level!r} is not supported; choose one of "
                          f"{list(IMPORTANCE_SAMPLING_LEVELS)}")
    return log_w, torch.exp(log_w)


def clipped_surrogate(w: Tensor, adv: Tensor, epsilon_low: float, epsilon_high: float,
                      delta: float | None = None) -> tuple[Tensor, Tensor]:
    """PPO/GRPO: ``-min(w A, clip(w, 1-ε_low, 1+ε_high) A)``; with ``delta`` the unclipped
    ratio is also capped at delta (two-sided clipping, INTELLECT-2). Returns (loss, clipped)
    where `clipped` marks the tokens whose gradient the clip removed."""
    clipped_w = w.clamp(1.0 - epsilon_low, 1.0 + epsilon_high)
    capped = w.clamp(max=delta) if delta is not None else w
    loss = -torch.minimum(capped * adv, clipped_w * adv)
    with torch.no_grad():
        clipped = ((w < 1.0 - epsilon_low) & (adv < 0)) | ((w > 1.0 + epsilon_high) & (adv > 0))
    return loss, clipped


def cispo_surrogate(w: Tensor, adv: Tensor, logp: Tensor, max_ratio: float
                    ) -> tuple[Tensor, Tensor]:
    """CISPO: ``-sg(min(w, ε_max)) A log π`` — the weight is clipped and detached, so every
    token keeps a gradient (MiniMax-M1, arXiv 2506.13585)."""
    loss = -w.clamp(max=max_ratio).detach() * adv * logp
    with torch.no_grad():
        clipped = (w > max_ratio) & (adv > 0)
    return loss, clipped


def sapo_surrogate(w: Tensor, adv: Tensor, temperature_pos: float, temperature_neg: float
                   ) -> Tensor:
    """SAPO: ``-σ(τ (w - 1)) · 4/τ · A`` with τ = τ_pos where A > 0 else τ_neg: a smooth gate,
    equal to the plain ratio's gradient at w = 1 and fading off-policy (arXiv 2511.20347)."""
    tau = torch.where(adv > 0, temperature_pos, temperature_neg)
    return -torch.sigmoid(tau * (w - 1.0)) * 4.0 / tau * adv


@torch.no_grad()
def gamma_weights(adv: Tensor, log_ratio: Tensor, mask: Tensor, *, k_pos: float,
                  lambda_pos: float, k_neg: float, lambda_neg: float) -> Tensor:
    """VESPO's φ(w) = e^λ w^k e^{-λ w} of the *sequence* ratio w = Π π/π_old, per sequence
    `[B, 1]`, k and λ by the sign of A (φ(1) = 1); a constant in the loss (no gradient)."""
    per_token = log_ratio.clamp(-20.0, 20.0) * mask.to(log_ratio.dtype)
    log_w = per_token.sum(-1, keepdim=True).clamp(_LOG_EPS, 20.0)  # [B, 1]
    nonneg = adv >= 0
    k = torch.where(nonneg, k_pos, k_neg)
    lam = torch.where(nonneg, lambda_pos, lambda_neg).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def vespo_surrogate(adv: Tensor, logp: Tensor, old_logp: Tensor, mask: Tensor,
                    variant: LossVariant) -> tuple[Tensor, Tensor]:
    """VESPO: ``-φ(w) A log π`` (arXiv 2602.10693). Returns (loss, φ per sequence)."""
    phi = gamma_weights(adv, logp - old_logp, mask, k_pos=variant.vespo_k_pos,
                        lambda_pos=variant.vespo_lambda_pos, k_neg=variant.vespo_k_neg,
                        lambda_neg=variant.vespo_lambda_neg)
    return -phi * adv * logp, phi


def policy_term(variant: LossVariant, logp: Tensor, old_logp: Tensor, adv: Tensor,
                mask: Tensor, epsilon_low: float, epsilon_high: float
                ) -> tuple[Tensor, Tensor, Tensor]:
    """(per-token policy loss `[B, T]` or `[B, 1]`, clipped-token flags, importance weight w)
    of `variant`; `adv` is `[B, 1]`."""
    _, w = importance_weights(logp, old_logp, mask, variant.importance_sampling_level)
    no_clip = torch.zeros_like(w, dtype=torch.bool)
    kind = variant.loss_type
    if kind in CLIPPED_TYPES:
        loss, clipped = clipped_surrogate(w, adv, epsilon_low, epsilon_high, variant.delta)
    elif kind == "cispo":
        loss, clipped = cispo_surrogate(w, adv, logp, variant.cispo_max_ratio)
    elif kind == "sapo":
        loss = sapo_surrogate(w, adv, variant.sapo_temperature_pos, variant.sapo_temperature_neg)
        clipped = no_clip
    else:  # vespo
        loss, _ = vespo_surrogate(adv, logp, old_logp, mask, variant)
        clipped = no_clip
    return loss, clipped, w


def mask_truncated(completion_mask: Tensor, truncated: Tensor) -> Tensor:
    """`completion_mask` [B, T] with truncated completions' rows zeroed: they leave the loss
    and, for token normalisers, its normaliser (DAPO's overlong filtering, arXiv 2503.14476)."""
    return completion_mask * (~truncated.bool()).unsqueeze(-1).to(completion_mask.dtype)
