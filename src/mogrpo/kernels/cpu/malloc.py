"""glibc malloc's mmap threshold, where mogrpo moves it: raised for a CPU training process
(`mogrpo.kernels.cpu.host_memory`, which records it here), and lowered for the few allocations that
must not grow the heap (`mapped`).

A raised threshold serves blocks of up to 32 MiB from the heap and keeps them there once
freed. That is what a training step wants of its activations, but not of a block most of whose
pages are never written: the buffers MKL asks for its packed weights (`mkl_packed._Block`) are
several times what it writes. Grown into the heap, the space they leave is later reused by
other tensors and becomes resident; the vs_trl 32 M-parameter model's peak RSS rose by ~140 MiB
(1472 -> 1613 MiB, above TRL's 1528). With the threshold lowered, glibc still serves such a
block from free heap memory where it fits (pages the process holds already: no fault) and
maps it on its own rather than grow the heap: peak 1456-1520 MiB, the rollout as fast.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

M_MXFAST, M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = 1, -1, -3  # mallopt's parameters (malloc.h)

_raised: int | None = None  # the threshold `host_memory` set in this process (None: glibc's)


def mallopt() -> Callable[[int, int], int]:
    """glibc's `mallopt(param, value)` (1 when it took the setting); Linux with glibc only."""
    function = ctypes.CDLL(None).mallopt
    function.argtypes, function.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return function


def note_raised(threshold: int) -> None:
    """Record that this process's mmap threshold was set to `threshold` bytes."""
    global _raised
    _raised = threshold


@contextmanager
def mapped(min_bytes: int = 2**20) -> Iterator[None]:
    """Blocks of at least `min_bytes` allocated inside never grow the heap, where this process
    raised the threshold (glibc on Linux): glibc serves one from free heap memory where it fits
    and maps it on its own otherwise. Elsewhere nothing changes (glibc's own threshold already
    maps blocks that size until large blocks have been freed)."""
    if _raised is None or not sys.platform.startswith("linux"):
        yield
        return
    set_option = mallopt()
    set_option(M_MMAP_THRESHOLD, min_bytes)
    try:
        yield
    finally:
        set_option(M_MMAP_THRESHOLD, _raised)
