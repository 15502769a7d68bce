"""The input embedding and the output head of a 4-bit base in NF4 too (`model.embeddings_in_4bit`).

bitsandbytes and transformers quantise the linear layers only; the embedding and the head stay
16-bit, 2 B a parameter, which is 11-28 % of the models users train (Qwen2.5-0.5B: 0.93 B a
parameter for the whole base instead of 0.52). Here both are NF4 with double quantisation,
as the linear layers (`NF4_BYTES`): the head a bitsandbytes `Linear4bit`, the embedding
`NF4Embedding`, which dequantises only the rows it looks up. A tied head and embedding share
one 4-bit weight, as they shared one 16-bit weight.

The cost: the head's logits come from a weight with NF4's rounding (the embedding's rows
too), and the head is dequantised whole for each product — `Linear4bit`'s forward in prefill
and decoding, `OutputHead.weight` for mogrpo's chunked log-prob head — so while it runs a
[V, H] copy in the compute dtype exists again. The planner counts that copy (`mogrpo.memory`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

BLOCK = 64
"""Values per NF4 absmax block: QLoRA's and transformers' (`bnb_4bit_blocksize` default)."""


def nf4(weight: Tensor) -> Any:
    """`weight` [V, H] as a frozen bitsandbytes `Params4bit`: NF4 codes, two a byte, an 8-bit
    absmax per 64 values and an fp32 constant per 256 absmax (double quantisation)."""
    import bitsandbytes as bnb

    packed, state = bnb.functional.quantize_4bit(
        weight.detach(), blocksize=BLOCK, compress_statistics=True, quant_type="nf4",
        quant_storage=torch.uint8)
    return bnb.nn.Params4bit(packed, requires_grad=False, quant_state=state, blocksize=BLOCK,
                             compress_statistics=True, quant_type="nf4", bnb_quantized=True)


class NF4Embedding(nn.Module):
    """An embedding table in NF4 (a `Params4bit` [V, H], the tied head's own weight where they
    are tied) returning rows in `dtype`. With H a multiple of 64 (896, 1536, 4096 and 5120 of
    the models in docs/memory.md) a row is whole blocks: its codes and absmax are looked up as rows of their own and
    only they are dequantised; otherwise the whole table is, for each call."""

    def __init__(self, weight: Any, padding_idx: int | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = weight
        self.num_embeddings, self.embedding_dim = weight.quant_state.shape
        self.padding_idx = padding_idx
        self.dtype = dtype

    def forward(self, ids: Tensor) -> Tensor:
        import bitsandbytes as bnb
        from bitsandbytes.functional import QuantState

        state = self.weight.quant_state
        V, H = self.num_embeddings, self.embedding_dim
        if H % state.blocksize:
            table = bnb.functional.dequantize_4bit(self.weight.data, state)
            return F.embedding(ids, table, self.padding_idx).to(self.dtype)
        per_row = H // state.blocksize
        codes = F.embedding(ids, self.weight.data.view(V, H // 2))  # [..., H/2] uint8
        blocks = ids[..., None] * per_row + torch.arange(per_row, device=ids.device)  # [..., H/64]
        absmax = state.absmax[blocks]
        if state.nested:  # 8-bit absmax: code value × its 256-block's fp32 constant + offset
            outer = state.state2
            absmax = (outer.code[absmax.long()] * outer.absmax[blocks // outer.blocksize]
                      + state.offset)
        rows = QuantState(absmax=absmax.reshape(-1).float(), shape=torch.Size((*ids.shape, H)),
                          code=state.code, blocksize=state.blocksize,
                          quant_type=state.quant_type, dtype=self.dtype)
        return bnb.functional.dequantize_4bit(codes.reshape(-1, 1), rows)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, nf4, dtype={self.dtype}"


def quantize_embeddings(model: nn.Module, compute_dtype: torch.dtype) -> list[str]:
    """Replace `model`'s input embedding by an `NF4Embedding` and its output head (an
    `nn.Linear` without bias) by a bitsandbytes `Linear4bit` computing in `compute_dtype`, the
    two on one 4-bit weight where they are tied. Returns what was quantised ("embedding",
    "head" or "embedding and head (tied)")."""
    import bitsandbytes as bnb

    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is embedding.weight
    weight = nf4(embedding.weight)
    model.set_input_embeddings(NF4Embedding(weight, embedding.padding_idx, compute_dtype))
    if type(head) is not nn.Linear or head.bias is not None:
        return ["embedding"]
    linear = bnb.nn.Linear4bit(head.in_features, head.out_features, bias=False,
                               compute_dtype=compute_dtype, compress_statistics=True,
                               quant_type="nf4", device="meta")
    linear.weight = weight if tied else nf4(head.weight)
    model.set_output_embeddings(linear)
    return ["embedding and head (tied)"] if tied else ["embedding", "head"]
