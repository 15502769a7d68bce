"""The projections a native decode runs on: each layer's q/k/v and gate/up fused into one
weight, LoRA adapters merged in, laid out for the CPU's faster float32 kernel
(`mogrpo.kernels.decode_weight`: packed for MKL on Intel CPUs, for oneDNN elsewhere);
built once per rollout (the weights change at every optimizer step), or once for many calls
inside `held_projections`. Layers that cannot be made plain (quantised, DoRA) run their own
modules. Under autocast (mixed precision: float32 master weights) the copies are made in its
dtype, the product autocast would compute at every step, cast once per rollout instead.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from mogrpo.errors import ModelError
from mogrpo.kernels import KEEP_MAX_BYTES, Packed, decode_weight
from mogrpo.rollout.layer_ops import Attention, Linear, Norm, pair_order
from mogrpo.rollout.layout import (
    layout_of,
    rms_norm_of,
    unwrap_causal_lm,
)
from mogrpo.rollout.weights import merged_lora_weight

# The plain projections copy q/k/v, gate/up and every LoRA layer once per rollout; above this
# many bytes of copies the model's own modules are called instead, unless the caller has room
# for them (full fine-tuning on a CPU: `TrainContext.plain_max_bytes`). The copies still pay:
# a 114 M-parameter Qwen2 decodes 16 rows x 32 tokens in 2.1 s of CPU through them and in
# 3.1 s through its modules (Zen 4, one thread).
PLAIN_MAX_BYTES = 256 * 2**20
HEAD_COPY_MAX_BYTES = 16 * 2**20  # see `_head_weight`


@dataclass
class PlainLayer:
    """One layer's projections as plain (weight, bias) pairs, LoRA merged in, q/k/v and
    gate/up fused: a decode step then costs one matmul per pair and no module calls."""

    qkv: Linear  # [(H + 2 H_kv) D, hidden]
    out: Linear  # o_proj
    gate_up: Linear  # [2 I, hidden]
    down: Linear
    act: Callable[[Tensor], Tensor]
    norms: tuple[Norm, Norm] | None = None  # the two RMSNorms' (weight, eps), when fused


@dataclass
class Projections:
    """The `plain_projections` a `NativeDecoder` of a model decodes with (None: its modules
    run), built once for several decode calls on the same weights — the generation batches of
    one rollout, each of which would otherwise fuse, merge and pack every projection again
    (~16 ms a call at 8 M parameters)."""

    layers: list[PlainLayer] | None
    head: Tensor | Packed | None = None  # the output head's weight (`_head_weight`)
    # whether each layer's q and k rows are in `pair_rows` order (`_pairs`): the decoder then
    # turns them as complex pairs
    pairs: bool = False


# the models whose projections are held between decode calls (`held_projections`): model ->
# (the state of the weights and the budget they were built for, the Projections), or None
_HELD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@contextmanager
def held_projections(model: nn.Module) -> Iterator[None]:
    """Inside, `decode_projections(model)` builds the model's projections once and returns the
    same ones to every later call, until the weights change (an optimizer step, a load, LoRA
    adapters switched: `_weights_state`) or the budget does; they are let go on exit (the
    outermost one where nested).

    For callers that decode batch after batch with the same weights: `mogrpo predict`, the
    quick eval, `mogrpo serve`. Fusing and packing are ~7 % of a rollout of 16 rows x 32 tokens
    at 8 M parameters and ~11 % at 32 M (Xeon, `benchmarks/decode_breakdown.py`). A training
    rollout does not hold them: the update changes the weights at every step, and the copies
    would stay in memory through it."""
    lm = unwrap_causal_lm(model)
    if lm in _HELD:
        yield
        return
    _HELD[lm] = None
    try:
        yield
    finally:
        _HELD.pop(lm, None)


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast computes in on `device` where it is on (mixed precision), else None."""
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) \
        else None


def _weights_state(lm: nn.Module) -> tuple:
    """What `held_projections` compares: each parameter's storage and version counter (bumped by
    every in-place change: an optimizer step, `load_state_dict`), which LoRA adapters are
    switched on, and the autocast dtype the copies are made in."""
    return (tuple((p.data_ptr(), p._version) for p in lm.parameters()),
            tuple((m.disable_adapters, tuple(m.active_adapters)) for m in lm.modules()
                  if hasattr(m, "lora_A")),
            autocast_dtype(next(lm.parameters()).device))


