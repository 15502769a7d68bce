"""The loggers `main` reconfigures, put back: for the autouse fixture of every test
(`conftest.py`) and for fixtures wider than one test that call `main`."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


@contextlib.contextmanager
def logging_kept() -> Iterator[None]:
    """`main` reconfigures the `mogrpo` and `transformers` loggers: put them back after it (a
    fixture wider than one test that calls `main` needs this itself)."""
    loggers = [logging.getLogger("mogrpo"), logging.getLogger("transformers")]
    saved = [(lg.handlers[:], lg.level, lg.propagate) for lg in loggers]
    try:
        yield
    finally:
        for lg, (handlers, level, propagate) in zip(loggers, saved, strict=True):
            lg.handlers[:], lg.level, lg.propagate = handlers, level, propagate
