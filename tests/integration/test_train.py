"""End to end through the CLI on a tiny model: SFT warm-up, GRPO, metrics, saved model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

from mogrpo.cli import main
from mogrpo.demo import demo_base

STEPS = 3
USER_REWARDS = Path(__file__).with_name("user_rewards.py")
STEP_KEYS = {
    "step", "loss", "lr", "kl", "policy/grad_norm", "policy/clip_frac", "policy/entropy",
    "rollout/completion_length", "rollout/truncated_frac", "time/step_s",
    "throughput/completion_tokens_per_s",
    "task/fairness/kl", "task/fairness/beta", "task/fairness/zero_var_frac",
    "task/fairness/reward/mc_correct/mean", "task/fairness/reward/mc_correct/std",
    "task/fairness/reward/format/mean", "task/fairness/reward/format/std",
    "task/fairness/reward/length_penalty/mean", "task/fairness/reward/distinct/mean",
    "task/hallucination/reward/maybe/missing_frac",
    "task/hallucination/kl", "task/hallucination/beta",
    "task/hallucination/reward/mc_correct/mean", "task/hallucination/reward/mc_correct/std",
}




def write_config(tmp_path: Path, model: Path, lora: bool, **extra) -> Path:
    config = demo_base()
    config["model"]["name_or_path"] = str(model)
    config["output"]["dir"] = str(tmp_path / "run")
    for task in config["tasks"].values():
        task["data"] += "?size=120"
        task["eval_size"] = 16
    config["lora"] = {"enabled": lora, "r": 4, "alpha": 8}
    # A length objective varies between completions even before the model can answer, so the
    # advantages (and hence the gradients) are non-zero from the first step.
    config["tasks"]["fairness"]["rewards"] += [
        {"fn": "length_penalty", "weight": 0.5, "kwargs": {"target_length": 2, "max_length": 8}},
        {"fn": f"{USER_REWARDS}:distinct_chars", "name": "distinct"},
    ]
    config["tasks"]["hallucination"]["rewards"].append(
        {"fn": f"{USER_REWARDS}:unscorable_when_long", "name": "maybe"})
    config["train"].update(max_steps=STEPS, micro_batch_size=8, gradient_accumulation_steps=2,
                           learning_rate=1e-2, warmup_steps=0)
    config["rollout"].update(num_generations=4)
    config["sft"].update(steps=12, batch_size=8, learning_rate=5e-3)
    config["eval"].update(max_samples=8)
    config["logging"] = {"progress_bar": False}
    for key, value in extra.items():
        config.setdefault(key, {}).update(value)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


DEMO_BETAS = [demo_base()["tasks"][t]["beta"] for t in ("fairness", "hallucination")]


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSONL log, without health-alert events."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in records if "event" not in r]


def test_lora_run_trains_logs_and_saves(tmp_path, tiny_model):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert main(["train", str(write_config(tmp_path, tiny_model, lora=True))]) == 0
    run = tmp_path / "run"
    metrics = read_jsonl(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    for m in metrics:
        assert STEP_KEYS <= m.keys(), STEP_KEYS - m.keys()
        # the demo's β, unmoved: its controllers adjust every 10 steps after a 20-step warm-up
        assert [m[f"task/{t}/beta"] for t in ("fairness", "hallucination")] == DEMO_BETAS
    # The LoRA policy equals its reference before the first update: KL is exactly zero.
    assert metrics[0]["kl"] == 0.0
    assert metrics[-1]["kl"] > 0.0
    # Trainable parameters changed: LoRA B starts at zero and must not be zero any more.
    adapter = load_file(run / "final" / "adapter" / "adapter_model.safetensors")
    lora_b = [v for k, v in adapter.items() if "lora_B" in k]
    assert lora_b and any(v.abs().sum() > 0 for v in lora_b)
    # Both saved forms load with plain transformers / peft and agree.
    tok = AutoTokenizer.from_pretrained(run / "final" / "merged")
    merged = AutoModelForCausalLM.from_pretrained(run / "final" / "merged")
    base = AutoModelForCausalLM.from_pretrained(run / "sft" / "merged")
    peft_model = PeftModel.from_pretrained(base, run / "final" / "adapter")
    ids = tok("Anna and Ben were at the park.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, peft_model(ids).logits, rtol=1e-4, atol=1e-4)
    summary = json.loads((run / "summary.json").read_text())
    assert set(summary["evals"]) == {"start", "end"}
    assert set(summary["evals"]["end"]) == {"fairness", "hallucination"}
    assert len(read_jsonl(run / "sft_metrics.jsonl")) == 12
    # The final adapter sits on the SFT-merged model, which GRPO used as its KL reference.
    adapter_config = json.loads((run / "final" / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(run / "sft" / "merged")


def test_full_finetune_changes_weights_and_reloads(tmp_path, tiny_model, capsys):
    from transformers import AutoModelForCausalLM

    path = write_config(tmp_path, tiny_model, lora=False, sft={"enabled": False},
                        algorithm={"num_iterations": 2, "loss_aggregation": "token_mean"},
                        health={"enabled": False})
    assert main(["train", str(path)]) == 0
    # The startup summary, once, before the first step; the end says the checks were off.
    err = capsys.readouterr().err
    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model).parameters())
    assert err.count("run summary\n") == 1
    summary = err[err.index("run summary\n"):].splitlines()[:10]
    assert summary[1:4] == [
        f"  model    {tiny_model} — full fine-tuning",
        f"  params   {params:,} trainable of {params:,} (100.00%)",
        "  device   cpu, float32"]
    assert summary[4] == "  task fairness: 104 train / 16 eval rows from builtin:bias_probe?size=120, share 1"
    assert summary[5] == ("    rewards mc_correct ×1, format ×0.5, length_penalty ×0.5, "
                          "distinct ×1; β 0.2 (dual 0.05–0.35)")
    assert summary[8].startswith(f"  steps    GRPO {STEPS} × 4 prompts × K 4 = 16 completions")
    assert summary[9].startswith("  memory   estimated peak ")
    assert err.index("run summary") < err.index(f"step 1/{STEPS} | loss")
    assert "health: checks were off (health.enabled: false); no step was watched" in err
    assert "no alerts in" not in err
    before = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    after = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final" / "model").state_dict()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) > len(before) // 2
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert metrics[0]["kl"] == 0.0  # the frozen copy equals the policy before any update
    assert len(metrics) == STEPS


def test_bf16_mixed_full_finetune_on_cpu_trains_with_finite_metrics(tmp_path, tiny_model,
                                                                   capsys):
    """The GPU default, bf16-mixed, end to end on the CPU (bfloat16 autocast runs there too):
    SFT warm-up, rollouts, reference and update passes and evals under autocast, float32
    master weights, a bfloat16 reference copy, the final model saved in bfloat16."""
    path = write_config(tmp_path, tiny_model, lora=False)
    data = yaml.safe_load(path.read_text())
    data["model"]["precision"] = "bf16-mixed"
    path.write_text(yaml.safe_dump(data))
    assert main(["train", str(path)]) == 0
    err = capsys.readouterr().err
    assert "  device   cpu, bf16-mixed: float32 weights and AdamW states, bfloat16 compute" in err
    assert "KL reference: a frozen copy of the policy" in err and "bfloat16)" in err
    run = tmp_path / "run"
    metrics = read_jsonl(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    # the bf16 reference's rounding alone, at the first step (docs/logprobs.md)
    assert 0 <= metrics[0]["kl"] < 1e-4
    for m in metrics:
        for key in ("loss", "kl", "policy/grad_norm", "policy/update_norm", "policy/entropy",
                    "task/fairness/kl", "task/hallucination/kl"):
            assert math.isfinite(m[key]), (m["step"], key, m[key])
        assert m["policy/skipped_updates"] == 0 and m["rollout/nonfinite_logits"] == 0
        assert m["policy/update_norm"] > 0  # the weights moved at every step
    sft = read_jsonl(run / "sft_metrics.jsonl")
    assert len(sft) == 12 and all(math.isfinite(m["sft/loss"]) for m in sft)
    assert sft[-1]["sft/loss"] < sft[0]["sft/loss"]
    summary = json.loads((run / "summary.json").read_text())
    assert all(math.isfinite(score) for score in summary["evals"]["end"].values())
    final = run / "final" / "model"
    assert {t.dtype for t in load_file(final / "model.safetensors").values()} == {torch.bfloat16}
    assert json.loads((final / "config.json").read_text())["dtype"] == "bfloat16"


def test_user_mistake_is_an_error_line_not_a_traceback(tmp_path, tiny_model, capsys):
    path = write_config(tmp_path, tiny_model, lora=True)
    data = yaml.safe_load(path.read_text())
    data["tasks"]["fairness"]["rewards"][0]["fn"] = "mc_corect"
    path.write_text(yaml.safe_dump(data))
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert ("\nerror: tasks.fairness.rewards.0.fn: unknown reward 'mc_corect'; did you mean"
            in "\n" + err)
    assert "mc_correct" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()  # refused before the model loaded or a dir was made


def test_existing_run_dir_is_not_overwritten(tmp_path, tiny_model, capsys):
    path = write_config(tmp_path, tiny_model, lora=True, sft={"enabled": False})
    (tmp_path / "run").mkdir()
    # killed in the SFT warm-up: its lines would be written again after the old ones
    (tmp_path / "run" / "sft_metrics.jsonl").write_text("{}\n")
    assert main(["train", str(path)]) == 2
    assert "stopped before its first checkpoint (sft_metrics.jsonl" in capsys.readouterr().err
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    assert main(["train", str(path)]) == 2  # no checkpoint: nothing to continue
    err = capsys.readouterr().err
    assert "stopped before its first checkpoint" in err and "output.overwrite" in err
    (tmp_path / "run" / "summary.json").write_text("{}")
    assert main(["train", str(path)]) == 2
    assert "already holds a finished run" in capsys.readouterr().err
    (tmp_path / "run" / "checkpoints" / "step-0000002").mkdir(parents=True)
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and "--resume auto" in err
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == "{}\n"


def test_a_full_run_without_prompt_sharing_starts_at_kl_zero_and_learns(tmp_path, tiny_model):
    # train.prompt_sharing: off runs every row whole, as `auto` does on a GPU for short
    # prompts: the policy's and the reference's passes still take the same arithmetic
    from transformers import AutoModelForCausalLM

    path = write_config(tmp_path, tiny_model, lora=False, sft={"enabled": False},
                        train={"prompt_sharing": "off"}, health={"enabled": False})
    assert main(["train", str(path)]) == 0
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert len(metrics) == STEPS and metrics[0]["kl"] == 0.0 and metrics[-1]["kl"] > 0.0
    before = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    after = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final" / "model").state_dict()
    assert sum(not torch.equal(before[k], after[k]) for k in before) > len(before) // 2


def test_the_saved_models_stop_at_the_configured_stop_ids(tmp_path, tiny_model):
    # rollout.stop_token_ids that the checkpoint's generation_config lacks (Llama-3 base with
    # <|eot_id|>): plain transformers, `mogrpo predict` and `mogrpo serve` on the run must stop
    # where the trainer's rollouts and greedy eval stopped
    from transformers import AutoTokenizer

    newline = AutoTokenizer.from_pretrained(tiny_model)("\n", add_special_tokens=False)
    stop = newline["input_ids"]
    path = write_config(tmp_path, tiny_model, lora=True, rollout={"stop_token_ids": stop},
                        train={"max_steps": 1}, sft={"steps": 2}, health={"enabled": False})
    assert main(["train", str(path)]) == 0
    run = tmp_path / "run"
    for model in (run / "final" / "merged", run / "sft" / "merged"):
        generation = json.loads((model / "generation_config.json").read_text())
        assert generation["eos_token_id"] == stop, model
