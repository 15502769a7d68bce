"""The optimizer and learning-rate schedule of the SFT and GRPO loops."""

from __future__ import annotations

import math

import torch


def build_optimizer(
    model: torch.nn.Module, lr: float, weight_decay: float, betas: tuple[float, float]
) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters, fused where the device and dtype allow."""
    params = [p for p in model.parameters() if p.requires_grad]
    try:
        # One fused kernel for every tensor (CPU and CUDA): many times faster than the default
        # per-tensor loop when a model has many small tensors, as LoRA adapters do.
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas,
                                 fused=True)
    except (RuntimeError, ValueError):  # a device or dtype without the fused kernel
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
