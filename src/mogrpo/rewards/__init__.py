"""Rewards: the reward contract, built-in rule rewards, answer extraction, sandboxed
Python and Verilog tests."""

from mogrpo.config.sections import reward_label
from mogrpo.rewards.base import BUILTIN_REWARDS, resolve_reward, score
from mogrpo.rewards.builtin import format_reward, length_penalty, mc_correct
from mogrpo.rewards.code import code_tests
from mogrpo.rewards.extract import Extraction, extract_choice
from mogrpo.rewards.verilog import verilog_tests

__all__ = [
    "BUILTIN_REWARDS",
    "Extraction",
    "code_tests",
    "extract_choice",
    "format_reward",
    "length_penalty",
    "mc_correct",
    "resolve_reward",
    "reward_label",
    "score",
    "verilog_tests",
]
