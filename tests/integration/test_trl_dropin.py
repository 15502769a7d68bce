"""A TRL user's setup, end to end on a tiny model: a chat dataset in Parquet with a column
mapping, TRL's own `think_format_reward` by import path next to the user's sync and async
rewards (called by keyword, with trainer_state, log_extra and log_metric), a TRL loss variant,
and the completions table in the run folder, TensorBoard, MLflow and W&B."""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import pytest
import yaml

from mogrpo.cli import main

pytestmark = pytest.mark.slow  # ~40 s on 2 cores (W&B, MLflow and TensorBoard start up)
datasets = pytest.importorskip("datasets")
pytest.importorskip("trl")

STEPS = 2
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")
REWARDS = """
    import asyncio
    import json
    import os

    def accuracy(completions, solution, **kwargs):
        return [1.0 if s in c[0]["content"] else 0.0 for c, s in zip(completions, solution)]

    async def length(completions, completion_ids, trainer_state, log_extra, log_metric, **kwargs):
        await asyncio.sleep(0)
        with open(os.environ["SEEN_FILE"], "a") as f:
            f.write(json.dumps({"step": trainer_state.global_step,
                                "max_steps": trainer_state.max_steps,
                                "completion": completions[0],
                                "ids": len(completion_ids[0])}) + "\\n")
        log_extra("n_tokens", [len(ids) for ids in completion_ids])
        log_metric("calls", 1.0)
        return [len(ids) / 8 for ids in completion_ids]
"""


def test_trl_style_run(tmp_path, tiny_model, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("SEEN_FILE", str(tmp_path / "seen.jsonl"))
    questions = [f"What is {i} + {i}?" for i in range(12)]
    datasets.Dataset.from_dict({
        "question": [[{"role": "user", "content": q}] for q in questions],
        "answer": [str(2 * i) for i in range(12)],
    }).to_parquet(str(tmp_path / "math.parquet"))
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent(REWARDS))
    model = tmp_path / "chat_model"  # the tiny model with a chat template, as chat models have
    shutil.copytree(tiny_model, model)
    (model / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    config = {
        "model": {"name_or_path": str(model)},
        "tasks": {"math": {
            "data": {"path": str(tmp_path / "math.parquet"),
                     "columns": {"question": "prompt", "answer": "solution"}},
            "rewards": [{"fn": "trl.rewards:think_format_reward", "name": "think"},
                        {"fn": f"{tmp_path / 'my_rewards.py'}:accuracy"},
                        {"fn": f"{tmp_path / 'my_rewards.py'}:length"}],
        }},
        "rollout": {"num_generations": 2, "max_prompt_length": 32, "max_completion_length": 8},
        "algorithm": {"loss_type": "grpo", "importance_sampling_level": "sequence",
                      "kl_importance_weight": "differentiable", "mask_truncated_completions": True},
        "train": {"max_steps": STEPS, "micro_batch_size": 4, "learning_rate": 1e-3},
        "eval": {"at_start": False},
        "logging": {"progress_bar": False, "log_completions": True,
                    "trackers": ["tensorboard", "mlflow", "wandb"]},
        "output": {"dir": str(tmp_path / "run")},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    assert main(["train", str(tmp_path / "run.yaml")]) == 0
    run = tmp_path / "run"

    # the async reward saw TRL's arguments: chat completions, ids, the trainer's progress
    seen = [json.loads(line) for line in (tmp_path / "seen.jsonl").read_text().splitlines()]
    assert [s["step"] for s in seen] == [0, 1] and {s["max_steps"] for s in seen} == {STEPS}
    assert seen[0]["completion"][0]["role"] == "assistant" and seen[0]["ids"] >= 1
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    metrics = [m for m in metrics if "event" not in m]
    assert [m["task/math/reward/length/calls"] for m in metrics] == [1.0, 1.0]  # log_metric

    # the completions table: 2 prompts × K 2 per step
    rows = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] * 4 + [2] * 4
    row = rows[0]
    assert row["prompt"][0]["content"].startswith("What is")
    assert {"completion", "reward/think", "reward/accuracy", "reward/length", "advantage",
            "n_tokens"} <= row.keys()
    assert row["reward/length"] == row["n_tokens"] / 8

    # ... in every tracker
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    assert [e.step for e in events.Tensors("completions/text_summary")] == [1, 2]
    client = MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri())
    (mlflow_run,) = client.search_runs(client.get_experiment_by_name("mogrpo").experiment_id)
    logged = [a.path for a in client.list_artifacts(mlflow_run.info.run_id, "completions")]
    assert logged == ["completions/step_000001.jsonl", "completions/step_000002.jsonl"]
    tables = sorted(Path(run / "wandb").glob("offline-run-*/files/media/table/completions_*.json"))
    assert len(tables) == STEPS
    table = json.loads(tables[0].read_text())
    assert "reward/accuracy" in table["columns"] and len(table["data"]) == 4