def decode_projections(model: nn.Module, max_bytes: int | None = None) -> Projections:
    """`Projections` of the model's current weights (build again after they change), copies of
    at most `max_bytes` (None: PLAIN_MAX_BYTES); inside `held_projections`, the held ones while
    the weights are unchanged."""
    lm = unwrap_causal_lm(model)
    if lm not in _HELD:
        return _build_projections(lm, max_bytes)
    key = (_weights_state(lm), max_bytes)
    held = _HELD[lm]
    if held is not None and held[0] == key:
        return held[1]
    _HELD[lm] = None  # the old copies go first: a small model's buffers then take the new packs
    projections = _build_projections(lm, max_bytes)
    _HELD[lm] = (key, projections)
    return projections


def _build_projections(lm: nn.Module, max_bytes: int | None) -> Projections:
    attention, halves = layout_of(lm)
    param = next(lm.parameters())
    dtype = autocast_dtype(param.device)  # None: the weights' own
    pairs = _pairs(dtype or param.dtype, halves)
    layers, head = list(lm.model.layers), lm.get_output_embeddings()
    # MKL's packed buffers kept for the next rollout where the weights are small (mkl_packed)
    layer_bytes = _linear_bytes(layers, dtype)
    keep = layer_bytes + _linear_bytes([head], dtype) <= KEEP_MAX_BYTES
    return Projections(plain_projections(layers, attention if pairs else None,
                                         max_bytes=max_bytes, keep=keep,
                                         linear_bytes=layer_bytes, dtype=dtype),
                       _head_weight(head, keep, dtype), pairs=pairs)


def _linear_bytes(modules: list[nn.Module], dtype: torch.dtype | None = None) -> int:
    """The bytes of every `nn.Linear` weight in `modules` (peft's base layers included), copied
    in `dtype` (None: their own)."""
    size = None if dtype is None else torch.finfo(dtype).bits // 8
    return sum(m.weight.numel() * (size or m.weight.element_size()) for module in modules
               for m in module.modules() if isinstance(m, nn.Linear))


def _head_weight(head: nn.Module, keep: bool = False,
                 dtype: torch.dtype | None = None) -> Tensor | Packed | None:
    """The weight of an `nn.Linear` output head (in `dtype`, where given) as `decode_weight`
    lays it out (`keep` as there), where that copy takes at most HEAD_COPY_MAX_BYTES (a large
    vocabulary's head is read in place: its product is throughput-bound however it is laid
    out); None for other heads (their module runs)."""
    if type(head) is not nn.Linear:
        return None
    w = head.weight
    if w.numel() * torch.finfo(dtype or w.dtype).bits // 8 > HEAD_COPY_MAX_BYTES:
        return w
    return decode_weight(_in_dtype(w, dtype), keep)


def _in_dtype(t: Tensor | None, dtype: torch.dtype | None) -> Tensor | None:
    """`t` detached and cast to `dtype` (None, or its own dtype: `t` itself)."""
    if t is None or dtype is None or t.dtype == dtype or not t.is_floating_point():
        return t
    return t.detach().to(dtype)


def _pairs(dtype: torch.dtype, halves: bool) -> bool:
    """Projections in float32/64: q and k rotated as complex pairs (their rows interleaved)."""
    return halves and dtype in (torch.float32, torch.float64)


def pair_rows(attention: Attention, rows: int, device: torch.device) -> Tensor:
    """An order of the fused q/k/v projection's `rows` that reorders each q and k head's rows
    (0, D/2, 1, D/2 + 1, ...), so each rotary pair of `rotate_pairs` sits side by side; v
    stays as it is. Keys and queries are reordered alike, so their products, and the attention,
    are unchanged. One tensor per shape, shared by every call (an index: never written)."""
    return pair_order(attention.heads + attention.kv_heads, attention.head_dim, rows, device)


def _plain_linear(module: nn.Module) -> Linear | None:
    """(weight, bias) of an nn.Linear, or of a peft LoRA layer with its adapters merged in
    (out of place, as peft computes `W + scale B A`); None for anything else (quantised
    layers, DoRA, LoRA bias terms), whose own forward must then run."""
    if type(module) is nn.Linear:
        return module.weight, module.bias
    base = module.get_base_layer() if hasattr(module, "lora_A") else None
    if type(base) is not nn.Linear:
        return None
    try:
        return merged_lora_weight(module), base.bias
    except ModelError:  # DoRA or LoRA bias: only the layer's own forward computes it
        return None


