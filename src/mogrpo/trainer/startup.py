"""The startup summary: the lines a user checks before walking away from a long run.

Logged once, after the model is loaded and before the first step (SFT or GRPO): model and
how it is trained, parameters, device and dtype, each task's rows, rewards and β, the step
plan, the budgets lowered to the model's limits, the memory estimate and the output folder.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mogrpo.config import RunConfig
from mogrpo.modeling.load import trainable_parameters
from mogrpo.modeling.precision import Precision
from mogrpo.tasks.task import Task


def _training(config: RunConfig) -> str:
    mc, lc = config.model, config.lora
    how = f"LoRA r {lc.r} (alpha {lc.alpha:g})" if lc.enabled else "full fine-tuning"
    if mc.load_in_4bit or mc.load_in_8bit:
        how += f", {4 if mc.load_in_4bit else 8}-bit base"
        how += " with its embedding and head" if mc.embeddings_in_4bit else ""
    if config.train.optimizer != "adamw":
        how += f", {config.train.optimizer}"
    return how


def _kl(task: Task) -> str:
    kl = task.config.kl
    if kl.band() is not None:
        return f"{kl.kind} {kl.low}–{kl.high}"
    if kl.kind == "proportional":
        return f"proportional → {kl.target}"
    return "fixed"


def _task_lines(tasks: list[Task], step: int) -> list[str]:
    lines = []
    for task in tasks:
        # the weights of the first step run: a resumed run's scheduled ones have moved on
        rewards = ", ".join(f"{label} ×{weight:g}" for label, weight in
                            zip(task.reward_labels, task.reward_weights(step), strict=True))
        rows = "streamed" if task.stream is not None else f"{len(task.train):,}"
        lines += [f"  task {task.name}: {rows} train / {len(task.eval):,} eval rows "
                  f"from {_source(task.config.data)}, share {task.config.weight:g}",
                  f"    rewards {rewards or '(none)'}; β {task.config.beta:g} ({_kl(task)})"]
    return lines


def _source(data: object) -> str:
    """A task's data as written: a path or `builtin:NAME`, or a dataset section's hub/path."""
    if isinstance(data, str):
        return data
    return str(getattr(data, "hub", None) or getattr(data, "path", None) or data)


def _steps(config: RunConfig, start_step: int) -> str:
    tc, ro = config.train, config.rollout
    prompts = config.prompts_per_step
    text = (f"  steps    GRPO {tc.max_steps} × {prompts} prompts × K {ro.num_generations} = "
            f"{prompts * ro.num_generations} completions per step (micro-batch "
            f"{tc.micro_batch_size} × accumulation {tc.gradient_accumulation_steps}); up to "
            f"{ro.prompt_length} prompt + {ro.completion_length} completion tokens")
    if config.sft.enabled and start_step == 0:
        text += f"; SFT warm-up {config.sft.steps} steps first"
    if start_step:
        text += f"; resuming after step {start_step}"
    return text


def startup_summary(config: RunConfig, policy: torch.nn.Module, device: torch.device,
                    tasks: list[Task], memory_gib: float | None, run_dir: Path,
                    start_step: int = 0, precision: Precision | None = None) -> str:
    """The run summary as log lines (one string); `precision` as resolved for the run (None:
    the weights' dtype)."""
    trainable, total = trainable_parameters(policy)
    dtype = precision.describe(lora=config.lora.enabled) if precision is not None \
        else str(next(policy.parameters()).dtype).removeprefix("torch.")
    checkpointing = ", gradient checkpointing" if config.model.gradient_checkpointing else ""
    memory = (f"estimated peak {memory_gib:.2f} GiB (`mogrpo memory` has the breakdown; "
              "measured per step as memory/peak_gib)") if memory_gib is not None \
        else "no estimate for this architecture"
    return "\n".join([
        "run summary",
        f"  model    {config.model.name_or_path} — {_training(config)}",
        f"  params   {trainable:,} trainable of {total:,} ({trainable / max(total, 1):.2%})",
        f"  device   {device}, {dtype}{checkpointing}",
        *_task_lines(tasks, start_step),
        _steps(config, start_step),
        *(f"  limits   {key} {note}" for key, note in config.limit_notes.items()),
        f"  memory   {memory}",
        f"  output   {run_dir}",
    ])
