"""The GRPO clipped surrogate with a per-sequence KL penalty, and its normaliser.

The normaliser is computed once per optimizer step over every micro-batch (and process), so
the loss is a plain sum over tokens/sequences divided by a constant. Summing ``grpo_loss``
over micro-batches -- backward on each, gradients *accumulated* -- then gives exactly the
full-batch gradient, however the batch was split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mogrpo.algo.choices import KL_ESTIMATORS, LOSS_AGGREGATIONS
from mogrpo.algo.kl import kl_estimate
from mogrpo.errors import ConfigError


def _check_aggregation(aggregation: str) -> None:
    if aggregation not in LOSS_AGGREGATIONS:
        raise ConfigError(
            f"loss aggregation={aggregation!r} is not supported; "
            f"choose one of {list(LOSS_AGGREGATIONS)}"
        )


def loss_normalizer(completion_mask: Tensor, aggregation: str, max_completion_length: int) -> float:
    """The constant every micro-batch's loss is divided by, for one optimizer step.

    ``completion_mask`` [B, T] covers the whole optimizer-step batch (all micro-batches):
      - ``"seq_mean"``: B, the number of sequences (GRPO, DeepSeekMath arXiv 2402.03300);
      - ``"token_mean"``: total completion tokens (token-level loss of DAPO, arXiv 2503.14476);
      - ``"fixed_length"``: B * max_completion_length (Dr. GRPO, arXiv 2503.20783), which
        removes the length bias of per-sequence means.
    All three are additive over processes: with several processes, all-reduce (sum) the
    per-process values. DDP then *averages* gradients over the W processes, so multiply each
    process's loss by W to recover the full-batch gradient. Never returns less than 1.
    """
    _check_aggregation(aggregation)
    if aggregation == "seq_mean":
        total = completion_mask.shape[0]
    elif aggregation == "token_mean":
        total = completion_mask.sum().item()
    else:
        if max_completion_length < 1:
            raise ConfigError(
                f"max_completion_length={max_completion_length!r} must be >= 1 "
                "for loss aggregation 'fixed_length'"
            )
        longest = int(completion_mask.sum(dim=-1).max().item()) if completion_mask.numel() else 0
        if longest > max_completion_length:
            raise ValueError(
                f"a completion has {longest} tokens, more than max_completion_length="
                f"{max_completion_length}; the 'fixed_length' normaliser would be too small"
            )
        total = completion_mask.shape[0] * max_completion_length
    return float(max(total, 1))


@dataclass
class LossOutput:
    """What one ``grpo_loss`` call returns; every field except ``loss`` is detached."""

    loss: Tensor
    """Scalar to call backward on; already divided by the step's global normaliser."""
    kl: Tensor
    """[B] per-sequence mean of the per-token KL estimate (zeros without ``ref_logp``)."""
    clip_frac_tokens: Tensor
    """Scalar *count* of masked tokens whose ratio was clipped; sum over micro-batches and
    divide by the summed ``num_tokens`` to get the clip fraction."""
    num_tokens: int
    """Number of completion tokens (mask == 1) in this micro-batch."""
    ratio_mean: Tensor
    """Scalar mean importance ratio over this micro-batch's completion tokens."""


