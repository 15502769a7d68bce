"""The names of the algorithm's options, defined once.

`algo/` dispatches on these names and rejects others; the config's sections take their
`Literal` types from here, so a name added or renamed in one place is valid in both. Each
tuple is read off its `Literal`. No torch here: the config imports this before any model.
"""

from __future__ import annotations

from typing import Literal, get_args

AdvantageCombine = Literal["sum_then_normalize", "normalize_then_sum"]
"""Combine objectives before group normalisation, or normalise each first (MO-GRPO)."""
COMBINE_MODES: tuple[str, ...] = get_args(AdvantageCombine)

AdvantageScaling = Literal["group", "batch", "none"]
"""Divide centred rewards by the group std, the batch std, or nothing (Dr. GRPO)."""
SCALE_MODES: tuple[str, ...] = get_args(AdvantageScaling)

KLEstimator = Literal["k1", "k2", "k3"]
"""Schulman's (2020) estimators of KL(policy ‖ reference)."""
KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)

LossAggregation = Literal["seq_mean", "token_mean", "fixed_length", "seq_sum",
                          "micro_token_mean"]
"""Per-sequence mean (GRPO), per-token over the batch (DAPO), fixed length (Dr. GRPO),
per-sequence sum (LUSPO), per-micro-batch token mean (TRL's BNPO)."""
ALL_AGGREGATIONS: tuple[str, ...] = get_args(LossAggregation)
LOSS_AGGREGATIONS: tuple[str, ...] = tuple(a for a in ALL_AGGREGATIONS if a != "micro_token_mean")
"""The aggregations whose gradient does not depend on how the batch is split."""

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
"""The policy loss, as TRL names them."""
LOSS_TYPES: tuple[str, ...] = get_args(LossType)

KLImportanceWeight = Literal["off", "detached", "differentiable"]
"""Whether the KL estimate is multiplied by the importance ratio π/π_old, and how."""
KL_IMPORTANCE_WEIGHTS: tuple[str, ...] = get_args(KLImportanceWeight)

ImportanceSamplingLevel = Literal["token", "sequence"]
"""An importance ratio per token, or one per sequence (GSPO)."""
IMPORTANCE_SAMPLING_LEVELS: tuple[str, ...] = get_args(ImportanceSamplingLevel)

KLControllerKind = Literal["fixed", "band", "proportional", "dual"]
"""How a task's β moves: not at all, by notches outside a KL band, toward a KL target, or as
the multiplier of the KL constraint held inside a band (PI on log β)."""
KL_CONTROLLERS: tuple[str, ...] = get_args(KLControllerKind)

ScheduleKind = Literal["constant", "linear"]
"""How a reward weight changes over the steps."""
SCHEDULE_KINDS: tuple[str, ...] = get_args(ScheduleKind)

OptimizerName = Literal["adamw", "adamw_8bit", "paged_adamw_8bit", "adafactor"]
"""The optimizer: torch's AdamW, bitsandbytes' 8-bit AdamW (paged or not), or Adafactor."""
OPTIMIZERS: tuple[str, ...] = get_args(OptimizerName)
