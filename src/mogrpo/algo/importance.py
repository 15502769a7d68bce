"""Truncated importance weights for tokens sampled by another engine than the trainer's.

A fast inference engine (vLLM) samples from q, its own numerics of the policy (other kernels,
bf16 accumulation, its own sampler), while the loss is written for the trainer's pi_old. Even
with identical weights q != pi_old, and the GRPO gradient silently becomes off-policy. Each
token's loss term is therefore weighted by pi_old(y_t) / q(y_t), truncated at a cap so that a
token q gave far less probability than pi_old does cannot blow up the gradient: truncated importance sampling (TIS; Yao et al.,
"Your Efficient RL Framework Secretly Brings You Off-Policy RL Training", 2025; the truncation
of IMPALA's V-trace, Espeholt et al., arXiv 1802.01561). This is TRL's
`vllm_importance_sampling_mode="token_truncate"` with its default cap of 3.0 (TRL's default
mode masks whole sequences whose ratio leaves a band instead).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mogrpo.errors import ConfigError


def truncated_importance_weights(
    trainer_logp: Tensor, sampler_logp: Tensor, completion_mask: Tensor, cap: float
) -> Tensor:
    """min(exp(trainer_logp - sampler_logp), cap) per token [B, T], detached.

    `trainer_logp` is pi_old's log-prob of each sampled token (the trainer at rollout time),
    `sampler_logp` the sampling engine's. Padded positions, and tokens whose log-probs are not
    both finite (a sampler that reported none), get weight 1: no correction rather than NaN.
    """
    if not cap >= 1.0:
        raise ConfigError(
            f"importance cap = {cap!r} must be >= 1 (a cap below 1 would shrink every "
            "token's weight, not only the over-sampled ones); 3.0 is the usual value"
        )
    if trainer_logp.shape != sampler_logp.shape or trainer_logp.shape != completion_mask.shape:
        raise ValueError(
            f"shapes differ: trainer_logp {tuple(trainer_logp.shape)}, sampler_logp "
            f"{tuple(sampler_logp.shape)}, completion_mask {tuple(completion_mask.shape)}"
        )
    diff = trainer_logp.detach().double() - sampler_logp.detach().double()  # [B, T]
    usable = completion_mask.bool() & torch.isfinite(diff)
    # float64, and the clamp before exp: a diff of 800 would overflow even float64; the
    # minimum after it makes a capped weight exactly `cap` (exp(log 3) is 3.0000000000000004)
    ratio = torch.where(usable, diff, 0.0).clamp(max=math.log(cap)).exp().clamp(max=cap)
    dtype = trainer_logp.dtype if trainer_logp.is_floating_point() else torch.float32
    return ratio.to(dtype)
