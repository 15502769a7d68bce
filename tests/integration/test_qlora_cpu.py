"""QLoRA on the CPU end to end through the CLI: a tiny model's base loaded in 4-bit NF4 by the
bitsandbytes installed here (skipped without one of 0.46.1 or newer: CI installs none), GRPO
steps training the LoRA adapters on it (with `embeddings_in_4bit` too), the adapter saved (no
merged model: see save_model); and full fine-tuning with bitsandbytes' 8-bit AdamW on the CPU
(0.50.0 or newer)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from packaging.version import Version
from safetensors.torch import load_file

from mogrpo.cli import main
from mogrpo.config.hardware import BNB_CPU_MIN, BNB_CPU_OPTIM_MIN, bitsandbytes_version
from mogrpo.demo import demo_base

pytest.importorskip("bitsandbytes")
if Version(bitsandbytes_version() or "0") < Version(BNB_CPU_MIN):
    pytest.skip(f"bitsandbytes {bitsandbytes_version()} has no CPU kernels",
                allow_module_level=True)
USER_REWARDS = Path(__file__).with_name("user_rewards.py")


def _two_steps(tmp_path: Path, model: Path, model_settings: dict, lora: dict | None = None,
               **train) -> Path:
    """A config of 2 GRPO steps of the demo's tasks (small) on `model`, written; its path."""
    config = demo_base()
    config["model"].update(name_or_path=str(model), **model_settings)
    if lora is not None:
        config["lora"] = lora
    config["output"]["dir"] = str(tmp_path / "run")
    for task in config["tasks"].values():
        task["data"] += "?size=40"
        task["eval_size"] = 8
    # varies within every group from the first step: a gradient at every step
    config["tasks"]["fairness"]["rewards"].append(
        {"fn": f"{USER_REWARDS}:distinct_chars", "name": "distinct"})
    config["train"].update(max_steps=2, micro_batch_size=8, gradient_accumulation_steps=1,
                           warmup_steps=0, **train)
    config["rollout"].update(num_generations=4)
    config["sft"] = {"enabled": False}
    config["eval"].update(max_samples=4)
    config["logging"] = {"progress_bar": False}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize("embeddings", [False, True], ids=["4bit", "4bit+embeddings"])
def test_grpo_trains_lora_on_a_4bit_base_on_the_cpu(tmp_path, tiny_model, capsys, embeddings):
    path = _two_steps(tmp_path, tiny_model, {"load_in_4bit": True,
                                             "embeddings_in_4bit": embeddings},
                      lora={"enabled": True, "r": 4, "alpha": 8}, learning_rate=1e-2)

    assert main(["train", str(path)]) == 0
    with_embeddings = " with its embedding and head" if embeddings else ""
    assert f"— LoRA r 4 (alpha 8), 4-bit base{with_embeddings}\n" in capsys.readouterr().err
    run = tmp_path / "run"
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "loss" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(m["policy/grad_norm"] > 0 for m in steps)
    adapter = load_file(run / "final" / "adapter" / "adapter_model.safetensors")
    lora_b = [v for k, v in adapter.items() if "lora_B" in k]
    assert lora_b and all(v.abs().sum() > 0 for v in lora_b)  # every adapter moved from B = 0
    assert not (run / "final" / "merged").exists()


@pytest.mark.skipif(Version(bitsandbytes_version() or "0") < Version(BNB_CPU_OPTIM_MIN),
                    reason=f"bitsandbytes {bitsandbytes_version()} has no CPU 8-bit optimizers")
def test_grpo_full_fine_tuning_with_8bit_adamw_on_the_cpu(tmp_path, tiny_model):
    """paged_adamw_8bit: on a CPU the plain 8-bit AdamW (nothing to page)."""
    path = _two_steps(tmp_path, tiny_model, {}, learning_rate=1e-3,
                      optimizer="paged_adamw_8bit")
    assert main(["train", str(path)]) == 0
    run = tmp_path / "run"
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps if "loss" in m] == [1, 2]
    optimizer = next(run.rglob("optimizer*.pt"))
    import torch

    state = torch.load(optimizer, weights_only=False)["state"]
    m = [s["__bnb_optimizer_quant_state__"]["state1"] for s in state.values()]
    # bitsandbytes' state: m in 8 bits for every tensor of 4,096 values or more (the embedding
    # of this tiny model), in fp32 for the smaller ones
    assert {t.dtype for t in m} == {torch.uint8, torch.float32}
    assert all((t.dtype == torch.uint8) == (t.numel() >= 4096) for t in m)


def test_qlora_under_bf16_mixed_with_the_head_in_chunks(tmp_path, tiny_model, monkeypatch):
    """bf16-mixed, the GPU default, over a 4-bit base: float32 norms (the upcast a quantised
    base keeps) meet the bf16 head in the log-prob pass. With the tokens in several chunks
    of the head (every real vocabulary), its backward once ran outside the forward's autocast
    and failed on the dtypes at the first step."""
    import mogrpo.algo.head_logprobs as chunked

    monkeypatch.setattr(chunked, "CHUNK_BYTES", 4096)  # a few tokens a chunk
    path = _two_steps(tmp_path, tiny_model, {"load_in_4bit": True, "precision": "bf16-mixed"},
                      lora={"enabled": True, "r": 4, "alpha": 8}, learning_rate=1e-2)
    assert main(["train", str(path)]) == 0
    steps = [json.loads(line) for line in
             (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "loss" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(m["policy/grad_norm"] > 0 for m in steps)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_quantised_base_starts_at_kl_zero(tmp_path, tiny_model, bits):
    """The rollout and the reference pass (eval mode, no gradients) and the update (train mode)
    take one bitsandbytes kernel: at the first step the adapters are zero, so the policy is its
    reference. On a CPU LLM.int8() once multiplied in int8 in eval mode and in floating point
    in train mode (KL ~1e-6 at step 1, ratios off 1)."""
    path = _two_steps(tmp_path, tiny_model, {f"load_in_{bits}bit": True},
                      lora={"enabled": True, "r": 4, "alpha": 8}, learning_rate=1e-2)
    assert main(["train", str(path)]) == 0
    first = next(json.loads(line) for line in
                 (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
                 if '"loss"' in line)
    assert first["step"] == 1
    assert first["kl"] == 0.0
    assert first["task/fairness/kl"] == 0.0 and first["task/hallucination/kl"] == 0.0
