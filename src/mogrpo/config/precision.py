"""`model.precision`: the dtype the trained weights and AdamW states are kept in, and the
dtype the forward and backward compute in; resolved here from the config and the device,
without torch (the memory planner reads it for a machine it is not on).

| precision | trained weights, AdamW m and v | matmuls | loss scaling |
|---|---|---|---|
| `fp32` | float32 | float32 | — |
| `bf16-mixed` | float32 | bfloat16 (`torch.autocast`) | — |
| `fp16-mixed` | float32 | float16 (`torch.autocast`) | dynamic (`torch.amp.GradScaler`) |
| `bf16` | bfloat16 | bfloat16 | — |

`model.dtype` names the compute dtype (float32, bfloat16, float16): left at `auto` it follows
the precision; set, it must agree with it, and with `precision: auto` it picks the precision
(`bfloat16` → `bf16-mixed`, never pure bf16). A frozen LoRA or 4-bit base loads in the compute
dtype: it is never updated, so it loses nothing, and that is where LoRA saves memory.
"""

from __future__ import annotations

from typing import Literal

Precision = Literal["auto", "fp32", "bf16-mixed", "fp16-mixed", "bf16"]
COMPUTE_DTYPE = {"fp32": "float32", "bf16-mixed": "bfloat16", "fp16-mixed": "float16",
                 "bf16": "bfloat16"}
"""The dtype each precision computes in: what `model.dtype` must be, when it is set."""
MASTER_BYTES = {"fp32": 4, "bf16-mixed": 4, "fp16-mixed": 4, "bf16": 2}
"""Bytes per trained weight (and per AdamW moment) under each precision."""
_FROM_DTYPE = {"float32": "fp32", "bfloat16": "bf16-mixed", "float16": "fp16-mixed"}


def dtype_conflict(precision: str, dtype: str) -> str | None:
    """The error message when `model.dtype` contradicts `model.precision`, else None."""
    if precision == "auto" or dtype == "auto" or COMPUTE_DTYPE[precision] == dtype:
        return None
    fits = [p for p, d in COMPUTE_DTYPE.items() if d == dtype]
    return (f"model.dtype = {dtype} contradicts model.precision = {precision}, which computes "
            f"in {COMPUTE_DTYPE[precision]}: `dtype` names the compute dtype. Remove "
            f"model.dtype (or set it to {COMPUTE_DTYPE[precision]}), or choose a precision "
            f"that computes in {dtype}: {' or '.join(fits)}")


def resolve_precision(precision: str, dtype: str, device: str,
                      bf16_supported: bool = True) -> str:
    """The precision a run trains in: `precision` as set; for `auto`, the one `dtype` names,
    else fp32 on a CPU and bf16-mixed on a GPU (fp16-mixed where it has no bfloat16).
    `device`: "cpu" or "cuda"."""
    if precision != "auto":
        return precision
    if dtype != "auto":
        return _FROM_DTYPE[dtype]
    if device != "cuda":
        return "fp32"
    return "bf16-mixed" if bf16_supported else "fp16-mixed"


FSDP_FP16 = ("model.precision = fp16-mixed with distributed.strategy = fsdp: the fp16 loss "
             "scale must agree across FSDP2's gradient shards, which mogrpo's scaler does not "
             "do; use bf16-mixed (a GPU with bfloat16) or distributed.strategy: ddp")
"""Why fp16-mixed cannot train over FSDP2 shards (`check_processes`, and the run once `auto`
is resolved on its GPU)."""
