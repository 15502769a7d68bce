"""`torch.profiler` over the part of training steps outside their generation, as a summary.

Both workers (`profile_step.py --torch-profile` for mogrpo, `trl_worker.py --torch-profile` for
TRL) collect the steps after the warm-up with the rollout switched out
(`toggle_collection_dynamic`), and write PyTorch's table of operators and kernels, sorted by
time on the device (CUDA) or on the CPU, headed by how many kernels ran and how long the device
was busy a step. The summary, not the trace, is what gets committed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


class StepProfiler:
    """Collects what runs between `begin()` and `end()`, less what runs inside `paused()`."""

    def __init__(self, path: Path, cuda: bool) -> None:
        self.path, self.cuda = path, cuda
        self.activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self.prof: profile | None = None
        self.steps = 0
        self.collecting = False

    def begin(self) -> None:
        """Start (or resume) collecting, at the start of a profiled step."""
        if self.prof is None:
            self.prof = profile(activities=self.activities, record_shapes=False)
            self.prof.__enter__()
        else:
            self._toggle(True)
        self.collecting = True

    def end(self) -> None:
        """Stop collecting at the end of a profiled step."""
        if self.collecting:
            self._sync()
            self._toggle(False)
            self.collecting = False
            self.steps += 1

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Leave out what runs inside (the rollout)."""
        if not self.collecting:
            yield
            return
        self._sync()
        self._toggle(False)
        try:
            yield
        finally:
            self._sync()
            self._toggle(True)

    def _toggle(self, on: bool) -> None:
        assert self.prof is not None
        self.prof.toggle_collection_dynamic(on, self.activities)

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def write(self, title: str) -> None:
        """The summary: kernels and busy time a step, then the top rows of the table."""
        if self.prof is None:
            return
        self.prof.__exit__(None, None, None)
        events = self.prof.key_averages()
        steps = max(self.steps, 1)
        lines = [title, f"steps profiled: {self.steps} (the rollout left out)"]
        if self.cuda:
            try:  # the kernels themselves: events on the device, not the operators that ran them
                kernels = [e for e in self.prof.events()
                           if getattr(e.device_type, "name", "") == "CUDA"]
                busy_us = sum(getattr(e, "device_time_total", 0) or 0 for e in kernels)
                lines.append(f"CUDA kernels a step: {len(kernels) / steps:.0f}, device busy a "
                             f"step: {busy_us / steps / 1000:.1f} ms")
            except Exception as err:  # a profiler without these fields: the table still helps
                lines.append(f"(kernel count unavailable: {err!r})")
        sort = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        try:
            lines.append(events.table(sort_by=sort, row_limit=40, max_name_column_width=60))
        except Exception:  # an older name of the device column
            lines.append(events.table(sort_by="self_cuda_time_total", row_limit=40,
                                      max_name_column_width=60))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("\n".join(lines) + "\n", encoding="utf-8")
