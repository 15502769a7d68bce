"""Eleven decoder families, full fine-tuning and LoRA: one GRPO step each, zero KL at step 1,
a finite loss, a planner estimate, and saved models that plain transformers / peft reload."""

from __future__ import annotations

import json
import logging
import math
import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: architectures
from architectures import DROPOUT, FAMILIES, build_family  # noqa: E402
from mogrpo.config import load_config  # noqa: E402
from mogrpo.demo import demo_base, tokenizer_corpus  # noqa: E402
from mogrpo.trainer.run import run_training  # noqa: E402


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return tokenizer_corpus(demo_base(), 0)


def one_step(tmp_path: Path, model_dir: Path, lora: bool, *, sft: bool = False) -> dict:
    """One GRPO step (μ = 2, so the rollout-time log-probs are scored too) on the demo tasks."""
    config = demo_base()
    config["model"]["name_or_path"] = str(model_dir)
    config["output"] = {"dir": str(tmp_path / "run")}
    for task in config["tasks"].values():
        task["data"] += "?size=40"
        task["eval_size"] = 4
    config["sft"] = {"enabled": sft, "steps": 2, "batch_size": 4}
    config["eval"] = {"at_start": sft, "max_samples": 4}
    config["rollout"].update(num_generations=4, max_completion_length=8)
    config["train"].update(max_steps=1, micro_batch_size=8, warmup_steps=0, learning_rate=1e-3)
    config["algorithm"] = {"num_iterations": 2}
    config["lora"] = {"enabled": lora, "r": 4, "alpha": 8, "dropout": 0.1}
    config["logging"] = {"progress_bar": False}
    run, _ = load_config(None, [], base=config)
    return run_training(run)


def logits(model, tokenizer) -> torch.Tensor:
    batch = tokenizer(["Question: where does Anna live?", "Answer:"], return_tensors="pt",
                      padding=True)
    with torch.no_grad():
        return model(**batch).logits


class Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_gpt2_lora_run_prints_neither_warning(tmp_path, corpus):
    """GPT-2 used to print peft's Conv1D `fan_in_fan_out` warning on every LoRA run, and its
    SFT warm-up transformers' `loss_type=None` notice; and no forward may go without an
    attention mask (transformers' "We strongly recommend passing in an `attention_mask`" —
    GPT-2 checks for it when a pad token sits at either end of a row)."""
    model_dir = build_family(tmp_path / "gpt2", "gpt2", corpus)
    logging.Logger.warning_once.cache_clear()  # transformers' warnings fire once per process
    handler = Captured()
    logging.getLogger("transformers").addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            summary = one_step(tmp_path, model_dir, lora=True, sft=True)
        text = "\n".join(handler.messages + [str(w.message) for w in caught])
        assert "fan_in_fan_out" not in text
        assert "attention_mask" not in text
        assert handler.messages == []  # nor any other transformers warning (e.g. loss_type)
        # the capture does see the warning: a forward without a mask over padded ids
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(summary["saved"]["merged"])
        tokenizer = AutoTokenizer.from_pretrained(summary["saved"]["merged"])
        ids = tokenizer(["a", "the cat sat"], return_tensors="pt", padding=True)["input_ids"]
        model(input_ids=ids)
        assert any("strongly recommend passing in an `attention_mask`" in m
                   for m in handler.messages)
    finally:
        logging.getLogger("transformers").removeHandler(handler)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, corpus) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {family: build_family(root / family, family, corpus) for family in FAMILIES}


@pytest.mark.slow
# peft's reload probes transformers 5's deprecated `is_gradient_checkpointing` alias
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_one_grpo_step_per_architecture(tmp_path, family_dirs, family, lora):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    summary = one_step(tmp_path, family_dirs[family], lora)
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1
    # policy = reference at step 1, dropout or not: KL 0 to the last bits (on MKL, which sums
    # a product of a few rows in another order than the same rows among many, the reference
    # pass and the training micro-batches can differ by an ulp: KL ~1e-15)
    assert abs(first["kl"]) < 1e-12
    assert first["policy/clip_frac"] == 0.0  # μ = 2: ratios against the old pass are all 1
    assert math.isfinite(first["loss"])
    assert summary["memory_estimate_gib"] > 0  # the planner modelled this architecture

    saved = {k: Path(v) for k, v in summary["saved"].items()}
    final = saved["merged"] if lora else saved["model"]
    model = AutoModelForCausalLM.from_pretrained(final)
    tokenizer = AutoTokenizer.from_pretrained(final)
    assert model.config.model_type == FAMILIES[family][0]
    out = logits(model, tokenizer)
    assert torch.isfinite(out).all() and out.shape[-1] == model.config.vocab_size
    if lora:  # the adapter on the base model gives the merged model's logits
        base = AutoModelForCausalLM.from_pretrained(family_dirs[family])
        adapter = PeftModel.from_pretrained(base, saved["adapter"])
        torch.testing.assert_close(logits(adapter, tokenizer), out, rtol=1e-4, atol=1e-4)
    if family in DROPOUT:  # the saved config keeps the dropout the checkpoint shipped
        config = json.loads((final / "config.json").read_text())
        assert config.get("resid_pdrop", config.get("dropout")) == 0.1
