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
    embedding, head and quantised weights keep their dtypes. Its bitsandbytes layers then take
    one kernel in every pass (`one_kernel`). Returns the cast names."""
    cast = []
    for name, param in model.named_parameters():
        param.requires_grad = False
        if upcast and param.dim() == 1 and param.dtype in (torch.float16, torch.bfloat16):
            param.data = param.data.to(torch.float32)
            cast.append(name)
    one_kernel(model)
    return cast


def one_kernel(model: nn.Module) -> int:
    """Make every bitsandbytes layer of `model` compute alike in every pass — the rollout and
    the reference and old log-prob passes (eval mode, no gradients) as the update (train mode):
    the KL is then exactly 0 and every ratio 1 while the adapters are zero, as over a 16-bit
    base. On a CPU bitsandbytes (0.50) picks its kernel by mode otherwise:

    - LLM.int8() (`Linear8bitLt`): in train mode it dequantises and multiplies in floating
      point, in eval mode it multiplies in int8 (2e-3 apart in log-prob on a tiny model). The
      train-mode product is kept in every pass on CPU tensors (where the choice is made; on a
      GPU both modes take one path).
    - NF4 (`Linear4bit`) on a CPU with AVX512-BF16 (Intel Sapphire Rapids and later): the first
      eval-mode forward without gradients repacks the weight in place into a CPU inference
      layout, whose kernel every later pass then takes, the update's included. Not repacked.

    Returns the layers changed."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        return 0
    changed = 0
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
            changed += 1
        elif isinstance(module, bnb.nn.Linear8bitLt) and "forward" not in vars(module):
            module.forward = _TrainModeOnCpu(module, type(module).forward)
            changed += 1
    return changed


class _TrainModeOnCpu:
    """A `Linear8bitLt`'s forward in train mode for CPU inputs (see `one_kernel`); an object,
    not a closure, so that a model holding it still deep-copies and pickles."""

    def __init__(self, module: nn.Module, forward: Any) -> None:
        self.module, self.forward = module, forward

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        module = self.module
        if x.device.type != "cpu" or module.training:
            return self.forward(module, x)
        module.training = True
        try:
            return self.forward(module, x)
        finally:
            module.training = False


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
