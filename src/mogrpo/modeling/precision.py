"""A run's precision in torch terms: the dtypes weights load and train in, the autocast every
forward runs under, the fp16 loss scale, and the warning pure bf16 deserves.

Why mixed precision is the default on GPUs: bfloat16 keeps 8 significant bits, so adding an
update smaller than half a unit in the last place — between 2^-9 and 2^-8 (0.2-0.4 %) of the
weight — leaves the weight unchanged. AdamW moves every weight by about the learning rate per
step, whatever its gradient's size, so weights of typical size s stop learning below
lr ≈ s · 2^-9: at s = 0.02, lr 4e-5, above the usual GRPO rates (1e-6 to 1e-5). Float32 master
weights (and AdamW states) keep those updates; autocast still computes every matrix product in
bfloat16. The names and the resolution of `auto`: `mogrpo.config.precision`.
"""

from __future__ import annotations

import logging
import statistics
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from mogrpo.config.machine import no_bf16
from mogrpo.config.precision import COMPUTE_DTYPE, resolve_precision
from mogrpo.config.sections import ModelConfig
from mogrpo.errors import ConfigError

log = logging.getLogger(__name__)
BF16_KEPT_BITS = 8
"""Significant bits of bfloat16 (7 stored, 1 implied): an update below 2^-8 of |w| can round
away, below 2^-9 of |w| always does."""


@dataclass(frozen=True)
class Precision:
    """How a run keeps and computes the policy's weights (`model.precision`, resolved)."""

    name: str
    """fp32, bf16-mixed, fp16-mixed or bf16."""
    device_type: str = "cpu"
    """Where the policy runs ("cpu" or "cuda"): the device autocast is entered for."""

    @property
    def mixed(self) -> bool:
        """Float32 master weights with forward and backward under autocast."""
        return self.name.endswith("-mixed")

    @property
    def compute_dtype(self) -> torch.dtype:
        """What matrix products compute in; also the reference copy's and a rollout's dtype."""
        return getattr(torch, COMPUTE_DTYPE[self.name])

    @property
    def master_dtype(self) -> torch.dtype:
        """The dtype of trained weights and of AdamW's m and v (`build_optimizer` keeps states
        in the parameters' dtype)."""
        return torch.bfloat16 if self.name == "bf16" else torch.float32

    def load_dtype(self, *, lora: bool) -> torch.dtype:
        """The dtype weights load in: a frozen LoRA base in the compute dtype (nothing updates
        it); trained weights in the master dtype."""
        return self.compute_dtype if lora else self.master_dtype

    def describe(self, *, lora: bool) -> str:
        """One line for the startup summary: what is kept in which dtype."""
        if self.name == "fp32":
            return "float32"
        compute = str(self.compute_dtype).removeprefix("torch.")
        trained = "float32 adapters over a " + compute + " base" if lora and self.mixed \
            else "float32 weights and AdamW states" if self.mixed \
            else "bfloat16 weights and AdamW states"
        scaled = ", dynamic loss scale" if self.name == "fp16-mixed" else ""
        return f"{self.name}: {trained}, {compute} compute{scaled}"

    def autocast(self) -> AbstractContextManager:
        """The context every forward of the policy and its reference runs in: autocast to the
        compute dtype under mixed precision, nothing otherwise."""
        if not self.mixed:
            return nullcontext()
        return torch.autocast(self.device_type, dtype=self.compute_dtype)

    def grad_scaler(self) -> torch.amp.GradScaler:
        """fp16-mixed's dynamic loss scale (torch's defaults: 2^16, halved on an overflow,
        doubled after 2000 clean steps); a disabled scaler, which passes everything through,
        under the other precisions."""
        return torch.amp.GradScaler(self.device_type, enabled=self.name == "fp16-mixed")


def resolve(model: ModelConfig, device: torch.device) -> Precision:
    """The run's precision on `device`; a ConfigError where the GPU has no bfloat16 for it."""
    bf16 = device.type != "cuda" or torch.cuda.is_bf16_supported()
    name = resolve_precision(model.precision, model.dtype, device.type, bf16_supported=bf16)
    if "bf16" in name and not bf16:
        raise ConfigError(no_bf16(name, torch.cuda.get_device_name(device)))
    return Precision(name, device.type)


def weight_scale(model: nn.Module) -> float:
    """A typical |w| of the trained matrices: the median over them of the mean |w| of a strided
    sample of each (a few thousand values a matrix; cheap on an 8B model)."""
    scales = []
    for p in model.parameters():
        if p.requires_grad and p.dim() >= 2:
            flat = p.detach().reshape(-1)
            scales.append(float(flat[:: max(1, flat.numel() // 4096)].float().abs().mean()))
    return statistics.median(scales) if scales else 0.0


def lost_update_lr(scale: float) -> float:
    """The learning rate below which AdamW's updates (≈ lr per weight per step) of bf16 weights
    of size `scale` always round away: half a unit in the last place, scale · 2^-9."""
    return scale * 2.0 ** -(BF16_KEPT_BITS + 1)


def pure_bf16_warning(model: nn.Module, learning_rate: float) -> str:
    """The startup line of a `precision: bf16` run: the lost-update problem, with this model's
    weight size and the learning rate below which it bites."""
    scale = weight_scale(model)
    bite = lost_update_lr(scale)
    verdict = "most of this run's updates will be lost" if learning_rate < bite else \
        f"weights larger than {learning_rate * 2 ** (BF16_KEPT_BITS + 1):.2g} still lose theirs"
    return (f"model.precision = bf16 keeps weights and AdamW states in bfloat16 (8 significant "
            f"bits): an update below ~2^-8 ≈ 0.4 % of a weight rounds away, and AdamW moves a "
            f"weight by about the learning rate, so with weights of typical size {scale:.3g} "
            f"(median |w|) updates are lost below lr ≈ {scale:.3g} · 2^-9 = {bite:.2g}; "
            f"train.learning_rate = {learning_rate:g}: {verdict}. Use precision bf16-mixed "
            "(float32 master weights) unless memory forbids it")
