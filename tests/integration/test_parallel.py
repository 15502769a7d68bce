"""DDP and FSDP2 do the math of one process (DESIGN 7: "World size 1 and 2 produce the same
math, tested on CPU").

parallel_worker.py runs the GRPO trainer's own `reference_logprobs` + `update` for 3 optimizer
steps (× μ) on fixed global batches, once in one process and once in 2 gloo processes under
each strategy; the 2 processes split the 3 prompts unevenly (2 micro-batches and 1), and
process 1 starts from other weights, which the engine must replace by process 0's.

Slow (~60 s on 2 cores: two torchrun launches, 26 wrapped models): `pytest -m slow
tests/integration/test_parallel.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from parallel_worker import SETTINGS, case_name

from multiproc import torchrun

pytestmark = pytest.mark.slow
WORKER = Path(__file__).with_name("parallel_worker.py")


@pytest.fixture(scope="module")
def results(tmp_path_factory, tiny_model) -> Path:
    out = tmp_path_factory.mktemp("parallel")
    for n in (1, 2):
        torchrun(str(WORKER), str(out), str(tiny_model), nproc=n, timeout=600)
    return out


def load(out: Path, setting: tuple, strategy: str) -> dict:
    return torch.load(out / f"{case_name(*setting)}-{strategy}.pt", weights_only=False)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def flat(weights: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([weights[k].double().flatten() for k in sorted(weights)])


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("setting", SETTINGS, ids=[case_name(*s) for s in SETTINGS])
def test_two_processes_train_like_one(results, setting, strategy):
    one, two = load(results, setting, "none"), load(results, setting, strategy)
    assert (one["strategy"], two["strategy"]) == ("none", strategy)
    # 2 micro-batches in process 0 and 1 in process 1: FSDP2 pads, DDP syncs each once
    assert two["micro_batches"] == [[2, 2, 2], [1, 1, 1]]
    assert one["micro_batches"] == [[3, 3, 3]]
    losses = torch.tensor(two["losses"]), torch.tensor(one["losses"])
    assert rel_err(*losses) <= 1e-5 and losses[1].abs().min() > 0
    assert rel_err(torch.tensor(two["grad_norms"]), torch.tensor(one["grad_norms"])) <= 1e-5
    # how far the weights moved (FSDP2: each process's shard, the squares summed over processes)
    updates = torch.tensor(two["update_norms"]), torch.tensor(one["update_norms"])
    assert rel_err(*updates) <= 1e-5 and updates[1].min() > 0
    assert sorted(two["weights"]) == sorted(one["weights"])
    assert rel_err(flat(two["weights"]), flat(one["weights"])) <= 1e-5


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_training_moved_the_weights(results, strategy):
    # LoRA B starts at 0: it moved, so the equality above is between trained weights
    setting = ("token_mean", 2, True)
    one, two = load(results, setting, "none"), load(results, setting, strategy)
    lora_b = [k for k in one["weights"] if "lora_B" in k]
    assert lora_b and all(one["weights"][k].abs().max() > 0 for k in lora_b)
    assert rel_err(flat(two["weights"]), flat(one["weights"])) <= 1e-5


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("setting", [SETTINGS[0], SETTINGS[-1]], ids=["full", "lora"])
def test_greedy_generation_is_that_of_one_process(results, setting, strategy):
    # native (submodules called directly) and hf generate(), FSDP2 weights gathered
    one, two = load(results, setting, "none"), load(results, setting, strategy)
    for engine in ("native", "hf"):
        assert torch.equal(two[f"greedy_{engine}"], one[f"greedy_{engine}"]), engine


@pytest.mark.parametrize("setting", [SETTINGS[0], SETTINGS[-1]], ids=["full", "lora"])
def test_fsdp_holds_half_of_weights_grads_and_adam_state(results, setting):
    local = load(results, setting, "fsdp")["local"]
    full = local["full"]  # trainable elements of the whole model
    assert local["params"] == pytest.approx(full / 2, rel=0.02)
    assert local["grads"] == pytest.approx(full / 2, rel=0.02)
    assert local["adam"] == pytest.approx(full, rel=0.02)  # two moments, each half
    assert "local" not in load(results, setting, "ddp")  # DDP replicates: nothing to measure
