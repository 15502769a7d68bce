"""The optimizer and learning-rate schedule of the SFT and GRPO loops."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from mogrpo.algo.choices import OPTIMIZERS
from mogrpo.config.hardware import BNB_OPTIMIZERS, GPU_EXTRA, bitsandbytes_problem
from mogrpo.errors import ConfigError

if TYPE_CHECKING:
    from mogrpo.config.sections import TrainConfig

UPDATE_NORM_CHUNK_BYTES = 16 * 2**20
"""Trainable weights copied at a time by `step_with_update_norms`: the copy of a chunk lives only
while that chunk is stepped, so measuring the step costs this much memory (or one tensor, where
larger) instead of a copy of every trainable weight, which at 32 M fp32 parameters (128 MiB) set
the run's peak RSS."""


def build_optimizer(
    model: torch.nn.Module, lr: float, weight_decay: float, betas: tuple[float, float],
    kind: str = "adamw",
) -> torch.optim.Optimizer:
    """The `train.optimizer` named `kind` over the trainable parameters: AdamW (fused where the
    device and dtype allow), bitsandbytes' 8-bit AdamW (paged or not), or Adafactor at `lr`."""
    params = [p for p in model.parameters() if p.requires_grad]
    if kind in BNB_OPTIMIZERS:
        device = params[0].device.type if params else "cpu"
        bnb = import_bitsandbytes(f"train.optimizer = {kind}", device)
        # on a CPU there is no GPU memory to page: the plain 8-bit AdamW, which the paged one
        # falls back to there anyway (with a warning at every state it makes)
        paged = kind == "paged_adamw_8bit" and device != "cpu"
        make = bnb.optim.PagedAdamW8bit if paged else bnb.optim.AdamW8bit
        return make(params, lr=lr, betas=betas, weight_decay=weight_decay)
    if kind == "adafactor":
        from transformers.optimization import Adafactor

        # a fixed learning rate (the scheduler's), not Adafactor's relative step size
        # scaled by each weight's RMS: train.learning_rate means the same for every optimizer
        return Adafactor(params, lr=lr, weight_decay=weight_decay, scale_parameter=False,
                         relative_step=False, warmup_init=False)
    if kind != "adamw":
        raise ConfigError(f"train.optimizer = {kind!r} is not one of {list(OPTIMIZERS)}")
    try:
        # One fused kernel for every tensor (CPU and CUDA): many times faster than the default
        # per-tensor loop when a model has many small tensors, as LoRA adapters do.
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas,
                                 fused=True)
    except (RuntimeError, ValueError):  # a device or dtype without the fused kernel
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas)


def train_optimizer(model: torch.nn.Module, train: TrainConfig) -> torch.optim.Optimizer:
    """GRPO's optimizer: `build_optimizer` with the settings of the `train` section."""
    return build_optimizer(model, train.learning_rate, train.weight_decay, train.adam_betas,
                           train.optimizer)


def import_bitsandbytes(what: str, device: str) -> Any:
    """The bitsandbytes module, or the ConfigError validation gives (`what` needs it for
    tensors on `device`)."""
    problem = bitsandbytes_problem(device, machine=True)
    if problem is not None:
        raise ConfigError(f"{what} needs bitsandbytes (`{GPU_EXTRA}`), but {problem}")
    import bitsandbytes

    return bitsandbytes


def _chunks(params: list[Tensor], budget: int) -> Iterator[list[Tensor]]:
    """`params` in order, grouped into runs of at most `budget` bytes (a larger tensor alone)."""
    chunk: list[Tensor] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if chunk and size + nbytes > budget:
            yield chunk
            chunk, size = [], 0
        chunk.append(p)
        size += nbytes
    if chunk:
        yield chunk


def step_with_update_norms(optimizer: torch.optim.Optimizer,
                           budget: int | None = None) -> list[Tensor]:
    """`optimizer.step()`, and how far it moved each of its parameters: per parameter, the norm
    of (after - before) [scalar tensors, in the optimizer's order].

    The step runs on a chunk of parameters at a time (`budget` bytes of them, None:
    UPDATE_NORM_CHUNK_BYTES), each chunk copied just before its step: every optimizer of
    `build_optimizer` updates each tensor from its own gradient and state alone (AdamW element-
    wise, 8-bit AdamW block-wise, Adafactor per row and column), so stepping the parameters in
    chunks gives the bits one step of all of them gives, and the copy never holds more than
    one chunk. The optimizer's parameter groups
    are put back as they were, also on an error."""
    groups = [group["params"] for group in optimizer.param_groups]
    norms: list[Tensor] = []
    try:
        for chunk in _chunks([p for params in groups for p in params],
                             UPDATE_NORM_CHUNK_BYTES if budget is None else budget):
            ids = {id(p) for p in chunk}
            for group, params in zip(optimizer.param_groups, groups, strict=True):
                group["params"] = [p for p in params if id(p) in ids]
            before = [p.detach().clone() for p in chunk]
            optimizer.step()
            # before - after: the same norm as after - before, and no second buffer; one call
            # each for the whole chunk (a small model's ~30 tensors cost ~0.4 ms more one by one)
            torch._foreach_sub_(before, [p.detach() for p in chunk])
            norms += torch._foreach_norm(before)
    finally:
        for group, params in zip(optimizer.param_groups, groups, strict=True):
            group["params"] = params
    return norms


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
