"""Exact resume with tools: an agent run stopped after step 1 of 2 and resumed from its
checkpoint ends bit-identical to the unbroken run — metrics, environment rewards and weights.

The episodes call tools for real: the policy samples through the fake vLLM
(`fake_agent.tool_calling_script`), whose tool calls are drawn from torch's generator, so the
resumed step repeats the unbroken one only if the checkpoint restored that generator, and
each rollout's environments are built afresh with its rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fake_agent import Counter, calculator, digits, use_fake_vllm

TIMING = ("time/", "throughput/", "memory/")


class Stop(BaseException):
    """The run stopping mid-step (not an Exception: no reward-error handling catches it)."""


class Tripwire:
    """A reward of 0 that stops the run at its call number `at` (None: never) — inside step
    `at`, after its rollout; the last checkpoint is then step `at - 1`'s."""

    __name__ = "tripwire"

    def __init__(self, at: int | None) -> None:
        self.at, self.calls = at, 0

    def __call__(self, prompts: list, completions: list, **kwargs) -> list[float]:
        self.calls += 1
        if self.calls == self.at:
            raise Stop
        return [0.0] * len(completions)


def config(tmp_path: Path, model: Path, name: str, tripwire: Tripwire) -> dict:
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} + {i}?"}) + "\n"
                            for i in range(16)))
    return {"model": {"name_or_path": str(model), "chat_template": "tiny_tools"},
            "output": {"dir": str(tmp_path / name), "save_every": 1, "keep_last": 0},
            "lora": {"enabled": True, "r": 4, "alpha": 8, "dropout": 0.1},
            "rollout": {"num_generations": 2, "max_completion_length": 160, "engine": "vllm"},
            "train": {"max_steps": 2, "micro_batch_size": 2, "gradient_accumulation_steps": 2,
                      "learning_rate": 5e-3, "warmup_steps": 1, "lr_scheduler": "cosine"},
            "sft": {"enabled": False},
            "eval": {"at_start": False},
            "logging": {"progress_bar": False},
            "tasks": {"calc": {"data": str(data), "beta": 0.04,
                               "rewards": [digits, tripwire], "tools": [calculator],
                               "environment": Counter, "max_tool_calling_iterations": 1}}}


def metric_lines(run_dir: Path) -> list[dict]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in m.items() if not k.startswith(TIMING)}
            for m in lines if "event" not in m]


def test_agent_run_stopped_after_step_1_resumes_bit_identically(tmp_path, tiny_model,
                                                                 monkeypatch):
    import mogrpo

    use_fake_vllm(monkeypatch, tiny_model)
    mogrpo.train(config(tmp_path, tiny_model, "whole", Tripwire(None)))
    whole = metric_lines(tmp_path / "whole")
    assert [m["step"] for m in whole] == [1, 2]
    assert all(m["task/calc/agent/tokens_inserted"] > 0 for m in whole)  # tools were called
    assert len({m["task/calc/reward/Counter/mean"] for m in whole}) == 2

    tripwire = Tripwire(2)
    with pytest.raises(Stop):
        mogrpo.train(config(tmp_path, tiny_model, "cut", tripwire))
    assert [m["step"] for m in metric_lines(tmp_path / "cut")] == [1]
    tripwire.at = None  # the same callable objects: a resumed run takes the run's own rewards
    mogrpo.train(config(tmp_path, tiny_model, "cut", tripwire), resume="auto")

    assert metric_lines(tmp_path / "cut") == whole
    a = load_file(tmp_path / "whole" / "final" / "adapter" / "adapter_model.safetensors")
    b = load_file(tmp_path / "cut" / "final" / "adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(v.abs().sum() > 0 for k, v in a.items() if "lora_B" in k)  # it did train
