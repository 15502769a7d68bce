"""The startup summary: the lines a user checks before a long run, from the run's real objects."""

from __future__ import annotations

from pathlib import Path

import torch

from mogrpo.config import load_config
from mogrpo.data.schema import Example
from mogrpo.tasks.task import Task
from mogrpo.trainer.startup import startup_summary


def config(**tasks):
    return load_config(None, [], environ={}, base={
        "model": {"name_or_path": "org/model-8b"}, "lora": {"enabled": True, "r": 8, "alpha": 16},
        "train": {"max_steps": 500, "micro_batch_size": 8, "gradient_accumulation_steps": 2},
        "rollout": {"num_generations": 4, "max_seq_length": 1024, "max_completion_length": 96},
        "tasks": tasks})[0]


def test_summary_of_a_file_task_and_a_streamed_dataset_task():
    cfg = config(
        fairness={"data": "data/fair.tsv", "beta": 0.1, "rewards": ["mc_correct"],
                  "kl": {"kind": "band", "low": 0.02, "high": 0.06}},
        math={"data": {"hub": "openai/gsm8k", "config": "main", "streaming": True},
              "rewards": [{"fn": "format", "weight": 0.5}]})
    policy = torch.nn.Linear(10, 10)  # 110 parameters
    policy.bias.requires_grad_(False)
    rows = [Example("q", {}, f"f:{i}") for i in range(3)]
    tasks = [Task("fairness", cfg.tasks["fairness"], rows, rows[:1], [("mc_correct", None, {})],
                  [type("W", (), {"at": lambda self, step: 1.0})()]),
             Task("math", cfg.tasks["math"], rows, [], [("format", None, {})],
                  [type("W", (), {"at": lambda self, step: 0.5})()], stream=lambda epoch: iter(rows))]
    text = startup_summary(cfg, policy, torch.device("cpu"), tasks, 12.345, Path("runs/x"), 200)
    assert text.splitlines() == [
        "run summary",
        "  model    org/model-8b — LoRA r 8 (alpha 16)",
        "  params   100 trainable of 110 (90.91%)",
        "  device   cpu, float32",
        "  task fairness: 3 train / 1 eval rows from data/fair.tsv, share 1",
        "    rewards mc_correct ×1; β 0.1 (band 0.02–0.06)",
        "  task math: streamed train / 0 eval rows from openai/gsm8k, share 1",
        "    rewards format ×0.5; β 0.04 (fixed)",
        "  steps    GRPO 500 × 4 prompts × K 4 = 16 completions per step (micro-batch 8 × "
        "accumulation 2); up to 928 prompt + 96 completion tokens; resuming after step 200",
        "  memory   estimated peak 12.35 GiB (`mogrpo memory` has the breakdown; measured per "
        "step as memory/peak_gib)",
        "  output   runs/x",
    ]


def test_a_resumed_run_shows_the_weights_its_next_step_uses():
    from mogrpo.algo.schedules import from_config

    cfg = config(fairness={"data": "data/fair.tsv", "rewards": ["mc_correct"]})
    ramp = from_config({"kind": "linear", "start": 0.0, "end": 1.0, "start_step": 0,
                        "end_step": 200})
    rows = [Example("q", {}, f"f:{i}") for i in range(3)]
    tasks = [Task("fairness", cfg.tasks["fairness"], rows, [], [("mc_correct", None, {})],
                  [ramp])]
    lines = startup_summary(cfg, torch.nn.Linear(2, 2), torch.device("cpu"), tasks, None,
                            Path("runs/x"), 150).splitlines()
    assert "    rewards mc_correct ×0.75; β 0.04 (fixed)" in lines
