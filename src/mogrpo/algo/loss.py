"""The GRPO loss: every variant's policy term plus a per-sequence KL penalty, and its normaliser.

The normaliser is computed once per optimizer step over every micro-batch (and process), so
the loss is a plain sum over tokens/sequences divided by a constant. Summing ``grpo_loss``
over micro-batches -- backward on each, gradients *accumulated* -- then gives exactly the
full-batch gradient, however the batch was split. The one exception is BNPO's
``micro_token_mean``, which by definition normalises each micro-batch by its own tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mogrpo.algo.choices import ALL_AGGREGATIONS, KL_ESTIMATORS, KL_IMPORTANCE_WEIGHTS
from mogrpo.algo.kl import kl_estimate
from mogrpo.algo.surrogates import LossVariant, policy_term
from mogrpo.errors import ConfigError


def _check_aggregation(aggregation: str) -> None:
    if aggregation not in ALL_AGGREGATIONS:
        raise ConfigError(
            f"loss aggregation={aggregation!r} is not supported; "
            f"choose one of {list(ALL_AGGREGATIONS)}"
        )


def loss_normalizer(completion_mask: Tensor, aggregation: str, max_completion_length: int,
                    micro_batches: int = 1) -> float:
    """The constant every micro-batch's loss is divided by, for one optimizer step.

    ``completion_mask`` [B, T] covers the whole optimizer-step batch (all micro-batches):
      - ``"seq_mean"``: B, the number of sequences (GRPO, DeepSeekMath arXiv 2402.03300);
      - ``"seq_sum"``: B as well, over per-sequence token *sums* (LUSPO, arXiv 2602.05261);
      - ``"token_mean"``: total completion tokens (token-level loss of DAPO, arXiv 2503.14476);
      - ``"fixed_length"``: B * max_completion_length (Dr. GRPO, arXiv 2503.20783), which
        removes the length bias of per-sequence means;
      - ``"micro_token_mean"``: ``micro_batches``, the step's number of micro-batches; each
        micro-batch is further divided by its own token count (BNPO, as TRL computes it).
    All are additive over processes: with several processes, all-reduce (sum) the
    per-process values. DDP then *averages* gradients over the W processes, so multiply each
    process's loss by W to recover the full-batch gradient. Never returns less than 1.
    """
    _check_aggregation(aggregation)
    if aggregation in ("seq_mean", "seq_sum"):
        total = completion_mask.shape[0]
    elif aggregation == "token_mean":
        total = completion_mask.sum().item()
    elif aggregation == "micro_token_mean":
        total = micro_batches
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


def _check_arguments(aggregation: str, kl_estimator: str, kl_importance_weight: bool | str,
                     epsilon_low: float, epsilon_high: float, normalizer: float) -> str:
    """Reject bad settings; returns the KL weighting's name (`True` → "detached")."""
    _check_aggregation(aggregation)
    if kl_estimator not in KL_ESTIMATORS:
        raise ConfigError(
            f"kl_estimator={kl_estimator!r} is not supported; choose one of {list(KL_ESTIMATORS)}"
        )
    kl_weight = {True: "detached", False: "off"}.get(kl_importance_weight, kl_importance_weight)
    if kl_weight not in KL_IMPORTANCE_WEIGHTS:
        raise ConfigError(f"kl_importance_weight={kl_importance_weight!r} is not supported; "
                          f"choose one of {list(KL_IMPORTANCE_WEIGHTS)}")
    if not (0.0 <= epsilon_low < 1.0) or epsilon_high < 0.0:
        raise ConfigError(
            f"clip range epsilon_low={epsilon_low!r}, epsilon_high={epsilon_high!r} is invalid; "
            "need 0 <= epsilon_low < 1 and epsilon_high >= 0"
        )
    if not normalizer > 0:
        raise ValueError(f"normalizer must be > 0, got {normalizer!r}; use loss_normalizer()")
    return str(kl_weight)


