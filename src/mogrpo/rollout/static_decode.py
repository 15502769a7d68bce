"""The native engine's decode with every shape fixed, so that a CUDA graph can replay its steps.

On a GPU a small model's decode step is launch-bound: at 0.21 B parameters on an H200 each step
took ~11 ms, about 100x the time its weights take to read, spent launching a few hundred kernels
from Python. A CUDA graph launches a captured step's kernels in one call, but it replays exactly
what it captured: the same shapes, the same memory. The eager step (`NativeDecoder.step`) meets a
new shape at every token (one more cache column) and every time rows finish (fewer rows).

`StaticDecoder` runs the same prefill, then steps whose tensors keep one shape per *bucket*:

- the step (`NativeDecoder.static_step`) attends over all T_max cache columns with the columns
  not yet written masked out, writes its column at an index held in a tensor, and looks the
  rotary rows up at positions computed on the device;
- a step runs on the first `bucket` rows of the cache. The first bucket is the batch; the
  others are powers of two down to `SMALLEST_BUCKET` (`bucket_sizes`). Rows that finish stay
  where they are, computed and ignored (their cost is the bucket's), until the live rows fit a
  smaller bucket: then they move up in place (`cache_rows.shift_rows`, the eager path's own
  copies) and the steps run on that bucket. A bucket is captured at its first step and
  replayed after (`mogrpo.kernels.graph_runner`): at most `len(bucket_sizes(B))` captures a
  decode, the first at its first step, each other when rows leave;
- sampling runs right after the step, on the live rows' logits, with the eager loop's own rules
  (`_decode` in `rollout/native.py`), so the random draws are the same ones.

Rows in a bucket never see each other: every operation of a step is per row (the products,
norms, the attention of each row over its own cache row), so a finished or padding row cannot
change a live row's logits.

`native_decode` runs this on CUDA, where a graph runner exists (`MOGRPO_DECODE_GRAPH=0`: the
eager step instead). On a CPU the eager step stays: attending over every column costs more
there, and no launch cost is saved. There the static decode runs when asked for
(`native_decode(..., static=True)`: the tests), through `DirectSteps`, which calls at every
token the same step that a graph captures on CUDA.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor

from mogrpo.rollout.cache_rows import row_moves, shift_rows

# Below this many rows a GPU step should cost about the same at any row count (it reads the
# weights once whatever the rows), while each smaller bucket costs a capture (~3 eager steps:
# two warm-ups and the capture): rows that finish then stay in their bucket. An estimate, not
# yet measured: a GPU run timing rollouts whose rows finish apart, at other values, settles it.
SMALLEST_BUCKET = 16


class StepRunner(Protocol):
    """Runs the static step on a bucket's rows: `runner(bucket)` -> logits [bucket, V], valid
    until the next call; `captured`: the buckets run so far, in the order first run."""

    captured: list[int]

    def __call__(self, bucket: int) -> Tensor: ...


class DirectSteps:
    """A `StepRunner` that calls the step every time (no graph): the static decode on a CPU."""

    def __init__(self, step: Callable[[], Tensor]) -> None:
        self.step = step
        self.captured: list[int] = []

    def __call__(self, bucket: int) -> Tensor:
        if bucket not in self.captured:
            self.captured.append(bucket)
        return self.step()


def bucket_sizes(rows: int, smallest: int = SMALLEST_BUCKET) -> list[int]:
    """The row counts a decode of `rows` rows steps at, largest first: `rows`, then every power
    of two below it down to `smallest`."""
    sizes, size = [rows], 1
    while size < rows:
        size *= 2
    size //= 2
    while size >= smallest and size < rows:
        sizes.append(size)
        size //= 2
    return sizes


def bucket_for(live: int, sizes: list[int]) -> int:
    """The smallest of `sizes` that holds `live` rows."""
    return min(s for s in sizes if s >= live)


class StaticDecoder:
    """`NativeDecoder`'s prefill, step and rows leaving, with the steps on fixed shapes (see the
    module docstring). `decoder`: a `NativeDecoder`, before its prefill. `runner_for(step)`:
    the `StepRunner` of the step (`mogrpo.kernels.graph_runner`'s on CUDA); None: `DirectSteps`.
    `smallest`: the smallest bucket (None: `SMALLEST_BUCKET`)."""

    def __init__(self, decoder: Any,
                 runner_for: Callable[[Callable[[], Tensor]], StepRunner] | None = None,
                 smallest: int | None = None) -> None:
        self.decoder = decoder
        decoder.zero_cache = True  # the step reads every column: see NativeDecoder.zero_cache
        self.runner_for = runner_for
        self.smallest = smallest
        self.sizes: list[int] = []
        self.bucket = 0  # the rows the steps run on: the first `bucket` rows of the cache
        # each live row's row in the cache [n], rising; None: the bucket's rows, all live
        self.slots: Tensor | None = None
        # the cache and the per-row state at the batch's size; the decoder's are their views
        # [:bucket], so every bucket's step reads and writes the same memory
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []
        self.valid = self.positions = torch.empty(0)  # [B, T_max], [B]
        self.tokens = torch.empty(0)  # [B] the token each cache row feeds to the next step
        self.column = torch.empty(0)  # [1] the cache column the next step writes
        self.columns = torch.empty(0)  # [T_max] arange, for the step's mask
        self.runner: StepRunner | None = None

    def prefill(self, prompt_ids: Tensor, prompt_mask: Tensor, max_new_tokens: int) -> Tensor:
        """`NativeDecoder.prefill`; then the static step's buffers, and its runner."""
        d = self.decoder
        logits = d.prefill(prompt_ids, prompt_mask, max_new_tokens)  # [B, V]
        B, device = logits.shape[0], logits.device
        self.keys, self.values, self.valid, self.positions = d.keys, d.values, d.valid, \
            d.positions
        self.sizes = bucket_sizes(B, self.smallest or SMALLEST_BUCKET)
        self.bucket, self.slots = B, None
        # every row feeds a real token id, padding rows too (an id out of range would fault)
        self.tokens = torch.zeros(B, dtype=torch.long, device=device)
        self.column = torch.zeros(1, dtype=torch.long, device=device)
        self.columns = torch.arange(d.keys[0].shape[2], device=device)
        self.runner = (self.runner_for or DirectSteps)(self._step)
        return logits

    def _step(self) -> Tensor:
        """The static step on the current bucket (what a runner captures)."""
        return self.decoder.static_step(self.tokens[:self.bucket], self.column, self.columns)

    def step(self, tokens: Tensor) -> Tensor:
        """Feed one token per live row [n]; their next-token logits [n, V] (for the bucket's
        rows all live: the runner's output itself, overwritten by the next step)."""
        d = self.decoder
        if self.slots is None:
            self.tokens[:self.bucket].copy_(tokens)
        else:
            self.tokens.index_copy_(0, self.slots, tokens)
        self.column.fill_(d.length)
        logits = self.runner(self.bucket)  # [bucket, V]
        d.length += 1
        return logits if self.slots is None else logits.index_select(0, self.slots)

    def keep_unfinished(self, rows: Tensor) -> None:
        """The live rows `rows` (rising) stay; the others are left in place, and the live rows
        move up into a smaller bucket once they fit one."""
        self.slots = rows if self.slots is None else self.slots[rows]
        live = len(self.slots)
        bucket = bucket_for(live, self.sizes)
        if bucket < self.bucket:
            self._compact(bucket)

    def _compact(self, bucket: int) -> None:
        """Move the live rows to the first rows of the cache and step on `bucket` rows."""
        d, slots = self.decoder, self.slots
        live = len(slots)
        moves = row_moves(slots.tolist())
        for cache in (*self.keys, *self.values):
            shift_rows(cache, moves, live, d.length)
        self.valid[:live] = self.valid[slots]
        self.positions[:live] = self.positions[slots]
        self.bucket = bucket
        self.slots = None if live == bucket else torch.arange(live, device=slots.device)
        d.keys = [k[:bucket] for k in self.keys]
        d.values = [v[:bucket] for v in self.values]
        d.valid, d.positions = self.valid[:bucket], self.positions[:bucket]
