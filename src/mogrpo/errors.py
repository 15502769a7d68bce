"""Errors a user can cause. Each message says what was wrong, where, and how to fix it."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """What every `mogrpo` command's exit status means (README: "Exit status")."""

    OK = 0
    INTERNAL = 1
    """A bug: an unexpected exception (the traceback is printed)."""
    USAGE = 2
    """A usage, config or data error: the one `error:` line says what to fix."""
    FOUND_PROBLEM = 3
    """A check ran and found a problem (doctor, data check, checkpoints, memory, plan, a health stop)."""
    INTERRUPTED = 130
    """Ctrl-C."""


class MogrpoError(Exception):
    """Base class for every error mogrpo reports to a user (printed without a traceback)."""

    exit_code: int = ExitCode.USAGE


class ConfigError(MogrpoError):
    """A config value is missing, unknown or invalid."""


class DataError(MogrpoError):
    """A data file cannot be read or one of its rows is malformed."""


class RewardError(MogrpoError):
    """A reward function cannot be resolved or broke the reward contract."""


class ModelError(MogrpoError):
    """A model or tokenizer cannot be loaded or is unsuitable."""


class OutOfMemory(MogrpoError):
    """The run ran out of memory and could not (or was told not to) go on with smaller batches."""

    exit_code = ExitCode.FOUND_PROBLEM
