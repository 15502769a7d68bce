"""Fixtures for every test: no stray MOGRPO_* settings, and logging put back after `main()`."""

from __future__ import annotations

import logging
import os

import pytest


@pytest.fixture(autouse=True)
def isolated(monkeypatch: pytest.MonkeyPatch):
    """No MOGRPO_* variables from the shell; `main` reconfigures logging, so put it back."""
    for name in [n for n in os.environ if n.startswith("MOGRPO_")]:
        monkeypatch.delenv(name)
    loggers = [logging.getLogger("mogrpo"), logging.getLogger("transformers")]
    saved = [(lg.handlers[:], lg.level, lg.propagate) for lg in loggers]
    yield
    for lg, (handlers, level, propagate) in zip(loggers, saved, strict=True):
        lg.handlers[:], lg.level, lg.propagate = handlers, level, propagate
