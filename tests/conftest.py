"""Fixtures for every test: no stray MOGRPO_* settings, and logging put back after `main()`;
the compiled decode step built before the first test."""

from __future__ import annotations

import os

import pytest

from kept_logging import logging_kept

# where the machine keeps builds, not a setting of a run: left as the shell has it
KEPT_ENV = {"MOGRPO_KERNEL_CACHE"}


def pytest_sessionstart(session: pytest.Session) -> None:
    """The native engine's compiled CPU decode step built (where it can be) before any test, or
    any process a test starts, decodes: on a new machine its ~30 s build would otherwise land
    inside whichever test decodes first, under that test's time limits."""
    from mogrpo.kernels.cpu import decode_step as cpu_kernel

    cpu_kernel.module()


@pytest.fixture(autouse=True)
def isolated(monkeypatch: pytest.MonkeyPatch):
    """No MOGRPO_* variables from the shell; `main` reconfigures logging, so put it back."""
    for name in [n for n in os.environ if n.startswith("MOGRPO_") and n not in KEPT_ENV]:
        monkeypatch.delenv(name)
    with logging_kept():
        yield
