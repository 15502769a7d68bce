"""Start a test's worker processes under torchrun, the same way in every multi-process test.

The processes import mogrpo from this checkout (its `src/` first on PYTHONPATH, whatever
package an editable install points at) and run with Python's fault handler on, so a native
abort in a worker (SIGABRT, SIGSEGV) prints every thread's Python stack into stderr. A failed
launch reports stderr without FSDP2's repeated "returned a view tensor" warnings (and the fault handler's
list of loaded extensions), so the error itself fits into the message.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from collections.abc import Callable
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


def in_forked_child(call: Callable[[], str], timeout_s: float = 10) -> str:
    """What `call()` returns in a forked child of this process, or a sentence saying it gave
    nothing within `timeout_s` (the child leaves without running the parent's cleanup)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(write, call().encode())
        finally:
            os._exit(0)
    os.close(write)
    ready, _, _ = select.select([read], [], [], timeout_s)
    answer = os.read(read, 4096).decode() if ready else f"no answer within {timeout_s:g} s"
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    os.close(read)
    return answer
