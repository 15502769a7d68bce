"""`mogrpo train` under torchrun with 2 CPU processes (gloo): one run, one set of weights.

Each process samples its share of every step's prompts; the normaliser, gradients and metrics
are combined over both. Process 0 writes the run directory, process 1 keeps its own files in
`.rank-1` — so the two can be compared line by line."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from mogrpo.demo import demo_base
from multiproc import torchrun

USER_REWARDS = Path(__file__).with_name("user_rewards.py")
TIMING = ("time/", "throughput/", "memory/")


def write_config(tmp_path: Path, model: Path, name: str, steps: int, **train) -> Path:
    config = demo_base()
    config["model"]["name_or_path"] = str(model)
    config["output"] = {"dir": str(tmp_path / name), "save_every": 1, "keep_last": 0}
    config["lora"] = {"enabled": True, "r": 4, "alpha": 8}
    for task in config["tasks"].values():
        task["data"] += "?size=60"
        task["eval_size"] = 4
        task["rewards"].append({"fn": f"{USER_REWARDS}:distinct_chars", "name": "distinct"})
    config["train"].update(max_steps=steps, micro_batch_size=4, gradient_accumulation_steps=2,
                           learning_rate=5e-3, warmup_steps=0, **train)
    config["rollout"].update(num_generations=4)
    config["sft"].update(steps=2, batch_size=4)
    config["eval"].update(max_samples=4, every_steps=0)
    config["logging"] = {"progress_bar": False}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def train(config: Path, *args: str, check: bool = True,
          env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node 2 -m mogrpo.cli train CONFIG ARGS`."""
    return torchrun("-m", "mogrpo.cli", "train", str(config), *args, timeout=600, check=check,
                    env=env)


def lines(path: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(x).items() if not k.startswith(TIMING)}
            for x in path.read_text().splitlines() if '"event"' not in x]


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    """The final model's parameters, loaded with plain transformers."""
    return final_weights_of(run / "final" / "model")


def final_weights_of(model_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    return {k: v.detach() for k, v in model.named_parameters()}


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return load_file(checkpoint / "weights.safetensors")


@pytest.fixture(scope="module")
def whole(tmp_path_factory, tiny_model):
    tmp = tmp_path_factory.mktemp("torchrun")
    train(write_config(tmp, tiny_model, "whole", 3))
    return tmp / "whole"


def test_two_processes_train_one_model(whole):
    main, other = lines(whole / "metrics.jsonl"), lines(whole / ".rank-1" / "metrics.jsonl")
    assert [m["step"] for m in main] == [1, 2, 3]
    assert other == main  # every process saw the same combined numbers
    assert {m["rollout/groups"] for m in main} == {2}  # 1 prompt per process, 2 per step
    assert any(m["loss"] != 0 for m in main)
    # process 1's checkpoints hold its state and RNG; weights and optimizer are process 0's
    own, shared = whole / ".rank-1" / "checkpoints" / "step-0000003", \
        whole / "checkpoints" / "step-0000003"
    manifest = json.loads((own / "manifest.json").read_text())
    assert manifest["shared"] == ["weights.safetensors", "optimizer.pt"]
    assert not (own / "weights.safetensors").exists() and (own / "rng.safetensors").exists()
    sums = [json.loads((d / "trainer_state.json").read_text())["weights_checksum"]
            for d in (shared, own)]
    assert sums[0] == sums[1]  # both processes held the same weights when they saved
    mine = weights(shared)
    first = weights(whole / "checkpoints" / "step-0000001")
    assert not all(torch.equal(first[k], mine[k]) for k in mine)  # it trained
    assert (whole / "final" / "adapter" / "adapter_config.json").is_file()
    assert not (whole / ".rank-1" / "final").exists()  # one final model, from process 0


def test_resume_under_torchrun_continues_exactly(whole, tmp_path, tiny_model):
    config = write_config(tmp_path, tiny_model, "cut", 2)
    train(config)
    train(config, "--resume", "auto", "--set", "train.max_steps=3")
    assert lines(tmp_path / "cut" / "metrics.jsonl") == lines(whole / "metrics.jsonl")
    a = weights(tmp_path / "cut" / "checkpoints" / "step-0000003")
    b = weights(whole / "checkpoints" / "step-0000003")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow  # one more torchrun run (~45 s)
def test_resume_under_torchrun_says_which_process_checkpoint_it_passed_over(whole, tmp_path):
    """Process 1's newest checkpoint damaged: the resume goes back to the step before, and
    (as with one process) says which file of which process made it skip the newest."""
    run = tmp_path / "run"
    shutil.copytree(whole, run)
    data = yaml.safe_load((whole.parent / "whole.yaml").read_text())
    data["output"]["dir"] = str(run)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(data))
    rng = run / ".rank-1" / "checkpoints" / "step-0000003" / "rng.safetensors"
    rng.write_bytes(rng.read_bytes()[:-10])
    done = train(config, "--resume", "auto")
    assert "skipping checkpoint step-0000003 of process 1 (corrupt): rng.safetensors has" \
        in done.stderr
    assert "(step 2)" in done.stderr  # resuming from step-0000002
    assert lines(run / "metrics.jsonl") == lines(whole / "metrics.jsonl")


