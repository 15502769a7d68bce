"""glibc's malloc told to keep the memory a training step frees for the next step.

A step allocates the same tensors every time (the activations the backward needs, their
gradients) and frees them at its end. glibc serves blocks above its mmap threshold straight
from the kernel and gives the free top of its heap back once it exceeds the trim threshold;
both thresholds start small and follow the largest block freed so far (at most 32 MiB and
64 MiB). The tensors a backward frees together exceed that trim threshold, so every step
faults fresh zeroed pages in for the tensors the step before gave back: on the 0.7 M-parameter
vs_trl model ~3,700 page faults a step, ~8 % of a CPU step (~12 % under LoRA, whose adapters
add tensors of the largest shape).

`keep_freed_memory` fixes both thresholds with `mallopt`: blocks below MMAP_THRESHOLD come
from the heap and up to TRIM_THRESHOLD of free heap top stays with the process. The peak is
the same (every step reaches it again); the memory goes back when the process ends. Blocks
whose pages are mostly never written (MKL's packed decode weights) still never grow the heap:
see `mogrpo.kernels.cpu.malloc`.

It also turns glibc's fastbins off (M_MXFAST 0; its per-thread cache still serves the
smallest blocks). A freed block of up to 128 bytes waits in a fastbin unmerged, and the next
large request or large free walks every fastbin to merge them (`malloc_consolidate`): a step
frees thousands of small blocks (tensor metadata, oneDNN's descriptors) between its large
ones, so that walk ran inside most of its ~400 oneDNN calls. Off, the native decode of the
vs_trl 0.7 M-parameter batch is ~3 % faster (18.5 -> 17.9 ms CPU, 4 alternated runs), the
step ~1 %. Linux with glibc only; MALLOC_* or glibc.malloc tunables set in the environment
win.
"""

from __future__ import annotations

import logging
import os
import sys

from mogrpo.kernels.cpu import malloc

log = logging.getLogger(__name__)

MMAP_THRESHOLD = 32 * 2**20  # glibc's own ceiling for its dynamic threshold
TRIM_THRESHOLD = 512 * 2**20
_ENVIRONMENT = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                "MALLOC_MMAP_MAX_")


def keep_freed_memory() -> str | None:
    """Set the thresholds for this process; None when set, else why not."""
    if not sys.platform.startswith("linux"):
        return "not Linux"
    if any(name in os.environ for name in _ENVIRONMENT) or \
            "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return "malloc settings given in the environment"
    try:
        libc = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (ValueError, OSError):
        libc = ""
    if not libc.startswith("glibc"):
        return "not glibc"
    mallopt = malloc.mallopt()
    if mallopt(malloc.M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1 or \
            mallopt(malloc.M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1 or \
            mallopt(malloc.M_MXFAST, 0) != 1:
        return "mallopt refused the settings"
    malloc.note_raised(MMAP_THRESHOLD)  # for the blocks that must be mapped (`malloc.mapped`)
    return None


def apply_host_memory(setting: str, device_type: str) -> None:
    """`train.host_memory`: "keep" keeps freed memory, "auto" on CPU runs, "release" never."""
    if setting == "release" or (setting == "auto" and device_type != "cpu"):
        return
    reason = keep_freed_memory()
    if reason is None:
        log.debug("host memory: malloc keeps freed blocks (mmap threshold %d MiB, trim %d MiB)",
                  MMAP_THRESHOLD >> 20, TRIM_THRESHOLD >> 20)
    elif setting == "keep":
        log.info("train.host_memory = keep has no effect here: %s", reason)