def grpo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    completion_mask: Tensor,
    *,
    normalizer: float,
    aggregation: str = "seq_mean",
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    ref_logp: Tensor | None = None,
    beta: Tensor | float = 0.0,
    kl_estimator: str = "k3",
    kl_importance_weight: bool = False,
) -> LossOutput:
    """Clipped GRPO surrogate plus beta * KL, aggregated and divided by ``normalizer``.

    Shapes: logp/old_logp/ref_logp/completion_mask [B, T], advantages [B], beta a scalar or
    [B] (each sequence carries the beta of its task).

    Per token, with ratio = exp(logp - old_logp) (GRPO, DeepSeekMath arXiv 2402.03300):
    ``-min(ratio * A, clip(ratio, 1 - epsilon_low, 1 + epsilon_high) * A)``; a larger
    ``epsilon_high`` is DAPO's clip-higher (arXiv 2503.14476). With ``ref_logp`` the term
    ``beta * kl_estimate(logp, ref_logp, kl_estimator)`` is added (Schulman 2020).

    ``kl_importance_weight``: when the batch is reused for mu > 1 passes, its tokens were
    sampled from pi_old, not the current pi, so the plain KL estimate targets the wrong
    expectation. Multiplying it by the detached ratio pi/pi_old reweights the samples back to
    pi (Zhang et al., "On the Design of KL-Regularized Policy Gradient Algorithms for LLM
    Reasoning", arXiv 2505.17508). The ratio is 1 on the first pass.

    ``aggregation`` (see :func:`loss_normalizer` for the matching ``normalizer``):
    ``"seq_mean"`` sums each sequence's token mean; ``"token_mean"`` and ``"fixed_length"``
    sum all tokens. Padded positions (mask 0) never reach the loss or its gradient.
    """
    _check_aggregation(aggregation)
    if kl_estimator not in KL_ESTIMATORS:
        raise ConfigError(
            f"kl_estimator={kl_estimator!r} is not supported; choose one of {list(KL_ESTIMATORS)}"
        )
    if not (0.0 <= epsilon_low < 1.0) or epsilon_high < 0.0:
        raise ConfigError(
            f"clip range epsilon_low={epsilon_low!r}, epsilon_high={epsilon_high!r} is invalid; "
            "need 0 <= epsilon_low < 1 and epsilon_high >= 0"
        )
    if not normalizer > 0:
        raise ValueError(f"normalizer must be > 0, got {normalizer!r}; use loss_normalizer()")

    mask = completion_mask.bool()  # [B, T]
    dtype = torch.promote_types(logp.dtype, torch.float32)
    # Zero every log-prob at padded positions so pads give ratio 1 and KL 0 and cannot
    # inject inf/NaN into the loss or, through 0 * inf, into the gradient.
    logp = torch.where(mask, logp.to(dtype), 0.0)
    old_logp = torch.where(mask, old_logp.to(dtype), 0.0)
    adv = advantages.to(dtype).unsqueeze(-1)  # [B, 1]

    ratio = torch.exp(logp - old_logp)  # [B, T]
    clipped = ratio.clamp(1.0 - epsilon_low, 1.0 + epsilon_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)  # [B, T]

    lengths = mask.sum(dim=-1).clamp(min=1).to(dtype)  # [B]
    beta_t = torch.as_tensor(beta, dtype=dtype, device=logp.device)
    if beta_t.ndim == 1:
        if beta_t.shape[0] != logp.shape[0]:
            raise ValueError(f"beta has {beta_t.shape[0]} entries for {logp.shape[0]} sequences")
        beta_t = beta_t.unsqueeze(-1)  # [B, 1]
    if ref_logp is not None:
        ref_logp = torch.where(mask, ref_logp.to(dtype), 0.0)
        kl_tok = kl_estimate(logp, ref_logp, kl_estimator)  # [B, T]
        kl_term = kl_tok * ratio.detach() if kl_importance_weight else kl_tok
        per_token = per_token + beta_t * kl_term
        kl_seq = (kl_tok.detach() * mask).sum(dim=-1) / lengths  # [B]
    else:
        if bool((beta_t != 0).any()):
            raise ValueError("beta != 0 needs ref_logp: the KL penalty would be silently dropped")
        kl_seq = torch.zeros(logp.shape[0], dtype=dtype, device=logp.device)

    per_token = per_token * mask  # [B, T]
    if aggregation == "seq_mean":
        loss = (per_token.sum(dim=-1) / lengths).sum() / normalizer
    else:
        loss = per_token.sum() / normalizer

    with torch.no_grad():
        clip_active = ((ratio < 1.0 - epsilon_low) & (adv < 0)) | (
            (ratio > 1.0 + epsilon_high) & (adv > 0)
        )
        num_tokens = int(mask.sum().item())
        clip_count = (clip_active & mask).sum().to(dtype)
        ratio_mean = (ratio * mask).sum() / max(num_tokens, 1)
    return LossOutput(
        loss=loss,
        kl=kl_seq,
        clip_frac_tokens=clip_count,
        num_tokens=num_tokens,
        ratio_mean=ratio_mean,
    )
