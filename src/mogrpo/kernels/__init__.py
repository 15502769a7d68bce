"""Code for one kind of hardware, chosen through one small interface.

The math (`mogrpo.algo`) and the loop (`mogrpo.trainer`) never name a processor, and nothing
outside this package imports one of its hardware packages: they call the functions here, which
pick what runs for the tensors or the machine at hand. Each kind of hardware has a package of
its own: `cpu/` (see its docstring) and `cuda/` (the native engine's decode step replayed from
CUDA graphs), behind these same functions.

- `products()`: the matrix products the math multiplies with (`mogrpo.algo.products`);
- the native engine's decode products: `decode_weight` prepares a weight once, and
  `decode_linear`, `decode_product`, `decode_add_product` multiply with it; `compiled_decoder`
  runs a whole step's layers in one call where a compiled step exists; `graph_runner` replays
  the static decode step from CUDA graphs on a GPU;
- `linear`, `trained_linear`: the training products for mogrpo's own forward (`score_hidden`);
- `prepare_lora(model)`: LoRA layers fused and dropout masks drawn fast where that pays;
- `apply_host_memory`: the C library's allocator told to keep a step's freed memory;
- `prompt_sharing_min_saved(device)`: the least share of a log-prob forward's tokens that
  running each distinct prompt once (two passes, not one) must save on this kind of device;
- `describe()`: which kernels run here, for `mogrpo doctor`.

Each function serves every device: where a hardware package has nothing faster it is PyTorch's
own operator.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from torch import Tensor, nn

    from mogrpo.algo.products import Products

# The names served by the CPU package, imported on first use (PEP 562): importing this package
# (as `mogrpo.kernels.cpu.host_memory` does, before torch, to set the allocator) stays light.
_SERVED = {
    "KEEP_MAX_BYTES": "cpu.mkl_packed", "Packed": "cpu.mkl_packed",
    "decode_weight": "cpu.linear", "decode_linear": "cpu.linear",
    "decode_product": "cpu.linear", "decode_add_product": "cpu.linear",
    "linear": "cpu.linear", "trained_linear": "cpu.linear",
    "apply_host_memory": "cpu.host_memory",
}
__all__ = ["compiled_decoder", "describe", "graph_runner", "prepare_lora", "products",
           "prompt_sharing_min_saved",
           *_SERVED]


def __getattr__(name: str) -> Any:
    if name not in _SERVED:
        raise AttributeError(f"module 'mogrpo.kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"mogrpo.kernels.{_SERVED[name]}"), name)
    globals()[name] = value  # later look-ups do not come here
    return value


def products() -> Products:
    """The training products: on CPUs float32 products on oneDNN or MKL by CPU and shape
    (`cpu.linear`), PyTorch's own operators for tensors on any other device or dtype."""
    from mogrpo.kernels.cpu import linear

    return linear.PRODUCTS


PROMPT_SHARING_MIN_SAVED = {"cpu": 0.0}
"""Per kind of device, the least share of a forward's tokens that running each distinct prompt
once must save for it to pay (`prompt_sharing_min_saved`); other devices: `_MIN_SAVED_ELSEWHERE`.

A shared forward is two passes (the distinct prompts, then the completions on their keys and
values) where the plain one is one: fewer tokens, twice the operations.
- CPU, 0: a CPU computes what it is given, so any saving counts. Measured on an AMD EPYC
  (`benchmarks/results/epyc/prompt_sharing.md`; 4 prompts × 4 completions of 13 prompt and up
  to 32 completion tokens, ~22 % of the tokens saved): the reference pass 6-11 % and the update
  5-8 % faster at 0.7 M and 8 M, with 1.4-1.7 times the operations.
- elsewhere (CUDA), 0.5: a GPU at GRPO's micro-batch sizes is often bound by launching its
  kernels, not by their arithmetic, and twice the operations then cost up to twice the time;
  sharing has to take out at least half the tokens to win whatever the regime. Not yet
  measured on a GPU (`benchmarks/gpu_check.sh` times the update both ways).
"""
_MIN_SAVED_ELSEWHERE = 0.5


def prompt_sharing_min_saved(device: str) -> float:
    """The least share of a log-prob forward's tokens that running each distinct prompt once
    must save on a `device` of this kind ("cpu", "cuda", ...) for `train.prompt_sharing: auto`
    to share (`mogrpo.algo.logprobs.completion_logprobs`' `min_saved`)."""
    return PROMPT_SHARING_MIN_SAVED.get(device, _MIN_SAVED_ELSEWHERE)


def compiled_decoder(decoder: Any, rows: int, device: torch.device) -> tuple[object | None, bool]:
    """(The compiled step of a decoder's layers for at most `rows` rows, whether it computes
    the logits too), or (None, False) where no compiled step runs them: the CPU one
    (`cpu.decode_step`) for float32 layers on a CPU; none yet on other devices. `decoder`: as
    `cpu.decode_step.DecoderWeights` describes it."""
    if device.type != "cpu":
        return None, False
    from mogrpo.kernels.cpu import decode_step

    return decode_step.decoder_stack(decoder, rows)


def graph_runner(device: torch.device) -> Callable[[Callable[[], Tensor]], Any] | None:
    """How the native engine's static decode step (`rollout/static_decode.py`) runs on
    `device`: on CUDA, a maker of runners that capture the step once per bucket of rows as a
    CUDA graph and replay it (`cuda.graph_step.GraphedStep`); None on other devices, or with
    MOGRPO_DECODE_GRAPH=0 (the engine's eager step then runs)."""
    if device.type != "cuda":
        return None
    from mogrpo.kernels.cuda import graph_step

    return None if graph_step.disabled() else graph_step.GraphedStep


def prepare_lora(model: nn.Module) -> tuple[int, int]:
    """(LoRA layers made fused, dropouts made fast): both act only on CPU float32 tensors and
    leave every other call to peft's own code."""
    from mogrpo.kernels.cpu.lora_dropout import use_fast_dropout
    from mogrpo.kernels.cpu.lora_linear import use_fused_lora

    return use_fused_lora(model), use_fast_dropout(model)


def describe() -> dict[str, Any]:
    """Which kernels compute here: the float32 products' library per use, the native engine's
    compiled decode step (built, or why not) and its step on CUDA (graphed or eager)."""
    from mogrpo.kernels.cpu import decode_step, linear
    from mogrpo.kernels.cuda import graph_step

    return {"kernels": linear.kernels(), "decode_step": decode_step.status(),
            "decode_graph": graph_step.status()}
