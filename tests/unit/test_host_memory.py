"""train.host_memory: glibc keeps the memory a step frees, so the next step faults no pages."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mogrpo.train import host_memory

GLIBC = sys.platform.startswith("linux") and os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")

# A training step in miniature: two MLP blocks' forward and backward on [16, 44, 128] (the
# activations saved for the backward are freed together at its end, as in a GRPO update).
# The page faults of twenty such steps after two warm-ups.
_STEPS = """
import resource, sys, torch
from mogrpo.train.host_memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory() is None
torch.manual_seed(0)
blocks = torch.nn.Sequential(*[torch.nn.Sequential(
    torch.nn.Linear(128, 640), torch.nn.SiLU(), torch.nn.Linear(640, 128)) for _ in range(2)])
x = torch.randn(16, 44, 128)
def step():
    blocks(x).square().sum().backward()
step(); step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _run(script: str, mode: str) -> int:
    """The number `script` prints, run in a process of its own with glibc's malloc defaults
    (no MALLOC_* or tunables inherited) and `mode` ("keep" or "default") as its argument."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.pop("GLIBC_TUNABLES", None)
    out = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True,
                         env=env, check=True)
    return int(out.stdout.strip())


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_kept_memory_serves_the_next_step_without_page_faults():
    default, kept = _run(_STEPS, "default"), _run(_STEPS, "keep")
    # glibc's defaults give part of the freed activations back after each step and fault
    # them in again (250 to 800 pages a step here); kept, the heap serves every step from
    # the pages it already has.
    assert default > 4000
    assert kept < default // 3


# Small blocks freed among larger ones: with fastbins on, glibc leaves them unmerged in its
# fastbins (mallinfo2's fsmblks: their bytes) until a large request walks them all.
_SMALL = """
import ctypes, sys
from mogrpo.train.host_memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory() is None
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                               "usmblks", "fsmblks", "uordblks", "fordblks",
                                               "keepcost")]
libc.mallinfo2.restype = Info
blocks = [libc.malloc(96) for _ in range(5000)]
for b in blocks:
    libc.free(b)
print(libc.mallinfo2().fsmblks)
"""


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_kept_memory_leaves_no_small_blocks_waiting_in_fastbins():
    # the per-thread cache takes the first 7 blocks; glibc's defaults park the rest
    assert _run(_SMALL, "default") > 100_000
    assert _run(_SMALL, "keep") == 0


def test_environment_settings_win(monkeypatch):
    called = []
    monkeypatch.setattr(host_memory.ctypes, "CDLL", lambda *a: called.append(a))
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    expected = "malloc settings given in the environment" if sys.platform.startswith("linux") \
        else "not Linux"
    assert host_memory.keep_freed_memory() == expected
    assert called == []


@pytest.mark.parametrize(("setting", "device", "applied"), [
    ("auto", "cpu", True), ("auto", "cuda", False), ("keep", "cuda", True),
    ("release", "cpu", False),
])
def test_setting_decides_where_it_applies(monkeypatch, setting, device, applied):
    calls = []
    monkeypatch.setattr(host_memory, "keep_freed_memory", lambda: calls.append(1) or None)
    host_memory.apply_host_memory(setting, device)
    assert calls == ([1] if applied else [])


def test_keep_that_cannot_apply_says_why(monkeypatch, caplog):
    monkeypatch.setattr(host_memory, "keep_freed_memory", lambda: "not glibc")
    with caplog.at_level("INFO", logger="mogrpo.train.host_memory"):
        host_memory.apply_host_memory("keep", "cpu")
    assert "train.host_memory = keep has no effect here: not glibc" in caplog.text
