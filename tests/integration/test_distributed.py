"""World size 2 does the math of world size 1 (DESIGN: "tested on CPU with 2 processes"), on
PyTorch's engines: no gradient all-reduce or parameter broadcast of mogrpo's own.

Two processes started by torchrun (gloo) split a batch unevenly (1 row and 4 rows, so 1
micro-batch and 2), the normaliser summed over the processes (`Dist.sum`), the gradients
reduced by DDP or FSDP2. Every process must end with the full-batch gradient of a single
process, for every loss aggregation (what the removed `Dist.sum_gradients` did), and start from
process 0's weights although process 1 loaded others (what `Dist.broadcast_parameters` did)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dp_worker import SHARDS, gradients

from mogrpo.algo.choices import LOSS_AGGREGATIONS
from mogrpo.trainer.distributed import Dist
from multiproc import torchrun

WORKER = Path(__file__).with_name("dp_worker.py")
STRATEGIES = ("ddp", "fsdp")


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp")
    torchrun(str(WORKER), str(out), *LOSS_AGGREGATIONS)
    return out


def saved(out: Path, strategy: str, aggregation: str, rank: int) -> dict:
    return torch.load(out / f"{strategy}-{aggregation}-rank{rank}.pt", weights_only=True)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS)
def test_two_processes_hold_the_single_process_gradient(two_processes, strategy, aggregation):
    _, single = gradients([0, 1, 2, 3, 4], Dist(), aggregation)
    for rank in (0, 1):
        got = saved(two_processes, strategy, aggregation, rank)
        assert got["world_size"] == 2
        for g, want in zip(got["grads"], single, strict=True):
            assert torch.allclose(g, want, rtol=1e-12, atol=1e-14), (rank, strategy, aggregation)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_process_starts_from_process_0s_weights(two_processes, strategy):
    loaded, _ = gradients([0], Dist(), "token_mean")  # what process 0 loaded
    other, _ = gradients([0], Dist(), "token_mean", perturb=True)  # what process 1 loaded
    assert not any(torch.equal(a, b) for a, b in zip(loaded, other, strict=True))
    for rank in (0, 1):
        start = saved(two_processes, strategy, "token_mean", rank)["start"]
        assert all(torch.equal(a, b) for a, b in zip(start, loaded, strict=True)), rank


def test_without_the_engine_each_process_would_hold_only_its_part(two_processes):
    # process 1's rows alone, not reduced: its gradient differs from the full-batch one
    _, part = gradients(SHARDS[1], Dist(), "token_mean")
    _, single = gradients([0, 1, 2, 3, 4], Dist(), "token_mean")
    assert not all(torch.allclose(a, b) for a, b in zip(part, single, strict=True))


def test_metrics_are_combined_alike_in_every_process(two_processes):
    combined = [json.loads((two_processes / f"metrics-rank{r}.json").read_text()) for r in (0, 1)]
    assert combined[0] == combined[1]
    assert combined[0] == pytest.approx({
        "step": 7, "lr": 1e-5, "task/a/beta": 0.04,  # shared settings: kept
        "loss": 0.75, "rollout/groups": 5,  # parts of one sum: added
        "time/step_s": 2.0,  # the slowest process
        "kl": 0.15,  # a mean over completions: averaged
        "task/b/kl": 0.5,  # only one process had task b's prompts: its value
    })


def test_one_process_is_a_no_op():
    dist = Dist.current()
    assert (dist.rank, dist.world_size, dist.is_main) == (0, 1, True)
    assert dist.sum(3.5) == 3.5
