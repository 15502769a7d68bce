"""The native engine's decode step replayed from CUDA graphs, one per bucket of rows.

A small model's eager decode step on a GPU is the time Python takes to launch its few hundred
kernels (~11 ms at 0.21 B parameters on an H200, ~100x what reading its weights takes). A CUDA
graph records those launches once and replays them in one call. `GraphedStep` captures the
static step (`NativeDecoder.static_step`, through `rollout/static_decode.py`, which keeps every
shape and address fixed per bucket) at a bucket's first step and replays it at the others; the
graphs of one decode share one memory pool (they never run at once, and the buckets are
captured largest first, as they are met).

The capture (`capture`) is the one part CPUs cannot run: the tests run `GraphedStep` with the
capture replaced by a trace of the step that each replay reruns (tests/unit/test_static_decode.py),
and `benchmarks/gpu_equivalence.py` checks the graphed decode against the eager one on a GPU.
At run time each bucket's first step runs eagerly too, and the graph's first replay must give
the same logits: a replay that differs turns the graphs off for the rest of the process, with
one warning (a wrong graph would sample from another distribution without a sound). A step that
cannot be captured (an operation that waits for the host, say, in a model's own module) runs
eagerly, with one log line, and so do the rest of the process's decodes: a capture that fails
would fail again at every rollout, and each failed capture keeps its memory pool. An
out-of-memory error during a capture is not such a failure: it reaches the trainer, which
halves the batch (`memory.on_oom`). `MOGRPO_DECODE_GRAPH=0` turns the graphs off: the native
engine's eager step runs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

ENV = "MOGRPO_DECODE_GRAPH"  # "0", "off", "false" or "no": the eager step, no graphs
# steps run on a side stream before a capture, as PyTorch's CUDA-graph notes ask: lazy
# initialisation (cuBLAS workspaces for that stream, kernel choices) must not be captured
WARMUP_STEPS = 2

_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)  # torch < 2.5: cuda's
Capture = Callable[[Callable[[], Tensor], object], tuple[Callable[[], object], Tensor, object]]


def disabled() -> bool:
    """Whether MOGRPO_DECODE_GRAPH switches the graphs off, or a replay that differed from the
    eager step did (`distrust`), or a capture failed (`UNCAPTURABLE`)."""
    return DISTRUSTED is not None or UNCAPTURABLE is not None or \
        os.environ.get(ENV, "").strip().lower() in ("0", "off", "false", "no")


def status() -> str:
    """Which decode step a CUDA rollout runs, for `mogrpo doctor env`."""
    if DISTRUSTED is not None:
        return f"eager ({DISTRUSTED})"
    if UNCAPTURABLE is not None:
        return f"eager (the step could not be captured: {UNCAPTURABLE})"
    if disabled():
        return f"eager ({ENV}={os.environ[ENV]})"
    return "CUDA graphs, one per bucket of rows (captured at a rollout's first steps)"


def capture(step: Callable[[], Tensor], pool: object) -> tuple[Callable[[], object], Tensor,
                                                                   object]:
    """(replay, the output tensor a replay refreshes, the memory pool) of `step` captured as a
    CUDA graph in `pool` (None: a new one). The step runs `WARMUP_STEPS` times first on a side
    stream; it must be idempotent (the static step is: it writes the same column from the same
    inputs). `pool` None: the process's shared pool (`_shared`)."""
    side, shared = _shared()
    pool = shared if pool is None else pool
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(WARMUP_STEPS):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # Under mixed precision the capture reads the bf16 copies of the float32 weights from
    # autocast's cache, which the bucket's eager first step (`GraphedStep._first`) filled: the
    # graph then reads 2 bytes a weight each step, where a capture without the cache would
    # replay every cast (read 4, write 2, read 2). The cache lives as long as the caller's
    # autocast context, which holds the whole decode, and the graphs are the decode's only.
    #
    # Not `torch.cuda.graph(...)`: it empties the allocator's cache before every capture (each
    # bucket of each rollout, and the update after the rollout then takes its memory from the
    # driver again), and when ending a broken capture raises it leaves the thread on the
    # capture's stream, so that the training after it would run there. Without that emptying,
    # the memory of a dropped graph's pool goes back only when the allocator is emptied: so
    # every capture of the process takes one pool and one stream (`_shared`), the graphs of a
    # new decode reusing the blocks of the last one's (only the live decode's graphs replay,
    # one at a time, in the order they were captured), and a pool block is reused only on the
    # stream it was allocated on.
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        # thread_local: another thread's CUDA calls (a server's, a judge's) do not break it
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            out = step()
        finally:
            graph.capture_end()
    return graph.replay, out, graph.pool()