def _fuse(parts: list[Linear | None], order: Tensor | None = None,
          dtype: torch.dtype | None = None) -> Linear | None:
    """One (weight, bias) computing every part's output side by side, its rows in `order`
    where given (an order that keeps each part's rows among its own, as `pair_rows` does:
    applied in the same copy, which for a large model is most of the cost of fusing); in
    `dtype` where given (None: the parts' own; cast in the same copy)."""
    if any(p is None for p in parts):
        return None
    if len(parts) == 1 and order is None:
        return _in_dtype(parts[0][0], dtype), _in_dtype(parts[0][1], dtype)
    weights = [w.detach() for w, _ in parts]  # (a copy: nothing to differentiate)
    weight = weights[0].new_empty(sum(len(w) for w in weights), weights[0].shape[1],
                                  dtype=dtype or weights[0].dtype)
    start = 0
    for w in weights:
        end = start + len(w)
        if order is None:
            weight[start:end].copy_(w)
        else:
            torch.index_select(w, 0, order[start:end] - start, out=weight[start:end])
        start = end
    if all(b is None for _, b in parts):
        return weight, None
    bias = torch.cat([b.detach() if b is not None else w.new_zeros(len(w)) for w, b in parts])
    return weight, _in_dtype(bias if order is None else bias[order], dtype)


def projection_names(layer: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...], Callable] | None:
    """(attention projection names, gate/up names, activation) of a layer — q/k/v or Phi-3's
    fused qkv, gate/up or its gate_up — or None when its MLP has another layout."""
    attn, mlp = layer.self_attn, layer.mlp
    names = ("qkv_proj",) if hasattr(attn, "qkv_proj") else ("q_proj", "k_proj", "v_proj")
    up = ("gate_up_proj",) if hasattr(mlp, "gate_up_proj") else ("gate_proj", "up_proj")
    act = getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None)  # Phi-3
    if act is None or not all(hasattr(mlp, n) for n in (*up, "down_proj")):
        return None
    return names, up, act


def plain_projections(layers: list[nn.Module], pairs: list[Attention] | None = None, *,
                      max_bytes: int | None = None, keep: bool = False,
                      linear_bytes: int | None = None,
                      dtype: torch.dtype | None = None) -> list[PlainLayer] | None:
    """Every layer's projections as plain tensors, or None when one cannot be made plain or the
    copies (at most the layers' linear weights, `linear_bytes` where the caller has counted
    them) would exceed `max_bytes` (None: PLAIN_MAX_BYTES). Built once per rollout (the weights
    change at every optimizer step). With `pairs` (each layer's attention shapes) the q and k
    rows are in `pair_rows` order; `keep` as for `decode_weight`; copies in `dtype` (autocast's,
    under mixed precision) where given."""
    if linear_bytes is None:
        linear_bytes = _linear_bytes(layers)
    if linear_bytes > (PLAIN_MAX_BYTES if max_bytes is None else max_bytes):
        return None
    plain = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        parts = projection_names(layer)
        if parts is None:
            return None
        names, up, act = parts
        qkv_parts = [_plain_linear(getattr(attn, n)) for n in names]
        order = None
        if pairs is not None and all(p is not None for p in qkv_parts):
            order = pair_rows(pairs[len(plain)], sum(len(p[0]) for p in qkv_parts),
                               qkv_parts[0][0].device)
        qkv = _fuse(qkv_parts, order, dtype)
        gate_up = _fuse([_plain_linear(getattr(mlp, n)) for n in up], dtype=dtype)
        out, down = (_fuse([_plain_linear(m)], dtype=dtype) for m in (attn.o_proj, mlp.down_proj))
        if qkv is None or gate_up is None or out is None or down is None:
            return None
        packed = [(decode_weight(w, keep), b) for w, b in (qkv, out, gate_up, down)]
        first, second = (rms_norm_of(layer.input_layernorm),
                         rms_norm_of(layer.post_attention_layernorm))
        norms = (first, second) if first and second else None
        plain.append(PlainLayer(*packed, act=act, norms=norms))
    return plain
