"""One data-parallel process of the world-size test, run by torchrun (see test_distributed.py).

`gradients(rows, dist)` is the GRPO update's math on a fixed batch: this process's rows in
micro-batches of two, each loss divided by the step's global normaliser (summed over
processes), gradients summed over processes. The test compares two processes splitting the
rows unevenly with one process holding all of them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as torch_dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: grpo_batch
from grpo_batch import make_batch  # noqa: E402
from mogrpo.algo.logprobs import token_logprobs
from mogrpo.algo.loss import grpo_loss, loss_normalizer
from mogrpo.train.distributed import Dist

SHARDS = {0: [0], 1: [1, 2, 3, 4]}  # uneven on purpose: 1 row and 4 rows
BUDGET = 8


def gradients(rows: list[int], dist: Dist, aggregation: str) -> list[torch.Tensor]:
    model, data = make_batch()
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
    mine = {"step": 7, "lr": 1e-5, "loss": 0.25 * (dist.rank + 1), "rollout/groups": 2 + dist.rank,
            "time/step_s": 1.0 + dist.rank, "task/a/beta": 0.04, "kl": 0.1 * (dist.rank + 1),
            **({"task/b/kl": 0.5} if dist.rank == 1 else {})}
    (out / f"metrics-rank{dist.rank}.json").write_text(json.dumps(dist.reduce_metrics(mine)))
    torch_dist.destroy_process_group()


if __name__ == "__main__":
    main()