def _kl_penalty(logp: Tensor, ref_logp: Tensor | None, mask: Tensor, w: Tensor,
                beta: Tensor | float, estimator: str, weight: str) -> tuple[Tensor, Tensor]:
    """(β · KL term per token [B, T] (0 without `ref_logp`), per-sequence mean KL [B])."""
    dtype, B = logp.dtype, logp.shape[0]
    beta_t = torch.as_tensor(beta, dtype=dtype, device=logp.device)
    if beta_t.ndim == 1:
        if beta_t.shape[0] != B:
            raise ValueError(f"beta has {beta_t.shape[0]} entries for {B} sequences")
        beta_t = beta_t.unsqueeze(-1)  # [B, 1]
    if ref_logp is None:
        if bool((beta_t != 0).any()):
            raise ValueError("beta != 0 needs ref_logp: the KL penalty would be silently dropped")
        return torch.zeros_like(logp), torch.zeros(B, dtype=dtype, device=logp.device)
    ref_logp = torch.where(mask, ref_logp.to(dtype), 0.0)
    kl_tok = kl_estimate(logp, ref_logp, estimator)  # [B, T]
    # w is [B, T] or [B, 1]; see grpo_loss for why it may be detached or not
    kl_term = {"off": kl_tok, "detached": kl_tok * w.detach(), "differentiable": kl_tok * w}[weight]
    lengths = mask.sum(dim=-1).clamp(min=1).to(dtype)
    return beta_t * kl_term, (kl_tok.detach() * mask).sum(dim=-1) / lengths


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
    kl_importance_weight: bool | str = False,
    variant: LossVariant | None = None,
    importance_weights: Tensor | None = None,
) -> LossOutput:
    """A GRPO-family policy loss plus beta * KL, aggregated and divided by ``normalizer``.

    Shapes: logp/old_logp/ref_logp/completion_mask [B, T], advantages [B], beta a scalar or
    [B] (each sequence carries the beta of its task).

    The policy term is ``variant``'s (default: GRPO's clipped surrogate, DeepSeekMath arXiv
    2402.03300, per token with ratio = exp(logp - old_logp):
    ``-min(ratio * A, clip(ratio, 1 - epsilon_low, 1 + epsilon_high) * A)``; a larger
    ``epsilon_high`` is DAPO's clip-higher, arXiv 2503.14476); see `mogrpo.algo.surrogates`
    for CISPO, SAPO, VESPO and sequence-level weights (GSPO). With ``ref_logp`` the term
    ``beta * kl_estimate(logp, ref_logp, kl_estimator)`` is added (Schulman 2020).

    ``kl_importance_weight`` multiplies the KL estimate by the importance weight w = π/π_old
    (at the variant's level), since the tokens were sampled from π_old, not π:
    ``"differentiable"`` (TRL's ``use_bias_correction_kl``, DeepSeek-V3.2 arXiv 2512.02556)
    keeps w in the graph; with k3 the gradient is then E_π[(log π − log π_ref) ∇log π], the
    exact gradient of KL(π‖π_ref) — even at w = 1, so it changes a μ = 1 run too.
    ``"detached"`` (or ``True``) multiplies by sg(w) (Zhang et al. arXiv 2505.17508): the
    estimate's *value* is reweighted to π, while the gradient stays that of plain k3 on
    samples of π, i.e. of KL(π_ref‖π) — identical to a μ = 1 run, so β means the same for
    every μ. ``"off"`` / ``False``: no weight.

    ``importance_weights`` [B, T] (detached) multiply the surrogate term of each token, not the
    KL term: the truncated correction for tokens sampled by another engine than the trainer
    (:func:`mogrpo.algo.importance.truncated_importance_weights`), as TRL applies it.

    ``aggregation`` (see :func:`loss_normalizer` for the matching ``normalizer``):
    ``"seq_mean"`` sums each sequence's token mean; ``"seq_sum"`` each sequence's token sum;
    ``"token_mean"`` and ``"fixed_length"`` sum all tokens; ``"micro_token_mean"`` divides
    this call's token sum by its own token count. Padded positions (mask 0) never reach the
    loss or its gradient.
    """
    kl_weight = _check_arguments(aggregation, kl_estimator, kl_importance_weight, epsilon_low,
                                 epsilon_high, normalizer)
    variant = variant or LossVariant()
    mask, logp, old_logp, adv = _masked_inputs(logp, old_logp, advantages, completion_mask)
    dtype = logp.dtype  # promoted to at least float32

    # w, and the policy term, are [B, T] per token or [B, 1] per sequence (broadcast below)
    policy, clipped, w = policy_term(variant, logp, old_logp, adv, mask, epsilon_low,
                                     epsilon_high)
    per_token = policy.expand_as(logp)  # [B, T]
    if importance_weights is not None:
        per_token = per_token * importance_weights.detach().to(dtype)

    lengths = mask.sum(dim=-1).clamp(min=1).to(dtype)  # [B]
    penalty, kl_seq = _kl_penalty(logp, ref_logp, mask, w, beta, kl_estimator, kl_weight)
    per_token = (per_token + penalty) * mask  # [B, T]
    loss = _aggregate(per_token, mask, lengths, aggregation, normalizer)
    return _diagnostics(loss, kl_seq, mask, clipped, w, dtype)


def _masked_inputs(logp: Tensor, old_logp: Tensor, advantages: Tensor,
                   completion_mask: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(mask [B, T] bool, logp, old_logp [B, T], advantages [B, 1]) in at least float32."""
    mask = completion_mask.bool()  # [B, T]
    dtype = torch.promote_types(logp.dtype, torch.float32)
    # Zero every log-prob at padded positions so pads give ratio 1 and KL 0 and cannot
    # inject inf/NaN into the loss or, through 0 * inf, into the gradient.
    logp = torch.where(mask, logp.to(dtype), 0.0)
    old_logp = torch.where(mask, old_logp.to(dtype), 0.0)
    adv = advantages.to(dtype).unsqueeze(-1)  # [B, 1]
    return mask, logp, old_logp, adv


def _aggregate(per_token: Tensor, mask: Tensor, lengths: Tensor, aggregation: str,
               normalizer: float) -> Tensor:
    """The masked per-token loss [B, T] reduced as `aggregation` says, over `normalizer`."""
    if aggregation == "seq_mean":
        return (per_token.sum(dim=-1) / lengths).sum() / normalizer
    if aggregation == "micro_token_mean":  # BNPO: this micro-batch's own token count
        return per_token.sum() / mask.sum().clamp(min=1).to(lengths.dtype) / normalizer
    # token sums; seq_sum, token_mean and fixed_length differ only in the normaliser
    return per_token.sum() / normalizer


def _diagnostics(loss: Tensor, kl_seq: Tensor, mask: Tensor, clipped: Tensor, w: Tensor,
                 dtype: torch.dtype) -> LossOutput:
    """`loss` and the detached counts logged beside it (clipped tokens, mean ratio)."""
    with torch.no_grad():
        num_tokens = int(mask.sum().item())
        clip_count = (clipped.expand_as(mask) & mask).sum().to(dtype)
        ratio_mean = (w.expand_as(mask) * mask).sum() / max(num_tokens, 1)
    return LossOutput(
        loss=loss,
        kl=kl_seq,
        clip_frac_tokens=clip_count,
        num_tokens=num_tokens,
        ratio_mean=ratio_mean,
    )
