"""A frozen base in 4-bit NF4 (QLoRA) or 8-bit (LLM.int8()) via bitsandbytes, prepared for LoRA.

What is cast up, and why (`model.load_in_4bit` says it to users too). peft's
`prepare_model_for_kbit_training` casts every 16-bit parameter that is not quantised to float32:
the norms, but also the embedding and the untied head, which are most of what is not quantised
(1.05 B of Llama-3-8B's parameters: 2.1 GB more). `prepare_quantized` casts only the 1-D weights
(norms, biases). The norm layers take their statistics in float32 whatever their weight's
dtype (HF's RMSNorm upcasts its input; autocast runs LayerNorm in float32); what a float32
norm weight changes is the dtype the norm returns, HF's RMSNorm multiplying by its weight
last, and through the quantised linears, which return their input's dtype, the residual
stream then sums in float32, as QLoRA trained. The embedding and head hold 16-bit values either
way: a float32 copy adds no information, and under autocast the head computes in the compute
dtype anyway. Under pure bf16 (no autocast) nothing is cast: a float32 norm output would meet
the bfloat16 head, and the run asked for bfloat16 throughout.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mogrpo.config.hardware import quantized_weights_problem
from mogrpo.errors import ModelError


def check_bitsandbytes(field: str, device: torch.device | None) -> None:
    """A ModelError naming `field` unless this machine's bitsandbytes can load it onto
    `device` (None: the GPU if there is one): installed, and on a CPU 0.46.1 or newer (config
    validation says the same earlier; this guards `load_policy` called directly)."""
    problem = quantized_weights_problem(field, device.type if device else "auto", machine=True)
    if problem:
        raise ModelError(problem)


def quantized_device_map(device: torch.device | None) -> dict[str, int | str]:
    """Where transformers puts a quantised model as it loads (bitsandbytes quantises each
    weight as it moves there): `device` when it is a GPU, else the current GPU when `device`
    is None and one is visible, else the CPU."""
    if device is not None and device.type == "cuda":
        return {"": torch.cuda.current_device() if device.index is None else device.index}
    if device is None and torch.cuda.is_available():
        return {"": torch.cuda.current_device()}
    return {"": "cpu"}


def quantization_config(bits: int, compute_dtype: torch.dtype) -> Any:
    """transformers' BitsAndBytesConfig: NF4 with double quantisation and `compute_dtype`
    matmuls (QLoRA's), or LLM.int8() with its default outlier threshold (6.0)."""
    from transformers import BitsAndBytesConfig

    if bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                              bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute_dtype)


def prepare_quantized(model: nn.Module, *, upcast: bool) -> list[str]:
    """Freeze every weight of a quantised `model` (LoRA trains on top) and, with `upcast`,
    cast its 16-bit 1-D weights (norms, biases) to float32 (see the module docstring); the
    embedding, head and quantised weights keep their dtypes. Returns the cast names."""
    cast = []
    for name, param in model.named_parameters():
        param.requires_grad = False
        if upcast and param.dim() == 1 and param.dtype in (torch.float16, torch.bfloat16):
            param.data = param.data.to(torch.float32)
            cast.append(name)
    return cast


def is_quantized(model: nn.Module) -> bool:
    """Whether transformers loaded `model` (a plain model, not a peft wrapper) quantised."""
    return any(getattr(model, flag, False) for flag in ("is_loaded_in_4bit", "is_loaded_in_8bit")
               ) or getattr(model, "hf_quantizer", None) is not None


def frozen_weight_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes, parameters) of `model`'s frozen weights as stored — every parameter that is not
    trained and every buffer, a shared (tied) tensor once — with what bitsandbytes keeps
    beside a quantised weight: NF4's absmax, its nested constants and code tables, LLM.int8()'s
    row scales. Parameters count a 4-bit weight's values, not its packed bytes. What the
    planner's weights term predicts for a LoRA base (`mogrpo.memory.weights`)."""
    seen: set[int] = set()
    nbytes = params = 0

    def add(t: torch.Tensor | None) -> int:
        if t is None or t.data_ptr() in seen:
            return 0
        seen.add(t.data_ptr())
        return t.nbytes

    for param in model.parameters():
        if param.requires_grad or param.data_ptr() in seen:
            continue
        state = getattr(param, "quant_state", None)
        params += param.numel() * (2 if state is not None else 1)
        nbytes += add(param)
        for holder in (state, getattr(state, "state2", None)):
            for name in ("absmax", "code", "offset"):
                nbytes += add(getattr(holder, name, None))
        nbytes += add(getattr(param, "SCB", None))
    return nbytes + sum(add(b) for b in model.buffers()), params
