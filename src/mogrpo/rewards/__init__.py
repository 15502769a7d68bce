"""Rewards: the reward contract, built-in rule rewards and answer extraction."""

from mogrpo.rewards.base import BUILTIN_REWARDS, RewardSpec, resolve_reward, reward_label, score
from mogrpo.rewards.builtin import format_reward, length_penalty, mc_correct
from mogrpo.rewards.extract import Extraction, extract_choice

__all__ = [
    "BUILTIN_REWARDS",
    "Extraction",
    "RewardSpec",
    "extract_choice",
    "format_reward",
    "length_penalty",
    "mc_correct",
    "resolve_reward",
    "reward_label",
    "score",
]
