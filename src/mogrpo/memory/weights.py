"""What the planner counts for the weights: trained ones in the master dtype, a frozen LoRA
base in the compute one, a quantised base's linear layers in 4 or 8 bits, and its embedding
and head too with `model.embeddings_in_4bit` (docs/memory.md, "Small GPUs")."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from mogrpo.config import RunConfig
from mogrpo.config.hardware import quantized_field
from mogrpo.config.precision import MASTER_BYTES

if TYPE_CHECKING:
    from mogrpo.modeling.architecture import Architecture

NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)
"""bitsandbytes NF4 with double quantisation (QLoRA, Dettmers et al. 2023): 4 bits per weight,
an 8-bit absmax per 64-weight block and an fp32 constant per 256 blocks = 4.127 bits."""


def weight_label(run: RunConfig) -> str:
    """The weights term's label: the quantised base's bits where there are some."""
    quantized = quantized_field(run.model)
    return "weights" if not quantized else (
        "weights (4-bit NF4)" if quantized.endswith("4bit") else "weights (8-bit)")


def weight_bytes(shape: Architecture, run: RunConfig, precision: str) -> tuple[int, str]:
    """Bytes of every weight (trained in the master dtype, a frozen LoRA base in the compute
    one), and how. A quantised base: its linear weights in 4 or 8 bits, its 1-D weights in
    the master dtype (fp32 but under pure bf16: `mogrpo.modeling.quantize`), the embedding and
    head in the compute dtype, or in NF4 with `model.embeddings_in_4bit` (a tied pair once)."""
    n_all, n_lin = shape.params, shape.linear_params()
    master, compute = MASTER_BYTES[precision], 4 if precision == "fp32" else 2
    quantized = quantized_field(run.model)
    if not quantized:
        w = compute if run.lora.enabled else master
        return n_all * w, f"{n_all / 1e9:.2f} B × {w} B"
    n_emb = shape.embedding_params()
    n_vec = n_all - n_lin - n_emb
    if quantized.endswith("4bit"):
        lin, each = n_lin * NF4_BYTES, f"× {NF4_BYTES:.3f} B"
    else:  # int8 codes and an fp32 scale per output row (LLM.int8()'s SCB)
        rows = sum(lin.out_features for lin in shape.modules.linears)
        lin, each = n_lin + 4 * rows, f"× 1 B + {rows:,} row scales × 4 B"
    emb, emb_each = n_emb * compute, f"{compute} B"
    if quantized.endswith("4bit") and run.model.embeddings_in_4bit:
        emb, emb_each = n_emb * NF4_BYTES, f"{NF4_BYTES:.3f} B"
    return (int(math.ceil(lin + emb)) + n_vec * master,
            f"{n_lin / 1e9:.2f} B linear weights {each} + {n_emb / 1e9:.2f} B embedding/head "
            f"× {emb_each} + {n_vec / 1e6:.2f} M norms, biases × {master} B")
