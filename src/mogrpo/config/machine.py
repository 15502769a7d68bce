"""What a run asks of this machine: a CUDA GPU where `device: cuda` says so, bfloat16 where the
precision asks for it, bitsandbytes and CUDA for 4-bit weights, flash-attention's package.

Checked by `validate` (`machine=True`) before any data or model loads, and again by the
loaders for callers of the Python functions. torch is imported only when a check needs it (a
config that asks for none of these costs no torch import).
"""

from __future__ import annotations

import importlib.util

from mogrpo.config.precision import resolve_precision
from mogrpo.config.sections import RunConfig

NO_CUDA = "device = cuda but no CUDA GPU is visible; set device: auto or cpu"
FLASH_PACKAGES = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}


def cuda_visible() -> bool:
    import torch

    return torch.cuda.is_available()


def accelerator_problems(load_in_4bit: bool, attn_implementation: str | None,
                         device: str = "auto") -> list[str]:
    """4-bit weights without CUDA or bitsandbytes, a flash-attention kernel without CUDA or its
    package; `device` the run's (`cpu` rules CUDA out without asking torch)."""
    problems = []
    if load_in_4bit:
        reason = "device = cpu" if device == "cpu" else \
            "bitsandbytes is not installed" if importlib.util.find_spec("bitsandbytes") is None \
            else None if cuda_visible() else "no CUDA GPU is visible"
        if reason is not None:
            problems.append(
                "model.load_in_4bit is set but 4-bit loading needs a CUDA GPU and `pip install "
                f"mogrpo[gpu]` (bitsandbytes), and here {reason}; on this machine set "
                "model.load_in_4bit: false")
    package = FLASH_PACKAGES.get(attn_implementation or "")
    if package and (device == "cpu" or importlib.util.find_spec(package) is None
                    or not cuda_visible()):
        problems.append(
            f"model.attn_implementation = {attn_implementation!r} needs a CUDA GPU and the "
            f"`{package}` package; install it or use attn_implementation 'sdpa' (the default) "
            "or 'eager'")
    return problems


def no_bf16(precision: str, gpu: str) -> str:
    """The error for a bfloat16 precision on a GPU without bfloat16."""
    return (f"model.precision = {precision}: this GPU ({gpu}) has no bfloat16; use fp16-mixed "
            "(float32 weights, float16 compute with loss scaling) or fp32")


def machine_errors(config: RunConfig) -> list[str]:
    """Everything `config` asks of this machine that it does not have."""
    mc = config.model
    if config.device == "cuda" and not cuda_visible():
        return [NO_CUDA]
    errors = accelerator_problems(mc.load_in_4bit, mc.attn_implementation, config.device)
    # only an explicit bfloat16 can fail: `auto` falls back to fp16-mixed on such a GPU
    precision = resolve_precision(mc.precision, mc.dtype, "cuda", bf16_supported=False)
    if config.device != "cpu" and "bf16" in precision and cuda_visible():
        import torch

        if not torch.cuda.is_bf16_supported():
            errors.append(no_bf16(precision, torch.cuda.get_device_name()))
    return errors
