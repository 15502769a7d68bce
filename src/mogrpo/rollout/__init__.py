"""Rollout: sample K completions per prompt with the sampling flags honoured."""

from mogrpo.rollout.generate import (
    Rollout,
    SamplingSettings,
    build_generation_config,
    generate_rollout,
    split_completions,
)
from mogrpo.rollout.processors import NonFiniteGuard, PresenceFrequencyPenalty

__all__ = [
    "NonFiniteGuard",
    "PresenceFrequencyPenalty",
    "Rollout",
    "SamplingSettings",
    "build_generation_config",
    "generate_rollout",
    "split_completions",
]
