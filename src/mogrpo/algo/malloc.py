"""glibc malloc's mmap threshold, where mogrpo moves it: raised for a CPU training process
(`mogrpo.train.host_memory`, which records it here), and lowered for the few allocations that
must not come from the heap (`mapped`).

A raised threshold serves blocks of up to 32 MiB from the heap and keeps them there once
freed. That is what a training step wants of its activations, but not of a block most of whose
pages are never written: MKL's packed weights (`cpu_linear.MKLPacked`) are allocated ~7.6 MB
larger than the data they hold. From the heap, the space they leave is later reused by other
tensors and becomes resident; the vs_trl 32 M-parameter model's peak RSS rose by ~140 MiB
(1472 -> 1613 MiB). From mappings of their own, untouched pages stay out of memory and the
whole block goes back to the system when freed: peak 1504 MiB, and the rollout as fast
(alternated in one process, 1.01-1.04x).
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Iterator
from contextlib import contextmanager

M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)

_raised: int | None = None  # the threshold `host_memory` set in this process (None: glibc's)


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
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mallopt(M_MMAP_THRESHOLD, min_bytes)
    try:
        yield
    finally:
        mallopt(M_MMAP_THRESHOLD, _raised)