def test_a_step_that_does_not_split_is_refused(tmp_path, tiny_model):
    config = write_config(tmp_path, tiny_model, "odd", 1)
    data = yaml.safe_load(config.read_text())
    data["train"]["gradient_accumulation_steps"] = 3  # 12 completions = 3 prompts per step
    config.write_text(yaml.safe_dump(data))
    done = train(config, check=False)
    assert done.returncode != 0
    assert "3 prompts per step do not split over 2 processes" in done.stderr


# ---------------------------------------------------------------- FSDP2 (distributed.strategy)

def full_finetune(tmp_path: Path, model: Path, name: str, steps: int, strategy: str) -> Path:
    """The example config without LoRA: the frozen reference is a copy (sharded under FSDP2)."""
    path = write_config(tmp_path, model, name, steps)
    data = yaml.safe_load(path.read_text())
    data["lora"] = {"enabled": False}
    data["distributed"] = {"strategy": strategy}
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, tiny_model):
    tmp = tmp_path_factory.mktemp("fsdp")
    train(full_finetune(tmp, tiny_model, "fsdp", 3, "fsdp"))
    train(full_finetune(tmp, tiny_model, "ddp", 3, "ddp"))
    return tmp


def test_fsdp_run_is_one_run_and_matches_ddp(sharded):
    run = sharded / "fsdp"
    main, other = lines(run / "metrics.jsonl"), lines(run / ".rank-1" / "metrics.jsonl")
    assert [m["step"] for m in main] == [1, 2, 3] and other == main
    assert any(m["loss"] != 0 for m in main) and main[-1]["kl"] > 0  # it trained, off the ref
    # the same config under DDP: the same numbers (FSDP2 sums its shards' gradients alike)
    ddp = lines(sharded / "ddp" / "metrics.jsonl")
    for got, want in zip(main, ddp, strict=True):
        assert got == pytest.approx(want, rel=1e-4, abs=1e-7)
    evals = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["tag"] for e in evals] == ["start", "end"]  # one process's evals, once each
    assert "finished: 3 of 3 steps" in (run / "report.md").read_text()
    # one checkpoint: each process wrote its shard and RNGs, one manifest covers them all
    checkpoint = run / "checkpoints" / "step-0000003"
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert (manifest["format"], manifest["world_size"], manifest["strategy"]) == ("dcp", 2, "fsdp")
    assert {"dcp/__0_0.distcp", "dcp/__1_0.distcp", "dcp/.metadata", "rng/rank-00000.safetensors",
            "rng/rank-00001.safetensors"} <= set(manifest["files"])
    assert not (run / ".rank-1" / "checkpoints").exists()
    # the final model is an ordinary Hugging Face folder holding DDP's step-3 weights
    want = weights(sharded / "ddp" / "checkpoints" / "step-0000003")
    got = final_weights(run)
    assert sorted(got) == sorted(want)
    assert all(torch.allclose(got[k], want[k], rtol=1e-4, atol=1e-6) for k in want)
    assert not (run / ".rank-1" / "final").exists()


@pytest.mark.slow  # two more torchrun runs (~40 s on 2 cores)
def test_fsdp_resume_continues_exactly(sharded, tmp_path, tiny_model):
    config = full_finetune(tmp_path, tiny_model, "fsdp", 2, "fsdp")
    train(config)
    train(config, "--resume", "auto", "--set", "train.max_steps=3")
    assert lines(tmp_path / "fsdp" / "metrics.jsonl") == lines(sharded / "fsdp" / "metrics.jsonl")
    a, b = final_weights(tmp_path / "fsdp"), final_weights(sharded / "fsdp")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow  # three torchrun runs (~60 s on 2 cores)