_SHARED: tuple[torch.cuda.Stream, object] | None = None


def _shared() -> tuple[torch.cuda.Stream, object]:
    """(The side stream every capture warms up and captures on, the memory pool every graph
    allocates from), made at the process's first capture."""
    global _SHARED
    if _SHARED is None:
        _SHARED = (torch.cuda.Stream(), torch.cuda.graph_pool_handle())
    return _SHARED


class GraphedStep:
    """A `StepRunner` (`rollout/static_decode.py`): `runner(bucket)` replays the step's graph
    for that bucket, captured at its first call; the logits [bucket, V] it returns are the
    graph's output, refreshed by each replay."""

    def __init__(self, step: Callable[[], Tensor], capture: Capture = capture) -> None:
        self.step = step
        self.capture = capture
        self.graphs: dict[int, tuple[Callable[[], object], Tensor]] = {}
        self.pool: object = None
        self.failed: str | None = None  # why a capture failed: the steps then run eagerly

    @property
    def captured(self) -> list[int]:
        """The buckets captured, in order."""
        return list(self.graphs)

    def __call__(self, bucket: int) -> Tensor:
        if self.failed is not None or DISTRUSTED or UNCAPTURABLE:
            return self.step()
        found = self.graphs.get(bucket)
        if found is None:
            return self._first(bucket)
        replay, out = found
        replay()
        return out

    def _first(self, bucket: int) -> Tensor:
        """A bucket's first step: the eager step, then the capture, whose first replay must
        give the eager step's logits (the step is idempotent: same inputs, same column)."""
        expected = self.step().clone()
        try:
            replay, out, self.pool = self.capture(self.step, self.pool)
        except RuntimeError as err:
            # the trainer's to handle (a smaller batch, not the eager step), also where ending
            # the broken capture raised in its turn
            oom = next((e for e in (err, err.__context__) if isinstance(e, _OOM)), None)
            if oom is not None:
                raise oom from None
            self.failed = str(err).strip().splitlines()[0] if str(err).strip() else repr(err)
            uncapturable(self.failed)
            return expected
        replay()  # a capture runs nothing: the first step of a bucket is a replay too
        wrong = disagreement(out, expected)
        if wrong is not None:
            distrust(f"a replay of bucket {bucket} differed from the eager step ({wrong})")
            self.failed = DISTRUSTED
            return expected
        self.graphs[bucket] = (replay, out)
        return out


DISTRUSTED: str | None = None
"""Why this process stopped replaying graphs (a replay that differed from the eager step)."""
UNCAPTURABLE: str | None = None
"""Why this process stopped capturing graphs (the first line of a capture's error)."""


def uncapturable(reason: str) -> None:
    """Capture no more graphs in this process, with one warning."""
    global UNCAPTURABLE
    UNCAPTURABLE = reason
    logger.warning("the decode step could not be captured as a CUDA graph (%s): it runs "
                   "eagerly for the rest of this process", reason)


def distrust(reason: str) -> None:
    """Turn the graphs off for the rest of the process, with one warning."""
    global DISTRUSTED
    DISTRUSTED = reason
    logger.warning("CUDA-graphed decode off for the rest of this process: %s; the eager step "
                   "runs (please report this with `mogrpo doctor env`)", reason)


def disagreement(out: Tensor, expected: Tensor) -> str | None:
    """None where a replay's logits equal the eager step's (to float32's or, in 16-bit dtypes,
    to 1e-3 of the largest logit: kernels may pick other reduction orders in a graph); else
    the largest difference."""
    if out.shape != expected.shape:
        return f"shape {tuple(out.shape)} against {tuple(expected.shape)}"
    scale = float(expected.float().abs().nan_to_num(posinf=0, neginf=0).max().clamp(min=1))
    tol = 1e-5 * scale if out.dtype == torch.float32 else 1e-3 * scale
    diff = (out.float() - expected.float()).abs().nan_to_num(nan=float("inf"))
    both = out.float().isnan() & expected.float().isnan()
    worst = float(diff.masked_fill(both | (out == expected), 0).max()) if diff.numel() else 0.0
    return None if worst <= tol else f"largest difference {worst:.3g}, allowed {tol:.3g}"
