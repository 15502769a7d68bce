"""One data-parallel process of the world-size test, run by torchrun (see test_distributed.py).

`gradients(rows, dist)` is the GRPO update's math on a fixed batch: this process's rows in
micro-batches of two, each loss divided by the step's global normaliser (summed over
processes), gradients summed over processes. The test compares two processes splitting the
rows unevenly with one process holding all of them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as torch_dist
from torch import nn

from mogrpo.algo.logprobs import token_logprobs
from mogrpo.algo.loss import grpo_loss, loss_normalizer
from mogrpo.train.distributed import Dist

V, D, B, T = 11, 6, 5, 7
LENGTHS = [7, 2, 5, 1, 4]
SHARDS = {0: [0], 1: [1, 2, 3, 4]}  # uneven on purpose: 1 row and 4 rows
BUDGET = 8


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D, dtype=torch.float64)
        self.head = nn.Linear(D, V, dtype=torch.float64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(ids)))


def setup() -> tuple[TinyLM, dict[str, torch.Tensor]]:
    """The same model and batch in every process (seeded)."""
    g = torch.Generator().manual_seed(0)
    model = TinyLM()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
    inputs = torch.randint(0, V, (B, T), generator=g)
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.arange(T) < torch.tensor(LENGTHS)[:, None]).long()
    with torch.no_grad():
        logp = token_logprobs(model(inputs), targets)
    return model, {
        "inputs": inputs, "targets": targets, "mask": mask,
        "old_logp": logp + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64),
        "ref_logp": logp + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64),
        "advantages": torch.tensor([1.0, -0.7, 0.4, -1.3, 0.9], dtype=torch.float64),
        "beta": torch.tensor([0.05, 0.2, 0.0, 0.1, 0.3], dtype=torch.float64),
    }


def gradients(rows: list[int], dist: Dist, aggregation: str) -> list[torch.Tensor]:
    model, data = setup()
    idx = torch.tensor(rows)
    normalizer = dist.sum(loss_normalizer(data["mask"][idx], aggregation, BUDGET))
    for start in range(0, len(rows), 2):
        micro = idx[start:start + 2]
        logp = token_logprobs(model(data["inputs"][micro]), data["targets"][micro])
        out = grpo_loss(logp, data["old_logp"][micro], data["advantages"][micro],
                        data["mask"][micro], normalizer=normalizer, aggregation=aggregation,
                        ref_logp=data["ref_logp"][micro], beta=data["beta"][micro],
                        kl_importance_weight=True)
        out.loss.backward()
    params = list(model.parameters())
    dist.sum_gradients(params)
    return [p.grad.detach().clone() for p in params]


def main() -> None:
    out, aggregations = Path(sys.argv[1]), sys.argv[2:]
    torch_dist.init_process_group("gloo")
    dist = Dist.current()
    for aggregation in aggregations:
        grads = gradients(SHARDS[dist.rank], dist, aggregation)
        torch.save({"grads": grads, "world_size": dist.world_size},
                   out / f"{aggregation}-rank{dist.rank}.pt")
    torch_dist.destroy_process_group()


if __name__ == "__main__":
    main()
