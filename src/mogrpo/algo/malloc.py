"""glibc malloc's mmap threshold, where mogrpo moves it: raised for a CPU training process
(`mogrpo.train.host_memory`, which records it here), and lowered for the few allocations that
must not come from the heap (`mapped`).

A raised threshold serves blocks of up to 32 MiB from the heap and keeps them there once
freed. That is what a training step wants of its activations, but not of a block most of whose
pages are never written: MKL's packed weights (`cpu_linear.MKLPacked`) are allocated ~7.6 MB
larger than the data they hold. From the heap, the space they leave is later reused by other
tensors and becomes resident; the vs_trl 32 M-parameter model's peak RSS rose by ~140 MiB
(1472 -> 1613 MiB, above TRL's 1528). From mappings of their own, untouched pages stay out of
memory and the whole block goes back to the system when freed: peak 1456-1498 MiB, and the
rollout as fast (alternated in one process, 1.01-1.04x).
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
    """Blocks of at least `min_bytes` allocated inside come from mappings of their own, where
    this process raised the threshold (glibc on Linux); elsewhere nothing changes (glibc's own
    threshold already maps blocks that size until large blocks have been freed)."""
    if _raised is None or not sys.platform.startswith("linux"):
        yield
        return
    set_option = mallopt()
    set_option(M_MMAP_THRESHOLD, min_bytes)
    try:
        yield
    finally:
        set_option(M_MMAP_THRESHOLD, _raised)
