"""Errors a user can cause. Each message says what was wrong, where, and how to fix it."""

from __future__ import annotations


class MogrpoError(Exception):
    """Base class for every error mogrpo reports to a user (printed without a traceback)."""


class ConfigError(MogrpoError):
    """A config value is missing, unknown or invalid."""


class DataError(MogrpoError):
    """A data file cannot be read or one of its rows is malformed."""


class RewardError(MogrpoError):
    """A reward function cannot be resolved or broke the reward contract."""


class ModelError(MogrpoError):
    """A model or tokenizer cannot be loaded or is unsuitable."""
