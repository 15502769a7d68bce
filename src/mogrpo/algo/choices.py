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

LossAggregation = Literal["seq_mean", "token_mean", "fixed_length"]
"""Per-sequence mean (GRPO), per-token over the batch (DAPO), fixed length (Dr. GRPO)."""
LOSS_AGGREGATIONS: tuple[str, ...] = get_args(LossAggregation)

KLControllerKind = Literal["fixed", "band", "proportional"]
"""How a task's β moves: not at all, within a KL band, or toward a KL target."""
KL_CONTROLLERS: tuple[str, ...] = get_args(KLControllerKind)

ScheduleKind = Literal["constant", "linear"]
"""How a reward weight changes over the steps."""
SCHEDULE_KINDS: tuple[str, ...] = get_args(ScheduleKind)