def test_fsdp_sigkill_of_one_process_mid_update_then_restart_reaches_the_same_weights(
        tmp_path, tiny_model):
    def config(name: str) -> Path:
        path = full_finetune(tmp_path, tiny_model, name, 3, "fsdp")
        data = yaml.safe_load(path.read_text())
        for task in data["tasks"].values():
            task["rewards"].append({"fn": f"{USER_REWARDS}:kill_in_update", "weight": 0.0})
        path.write_text(yaml.safe_dump(data))
        return path

    train(config("whole"))
    cut = config("cut")
    # process 1 kills itself in the first forward of the update after its 3rd scoring (step 2
    # or 3: it scores one or both tasks a step); torchrun then stops process 0
    done = train(cut, check=False, env={"KILL_IN_UPDATE_CALL": "3", "KILL_RANK": "1"})
    assert done.returncode != 0
    assert 1 <= len(lines(tmp_path / "cut" / "metrics.jsonl")) < 3
    train(cut, "--resume", "auto")
    assert lines(tmp_path / "cut" / "metrics.jsonl") == lines(tmp_path / "whole" / "metrics.jsonl")
    a, b = final_weights(tmp_path / "cut"), final_weights(tmp_path / "whole")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_fsdp_bf16_mixed_precision_trains_float32_shards(sharded, tmp_path, tiny_model):
    config = full_finetune(tmp_path, tiny_model, "bf16", 3, "fsdp")
    data = yaml.safe_load(config.read_text())
    data["distributed"]["mixed_precision"] = "bf16"
    config.write_text(yaml.safe_dump(data))
    train(config)
    got, fp32 = lines(tmp_path / "bf16" / "metrics.jsonl"), lines(sharded / "fsdp" / "metrics.jsonl")
    assert [m["step"] for m in got] == [1, 2, 3]
    assert all(math.isfinite(m["loss"]) and math.isfinite(m["policy/grad_norm"]) for m in got)
    # bf16 matmuls: near the float32 run's numbers, not equal to them
    assert got[0]["policy/grad_norm"] == pytest.approx(fp32[0]["policy/grad_norm"], rel=0.05)
    assert got[0]["policy/grad_norm"] != fp32[0]["policy/grad_norm"]
    final = final_weights(tmp_path / "bf16")  # the shards and the saved model stay float32
    assert {w.dtype for w in final.values()} == {torch.float32}
    start = final_weights_of(tiny_model)
    assert any(not torch.equal(final[k], start[k]) for k in start)  # it trained


def test_fsdp_bf16_mixed_precision_trains_float32_lora_adapters(tmp_path, tiny_model):
    """The adapters' gradients come back float32 although the first forward FSDP2 sees is the
    reference's, with peft's adapters switched off (their requires_grad False)."""
    config = write_config(tmp_path, tiny_model, "bf16-lora", 2)
    data = yaml.safe_load(config.read_text())
    data["distributed"] = {"strategy": "fsdp", "mixed_precision": "bf16"}
    data["sft"]["enabled"] = False
    config.write_text(yaml.safe_dump(data))
    train(config)
    got = lines(tmp_path / "bf16-lora" / "metrics.jsonl")
    assert [m["step"] for m in got] == [1, 2]
    assert all(math.isfinite(m["loss"]) and m["policy/grad_norm"] > 0 for m in got)
    adapter = load_file(tmp_path / "bf16-lora" / "final" / "adapter" / "adapter_model.safetensors")
    assert adapter and {w.dtype for w in adapter.values()} == {torch.float32}
    # B starts at zero: trained adapters have moved it
    assert any(w.abs().sum() > 0 for k, w in adapter.items() if "lora_B" in k)


def test_strategy_none_with_two_processes_is_refused(tmp_path, tiny_model):
    config = full_finetune(tmp_path, tiny_model, "none", 1, "none")
    done = train(config, check=False)
    assert done.returncode != 0
    assert "distributed.strategy: none trains in one process, but 2 processes" in done.stderr


def test_dynamic_sampling_rounds_alike_in_both_processes(tmp_path, tiny_model):
    config = write_config(tmp_path, tiny_model, "dapo", 2)
    data = yaml.safe_load(config.read_text())
    # fairness is scored by a reward that is the same for every completion: no signal
    data["tasks"]["fairness"]["rewards"] = [{"fn": f"{USER_REWARDS}:constant"}]
    data["algorithm"] = {"dynamic_sampling": True, "max_refill_rounds": 2}
    config.write_text(yaml.safe_dump(data))
    train(config)
    run = tmp_path / "dapo"
    main, other = lines(run / "metrics.jsonl"), lines(run / ".rank-1" / "metrics.jsonl")
    assert [m["step"] for m in main] == [1, 2] and other == main
    for m in main:  # counts of both processes' groups, as one process would count them
        assert m["rollout/dynamic_sampling/dropped"] >= 1
        assert m["rollout/dynamic_sampling/rounds"] <= 2
        # a process left with no informative group trains on its batch (zero advantages)
        assert 2 - m["rollout/dynamic_sampling/missing"] <= m["rollout/groups"] <= 2
    # one prompt stream: after the refill rounds both processes' prompt mixers stand alike
    mixers = [json.loads((d / "checkpoints" / "step-0000002" / "trainer_state.json").read_text())
              ["trainer"]["mixer"] for d in (run, run / ".rank-1")]
    assert mixers[0] == mixers[1]
    assert sum(mixers[0]["position"]) > 2 * 2  # refill rounds drew prompts beyond the steps'
