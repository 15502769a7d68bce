"""The GRPO math as pure functions on tensors: log-probs, advantages, KL, loss."""

from mogrpo.algo.advantages import (
    COMBINE_MODES,
    SCALE_MODES,
    group_advantages,
    reward_stats,
    zero_variance_fraction,
)
from mogrpo.algo.kl import KL_ESTIMATORS, kl_estimate
from mogrpo.algo.logprobs import completion_logprobs, token_entropy, token_logprobs
from mogrpo.algo.loss import (
    ALL_AGGREGATIONS,
    LOSS_AGGREGATIONS,
    LossOutput,
    grpo_loss,
    loss_normalizer,
)
from mogrpo.algo.surrogates import LOSS_TYPES, LossVariant, mask_truncated

__all__ = [
    "ALL_AGGREGATIONS",
    "COMBINE_MODES",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "LOSS_TYPES",
    "SCALE_MODES",
    "LossOutput",
    "LossVariant",
    "completion_logprobs",
    "group_advantages",
    "grpo_loss",
    "kl_estimate",
    "loss_normalizer",
    "mask_truncated",
    "reward_stats",
    "token_entropy",
    "token_logprobs",
    "zero_variance_fraction",
]
