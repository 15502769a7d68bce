"""Pieces shared by the SFT and GRPO loops: the run context, optimizer, schedule, metrics file
and progress bar."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from mogrpo.config import RunConfig
from mogrpo.data.schema import Example
from mogrpo.modeling.chat import render_prompt
from mogrpo.resume import json_line
from mogrpo.rollout.generate import SamplingSettings
from mogrpo.train.tasks import Task


@dataclass
class TrainContext:
    """What every phase needs: the config, tasks, the loaded policy and how to sample."""

    config: RunConfig
    tasks: list[Task]
    policy: torch.nn.Module
    tokenizer: Any
    device: torch.device
    stop_token_ids: list[int]
    sampling: SamplingSettings


def render_prompts(ctx: TrainContext, picks: list[tuple[int, Example]]) -> tuple[list[str], bool]:
    """Prompt texts ready to tokenize, and whether the tokenizer should add special tokens."""
    texts, add_special = [], True
    for t, example in picks:
        text, add_special = render_prompt(
            ctx.tokenizer,
            example.prompt,
            system_prompt=ctx.tasks[t].config.system_prompt,
            use_chat_template=ctx.config.model.use_chat_template,
        )
        texts.append(text)
    return texts, add_special


def build_optimizer(
    model: torch.nn.Module, lr: float, weight_decay: float, betas: tuple[float, float]
) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas)


def build_scheduler(
    optimizer: torch.optim.Optimizer, kind: str, warmup: int, total: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up, then constant, linear decay to 0, or cosine decay to 0."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if kind == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class MetricsWriter:
    """Appends one JSON object per line and flushes it, so a crash loses nothing written."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json_line(record))
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Tee:
    """Writes each record to several sinks (the metrics file, the trackers)."""

    def __init__(self, *sinks: Any) -> None:
        self.sinks = sinks

    def write(self, record: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.write(record)


class Progress:
    """A tqdm bar showing each task's reward; silent when off or when stderr is not a TTY."""

    def __init__(self, total: int, desc: str, enabled: bool, start: int = 0) -> None:
        self.enabled = enabled and sys.stderr.isatty()
        self.bar = tqdm(total=total, initial=start, desc=desc, disable=not self.enabled,
                        dynamic_ncols=True, leave=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.close()

    def update(self, metrics: dict[str, Any], tasks: list[Task] | None = None) -> None:
        if not self.enabled:
            return
        postfix = {}
        for task in tasks or []:
            key = f"task/{task.name}/reward/mean"
            if key in metrics:
                postfix[task.name] = f"{metrics[key]:.3f}"
        if "loss" in metrics:
            postfix["loss"] = f"{metrics['loss']:.4f}"
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(1)
