"""Data parallelism: what the GRPO update needs so that W processes do the math of one.

Each process scores its own prompts' groups and backpropagates its micro-batches with the loss
divided by the *global* normaliser of the optimizer step (`algo.loss.loss_normalizer` values
are sums — sequences, tokens, sequences × budget — so the global one is the all-reduced sum).
Gradients are then summed (not averaged) over processes, so every process holds the
full-batch gradient and takes the same optimizer step. With one process every call here is a
no-op and nothing touches torch.distributed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist


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
        if self.world_size == 1:
            return value
        total = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return float(total.item())

    def sum_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Replace each gradient by its sum over processes, in one flat all-reduce.

        A parameter without a gradient here (unused in this process's forward passes) takes
        part as zeros and gets the others' sum, so every process ends with the same gradients.
        """
        if self.world_size == 1:
            return
        params = [p for p in params if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for p in params:
            n = p.grad.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n
