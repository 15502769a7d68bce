"""Rollout logging as TRL users know it (`logging.log_completions`): every N steps, a table with
one row per completion — step, task, prompt, completion, each reward, the advantage and the
columns reward functions added with `log_extra` — appended to RUN_DIR/completions.jsonl and
sent to the trackers (TensorBoard text, W&B table, MLflow artifact)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

COMPLETIONS_FILE = "completions.jsonl"
_FIXED = ("step", "task", "prompt", "completion")


def completion_rows(step: int, task_names: list[str], reward_labels: list[list[str]],
                    batch: Any, advantages: torch.Tensor) -> list[dict[str, Any]]:
    """One row per completion of `batch` (a `RewardBatch`: picks, rollout, rewards, extras);
    `advantages` [B] in the batch's row order. An unscored reward is None."""
    K = batch.rollout.num_generations
    adv = advantages.detach().float().cpu().tolist()
    rows = []
    for g, (t, example) in enumerate(batch.picks):
        extras = batch.extras[g] if g < len(batch.extras) else {}
        scores = batch.rewards[g].tolist()  # [K, J]
        for k in range(K):
            i = g * K + k
            row: dict[str, Any] = {"step": step, "task": task_names[t], "prompt": example.prompt,
                                   "completion": batch.rollout.texts[i]}
            for label, value in zip(reward_labels[t], scores[k], strict=True):
                row[f"reward/{label}"] = None if math.isnan(value) else value
            row["advantage"] = adv[i]
            for column, values in extras.items():
                row[column if column not in row else f"extra/{column}"] = values[k]
            rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """(columns, cells) of rows that may differ in their keys; chat prompts become text."""
    columns: list[str] = []
    for row in rows:
        columns.extend(k for k in row if k not in columns)
    return columns, [[_cell(row.get(c)) for c in columns] for row in rows]


def _cell(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list) and all(isinstance(m, dict) for m in value):  # chat messages
        return "\n".join(f"{m.get('role', '')}: {m.get('content', '')}" for m in value)
    return json.dumps(value, ensure_ascii=False, default=str)


class CompletionLog:
    """Writes the completions table every `every` steps to the run folder and the trackers."""

    def __init__(self, run_dir: Path, every: int, trackers: Any = None) -> None:
        self.path = Path(run_dir) / COMPLETIONS_FILE
        self.every = every
        self.trackers = trackers

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def write(self, step: int, rows: list[dict[str, Any]]) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
        if self.trackers is not None and rows:
            columns, cells = table(rows)
            self.trackers.log_table("completions", step, columns, cells)
