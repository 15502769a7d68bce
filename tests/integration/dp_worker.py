"""One data-parallel process of the world-size test, run by torchrun (see test_distributed.py).

`gradients(rows, parallel)` is the GRPO update's math on a fixed batch: this process's rows in
micro-batches of two, each loss divided by the step's global normaliser (summed over
processes, `Dist.sum`), only the last micro-batch syncing — the gradients are reduced by the
engine (DDP or FSDP2), as in `GRPOTrainer.update`. The test compares two processes splitting
the rows unevenly (1 micro-batch and 2) with one process holding all of them; process 1 starts
from other weights, which the engine replaces by process 0's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: grpo_batch
from grpo_batch import make_batch  # noqa: E402
from mogrpo.algo.logprobs import token_logprobs
from mogrpo.algo.loss import grpo_loss, loss_normalizer
from mogrpo.config.sections import DistributedConfig
from mogrpo.trainer.distributed import Dist, process_group
from mogrpo.trainer.parallel import ParallelPolicy, shard

SHARDS = {0: [0], 1: [1, 2, 3, 4]}  # uneven on purpose: 1 row and 4 rows
BUDGET = 8


def wrap(model: torch.nn.Module, strategy: str, dist: Dist) -> ParallelPolicy:
    """The model under `strategy` (none: as it is), as `mogrpo.trainer.parallel` wraps a policy."""
    if strategy == "ddp":
        return ParallelPolicy(model, "ddp", dist, DistributedDataParallel(model))
    if strategy == "fsdp":
        sharded = shard(model, DistributedConfig(strategy="fsdp"), dist, layers=[model.emb])
        return ParallelPolicy(model, "fsdp", dist, sharded=sharded)
    return ParallelPolicy(model)


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def gradients(rows: list[int], dist: Dist, aggregation: str, strategy: str = "none",
              perturb: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(the weights once wrapped, the gradients after one accumulated backward), whole."""
    model, data = make_batch()
    if perturb:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    parallel = wrap(model, strategy, dist)
    start = [full(p).detach().clone() for p in model.parameters()]
    idx = torch.tensor(rows)
    normalizer = dist.sum(loss_normalizer(data["mask"][idx], aggregation, BUDGET))
    micro = [idx[s:s + 2] for s in range(0, len(rows), 2)]
    plan = parallel.pad(micro)
    for i, part in enumerate(plan):
        parallel.sync_gradients(last=i == len(plan) - 1)
        if part is None:
            parallel.idle_backward(lambda: token_logprobs(parallel.module(data["inputs"][idx[:1]]),
                                                          data["targets"][idx[:1]]))
            continue
        logp = token_logprobs(parallel.module(data["inputs"][part]), data["targets"][part])
        out = grpo_loss(logp, data["old_logp"][part], data["advantages"][part],
                        data["mask"][part], normalizer=normalizer, aggregation=aggregation,
                        ref_logp=data["ref_logp"][part], beta=data["beta"][part],
                        kl_importance_weight=True)
        parallel.backward(out.loss)
    return start, [full(p.grad).detach().clone() for p in model.parameters()]


def main() -> None:
    out, aggregations = Path(sys.argv[1]), sys.argv[2:]
    with process_group("cpu") as dist:
        for strategy in ("ddp", "fsdp"):
            for aggregation in aggregations:
                start, grads = gradients(SHARDS[dist.rank], dist, aggregation, strategy,
                                         perturb=dist.rank == 1)
                torch.save({"grads": grads, "start": start, "world_size": dist.world_size},
                           out / f"{strategy}-{aggregation}-rank{dist.rank}.pt")
        mine = {"step": 7, "lr": 1e-5, "loss": 0.25 * (dist.rank + 1),
                "rollout/groups": 2 + dist.rank, "time/step_s": 1.0 + dist.rank,
                "task/a/beta": 0.04, "kl": 0.1 * (dist.rank + 1),
                **({"task/b/kl": 0.5} if dist.rank == 1 else {})}
        (out / f"metrics-rank{dist.rank}.json").write_text(
            json.dumps(dist.reduce_metrics(mine)))

if __name__ == "__main__":
    main()
