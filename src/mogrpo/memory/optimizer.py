"""What each `train.optimizer` keeps per trained tensor, and what its step allocates, in bytes.

| optimizer | state per tensor of n values | step temporaries |
|---|---|---|
| `adamw` | m and v in the weights' (master) dtype: 2·n·b | none: the trainer's fused AdamW (`fused=True`, CPU and CUDA) updates each tensor in place |
| `adamw_8bit`, `paged_adamw_8bit` | uint8 m and v + an fp32 absmax per 256-value block each: 2·n + 8·⌈n/256⌉; tensors under 4,096 values keep fp32 m and v (8·n) | CUDA: none, one in-place kernel per tensor. CPU (bitsandbytes >= 0.50): per tensor, one at a time, m and v dequantised to fp32, an fp32 copy of the gradient, sqrt(v) and its quotient: 5 × 4·n; with a 16-bit weight an fp32 copy of it too (6 × 4·n) |
| `adafactor` | a rows × cols matrix: fp32 row and column means, 4·(rows + cols); a vector: 4·n | per tensor, one at a time: grad² and its factored estimate in fp32 (2 × 4·n), plus fp32 copies of a 16-bit gradient and weight (2 × 4·n more) |

bitsandbytes: `Optimizer2State.init_state` (block size 256, `min_8bit_size` 4,096); paged states
live in CUDA managed memory and page out to the host only when the GPU runs short, so they are
counted as resident. Adafactor: transformers' `Adafactor.step` with no first moment (beta1
None), which states are float32 whatever the weights' dtype (it upcasts the gradient first).
bitsandbytes' CPU step (`_optimizer_update_8bit_blockwise_cpu` in its `backends/cpu/ops.py`,
0.50.2): on the Qwen2.5-0.5B shape in fp32, 2.54 GiB above the states at the second step, 5.0
fp32 copies of its largest tensor (the tied 151,936 × 896 embedding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mogrpo.modeling.architecture import Architecture, LinearLayer

BNB_BLOCK = 256
"""Values per fp32 absmax of bitsandbytes' block-wise 8-bit optimizer states."""
BNB_MIN_8BIT = 4096
"""bitsandbytes keeps fp32 states for tensors with fewer values (`min_8bit_size`)."""


@dataclass(frozen=True)
class Trained:
    """The trained tensors, as the optimizer sees them: the matrices by shape, and the count
    of values in 1-D tensors (norms, biases)."""

    matrices: tuple[tuple[int, int], ...]
    vectors: int = 0

    @classmethod
    def of(cls, shape: Architecture, lora: list[LinearLayer] | None, rank: int) -> Trained:
        """LoRA: A (r × in) and B (out × r) of every adapted module; else every weight."""
        if lora is not None:
            return cls(tuple(pair for m in lora
                             for pair in ((rank, m.in_features), (m.out_features, rank))))
        tree = shape.modules
        tables = [*tree.embeddings, *([tree.head] if tree.head and not shape.tied else [])]
        matrices = tuple((t.out_features, t.in_features) for t in (*tree.linears, *tables))
        return cls(matrices, shape.params - sum(r * c for r, c in matrices))

    @property
    def numel(self) -> int:
        return sum(r * c for r, c in self.matrices) + self.vectors

    @property
    def largest(self) -> int:
        """Values of the largest matrix (the vectors, norms and biases, are far smaller)."""
        return max((r * c for r, c in self.matrices), default=0)


def state_bytes(kind: str, trained: Trained, master: int) -> int:
    """Bytes of `kind`'s state for `trained`, the weights kept in `master` bytes each."""
    if kind == "adamw":
        return 2 * master * trained.numel
    if kind == "adafactor":
        return 4 * (sum(r + c for r, c in trained.matrices) + trained.vectors)
    # 8-bit: each matrix on its own; the vectors, small, with fp32 states
    return sum(_bnb(r * c) for r, c in trained.matrices) + 8 * trained.vectors


def _bnb(n: int) -> int:
    return 8 * n if n < BNB_MIN_8BIT else 2 * n + 8 * math.ceil(n / BNB_BLOCK)


def step_bytes(kind: str, trained: Trained, master: int, device: str = "cuda") -> int:
    """What one optimizer step on `device` allocates on top of the states (see the module
    docstring)."""
    if kind == "adafactor":
        return 4 * trained.largest * (2 if master == 4 else 4)
    if kind in ("adamw_8bit", "paged_adamw_8bit") and device == "cpu":
        return 4 * trained.largest * (5 if master == 4 else 6)
    return 0


def describe(kind: str, master: int) -> tuple[str, str]:
    """(label, how) of the state term."""
    return {
        "adamw": ("AdamW states", f"m, v × {master} B"),
        "adamw_8bit": ("8-bit AdamW states", "uint8 m, v + fp32 absmax per 256 (bitsandbytes)"),
        "paged_adamw_8bit": ("paged 8-bit AdamW states",
                             "as adamw_8bit, in CUDA managed memory (pages to host under pressure)"),
        "adafactor": ("Adafactor states", "fp32 row + column means per matrix, fp32 per vector"),
    }[kind]
