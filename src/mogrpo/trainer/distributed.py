"""Data parallelism: the process group, and the numbers W processes must share to do the
math of one.

Each process scores its own prompts' groups and backpropagates its micro-batches with the loss
divided by the *global* normaliser of the optimizer step (`algo.loss.loss_normalizer` values
are sums — sequences, tokens, sequences × budget — so the global one is the all-reduced sum,
`Dist.sum`). Gradients and weights are never communicated here: PyTorch's DDP or FSDP2 sum
the gradients and start every process from process 0's weights (`mogrpo.trainer.parallel`).
Metrics are combined here (`reduce_metrics`). With one process every call is a no-op and
nothing touches torch.distributed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mogrpo.tracking import names


@dataclass(frozen=True)
class Dist:
    """This process's place in the process group (world size 1 without torch.distributed)."""

    rank: int = 0
    world_size: int = 1

    @classmethod
    def current(cls) -> Dist:
        """The initialised default process group, or a single process."""
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that writes checkpoints, logs and metrics."""
        return self.rank == 0

    def sum(self, value: float) -> float:
        """`value` summed over all processes (float64, so token counts stay exact)."""
        return self._all_reduce(value, dist.ReduceOp.SUM) if self.world_size > 1 else value

    def max(self, value: int) -> int:
        """The largest `value` of all processes."""
        return int(self._all_reduce(value, dist.ReduceOp.MAX)) if self.world_size > 1 else value

    @staticmethod
    def _all_reduce(value: float, op: Any) -> float:
        total = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(total, op=op)
        return float(total.item())

    def shard(self, items: list) -> list:
        """This process's share of a list every process drew alike (interleaved)."""
        return items[self.rank::self.world_size]

    def reduce_metrics(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """One step's metrics from every process, combined the same way in each of them.

        Counts and the loss (each process's part of one sum; a judge's calls, failures and
        budget spent) add up, timings and memory take
        the slowest process, settings every process shares (step, lr, β, weights) keep
        theirs, and everything else — means over a process's completions — is averaged over
        the processes that report it.
        """
        if self.world_size == 1:
            return metrics
        gathered: list[dict[str, Any]] = self.gather(metrics)
        keys: list[str] = []
        for part in gathered:
            keys.extend(k for k in part if k not in keys)
        out: dict[str, Any] = {}
        for key in keys:
            values = [part[key] for part in gathered if key in part]
            numbers = [v for v in values if isinstance(v, int | float)]
            if len(numbers) != len(values) or key in _SHARED or key.endswith(_SHARED_SUFFIXES):
                out[key] = values[0]
            elif key in _SUMMED or _judge_count(key):
                out[key] = sum(numbers)
            elif key in _LARGEST:
                out[key] = max(numbers)
            else:
                out[key] = sum(numbers) / len(numbers)
        return out

    def gather(self, value: Any) -> list[Any]:
        """`value` from every process, in rank order (a JSON-able object)."""
        if self.world_size == 1:
            return [value]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value)
        return out

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()


# How each metric combines over processes: summed, the same everywhere (process 0's), the
# largest (times, memory); any other is the mean of the processes' values.
_SUMMED = {names.LOSS, names.GROUPS, names.PROMPT_TRUNCATED, names.NONFINITE_LOGITS,
           names.TOKENS_PER_S, *names.DYNAMIC_SAMPLING_COUNTS}
_SHARED = {names.STEP, names.LR, names.GRAD_NORM, names.UPDATE_NORM, names.SKIPPED_UPDATES}
_SHARED_SUFFIXES = ("/" + names.TASK_BETA.suffix, "/" + names.OBJECTIVE_WEIGHT.stat)
_LARGEST = {names.TIME_ROLLOUT, names.TIME_REWARD, names.TIME_UPDATE, names.TIME_STEP,
            names.PEAK_GIB}
_JUDGE_AVERAGED = ("/failed_frac", "/cache_frac", "/wall_s", "/latency_p50_s",
                   "/latency_p95_s")


def _judge_count(key: str) -> bool:
    """A judge's count (`task/T/judge/L/calls`, `.../errors/timeout`, `.../budget/calls`):
    each process judges its own completions, so the counts add up (fractions, times do not)."""
    parts = key.split("/")
    return len(parts) >= 5 and parts[0] + "/" == names.TASK_PREFIX and parts[2] == "judge" \
        and not key.endswith(_JUDGE_AVERAGED)


def weights_checksum(model: torch.nn.Module) -> float:
    """A float64 sum of every trainable weight: equal in processes that hold equal weights."""
    with torch.no_grad():
        return float(sum(p.detach().double().sum().item() for p in model.parameters()
                         if p.requires_grad))


DRAIN_S = 0.5  # how long gloo's worker threads get the GIL after the last collective


def backend(cuda: bool) -> str:
    """The process group's backends: gloo on CPUs; on GPUs NCCL for CUDA tensors and gloo for
    host ones. A run's own numbers (`Dist.sum`: loss normalisers, `Dist.max`) are host scalars,
    and FSDP2 with `cpu_offload` reduces host-resident gradients (its clipping norm): NCCL
    alone takes only CUDA tensors ("No backend type associated with device type cpu")."""
    return "cpu:gloo,cuda:nccl" if cuda else "gloo"


@contextmanager
def process_group(device: str) -> Iterator[Dist]:
    """The process group torchrun describes, held for the length of a run (a single process
    without torchrun).

    Joined on entry, unless the caller joined it already (then it is theirs and stays). Left on
    a clean exit, after a barrier so that no process closes its connections while another still
    uses them. Then the GIL is let go for a moment (`DRAIN_S`): gloo's worker threads free a
    finished collective's tensors after the caller has seen it complete, which needs the GIL,
    and a worker thread that asks for it once the interpreter is shutting down aborts the
    process ("terminate called without an active exception", SIGABRT) after a run that had
    finished. After an error the group is not destroyed (destroying may wait for a peer that
    failed); the process exits and torchrun stops the others."""
    joining = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized()
    if joining:
        cuda = device != "cpu" and torch.cuda.is_available()
        if cuda:  # one GPU per process (LOCAL_RANK)
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend(cuda))
    yield Dist.current()
    if joining and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        time.sleep(DRAIN_S)
