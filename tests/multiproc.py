"""Start a test's worker processes under torchrun, the same way in every multi-process test.

The processes import mogrpo from this checkout (its `src/` first on PYTHONPATH, whatever
package an editable install points at) and run with Python's fault handler on, so a native
abort in a worker (SIGABRT, SIGSEGV) prints every thread's Python stack into stderr. A failed
launch reports stderr without FSDP2's repeated "returned a view tensor" warnings (and the fault handler's
list of loaded extensions), so the error itself fits into the message.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mogrpo

SRC = str(Path(mogrpo.__file__).resolve().parents[1])
NOISE = ("returned a view tensor", "output = self._register_pre_backward_hook(output)",
         "Extension modules:")  # the fault handler's list of every loaded C extension


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a test's subprocesses: this checkout's mogrpo, fault handler on,
    and `extra`."""
    path = os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONFAULTHANDLER": "1", **(extra or {})}


def readable(stderr: str, limit: int = 6000) -> str:
    """The tail of a worker's stderr without FSDP2's per-forward warnings."""
    kept = [line for line in stderr.splitlines() if not any(n in line for n in NOISE)]
    return "\n".join(kept)[-limit:]


def run(args: list[str], *, timeout: int = 300, check: bool = True,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python ARGS` in the test environment (plus `env`); with `check`, a non-zero exit
    fails the test."""
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=timeout, env=worker_env(env))
    if check:
        assert done.returncode == 0, readable(done.stderr)
    return done


def torchrun(*target: str, nproc: int = 2, timeout: int = 300, check: bool = True,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node NPROC TARGET...` (a script and its arguments,
    or `-m module ...`)."""
    return run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                *target], timeout=timeout, check=check, env=env)
