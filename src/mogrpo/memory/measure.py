"""The measured side: peak memory of this process (CUDA reserved, or peak RSS on CPU)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any


def peak_bytes(device: Any) -> int:
    """Measured peak since the last `reset_peak`: CUDA reserved memory, or the process's RSS."""
    import torch

    if torch.device(device).type == "cuda":
        return int(torch.cuda.max_memory_reserved(device))
    try:
        status = Path("/proc/self/status").read_text(encoding="utf-8")
    except OSError:  # not Linux: no cheap peak RSS to read
        return 0
    found = re.search(r"VmHWM:\s+(\d+) kB", status)
    return int(found[1]) * 1024 if found else 0


def reset_peak(device: Any) -> None:
    """Start a new peak window (on Linux, writing 5 to clear_refs resets VmHWM)."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        try:
            Path("/proc/self/clear_refs").write_text("5", encoding="utf-8")
        except OSError:  # not Linux, or not allowed: the peak then covers the whole process
            pass
