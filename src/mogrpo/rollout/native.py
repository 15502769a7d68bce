"""mogrpo's own decode loop: one batched prefill (each distinct prompt once), a preallocated KV
cache, finished rows removed.

`generate()` spends most of a small model's decode step in per-token Python (cache objects,
mask building, processor lists, stopping criteria). This engine keeps only what the math
needs: the model's own modules (embeddings, norms, rotary tables, output head) are called
directly, attention runs on a cache allocated once for prompt + completion budget, and the
sampling rules are a few tensor operations (`SamplingRules`). Rows that hit a stop id leave the
batch, so the cost follows the live rows.

The projections run on plain weights built once per call (`plain_projections`; once for many
calls inside `held_projections`, while the weights do not change): q/k/v in one matrix, gate/up
in one, LoRA adapters merged in, and laid out for the CPU's faster float32 kernel
(`mogrpo.algo.cpu_linear.decode_weight`: packed for MKL on Intel CPUs, for oneDNN elsewhere),
so a layer costs four matmuls and no module calls; a decode step writes the q/k/v and gate/up
products into buffers it reuses (`cpu_linear.decode_product`). Layers that cannot be made
plain (quantised, DoRA) run their own modules. On CPUs the one-query attention of a decode step
is three small operations instead of SDPA's padded flash kernel.

It covers the decoder families whose layers share the Llama layout (pre-norm, rotary,
grouped-query attention, an MLP module): Llama, Mistral, Qwen2, Qwen3, Gemma, Phi-3.
`unsupported_reason()` says why any other model cannot run here; the caller falls back to
`generate()`.

`score_logits()` is the same structure run over whole completions for the passes that need no
gradient (the KL reference, rollout-time log-probs): each distinct prompt once, the model's own
linear products, and the log-probs equal the model's forward bit for bit where it applies
(float32 RMSNorm models: Llama, Mistral, Qwen2, Qwen3, Phi-3). On a CPU it also
computes the update's forward, with gradients (`trains_here`: the model unwrapped, no
checkpointing, no dropout left), so the policy's log-probs equal the reference's to the bit
while their weights are equal.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mogrpo.algo import mkl_packed
from mogrpo.algo.cpu_linear import (
    decode_add_product,
    decode_linear,
    decode_product,
    decode_weight,
    linear,
    trained_linear,
)
from mogrpo.algo.logprobs import (
    distinct_prompts,
    sharded,
    shares_prompts,
    token_positions,
    wrapper_chain,
)
from mogrpo.algo.mkl_packed import KEEP_MAX_BYTES, Packed
from mogrpo.modeling.dropout import active_dropout
from mogrpo.rollout import cpu_kernel
from mogrpo.rollout.sampling import SamplingRules

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "phi3")
_STATIC_ROPE = ("default", "linear", "llama3")
_SDPA_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)
# The plain projections copy q/k/v, gate/up and every LoRA layer once per rollout; above this
# many bytes of copies the model's own modules are called instead, unless the caller has room
# for them (full fine-tuning on a CPU: `TrainContext.plain_max_bytes`). The copies still pay:
# a 114 M-parameter Qwen2 decodes 16 rows x 32 tokens in 2.1 s of CPU through them and in
# 3.1 s through its modules (Zen 4, one thread).
PLAIN_MAX_BYTES = 256 * 2**20
HEAD_COPY_MAX_BYTES = 16 * 2**20


def unwrap_causal_lm(model: nn.Module) -> nn.Module:
    """The Hugging Face causal LM inside peft / DDP / torch.compile wrappers."""
    *_, lm = wrapper_chain(model)
    return lm


def unsupported_reason(model: nn.Module, total_length: int) -> str | None:
    """Why the native engine cannot decode this model (None when it can)."""
    lm = unwrap_causal_lm(model)
    config = getattr(lm, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_FAMILIES:
        return (f"model type {model_type!r} is not one of the native engine's families "
                f"({', '.join(SUPPORTED_FAMILIES)})")
    backbone = getattr(lm, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if backbone is None or not all(hasattr(backbone, n) for n in needed) \
            or lm.get_output_embeddings() is None:
        return f"the {model_type} model does not have the standard decoder layout"
    rope_type = getattr(backbone.rotary_emb, "rope_type", "default")
    if rope_type not in _STATIC_ROPE:
        return f"rope type {rope_type!r} depends on the sequence length"
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) and total_length > window:
        return f"prompt + completion ({total_length}) exceeds the sliding window ({window})"
    return None


@dataclass
class _Attention:
    """One layer's attention projections and shapes."""

    module: nn.Module
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    rotary: object  # the model family's apply_rotary_pos_emb
    # Qwen3's RMSNorms of each q head and each k head (q_norm, k_norm), run between the
    # projection and the rotation; None for the families without them
    head_norms: tuple[nn.Module, nn.Module] | None = None


Linear = tuple[Tensor, "Tensor | None"]  # (weight [out, in], bias [out] or None)
Norm = tuple[Tensor, float]  # an RMSNorm's (weight [hidden], eps)


@dataclass
class _Plain:
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

    layers: list[_Plain] | None
    head: Tensor | Packed | None = None  # the output head's weight (`_head_weight`)


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


def _weights_state(lm: nn.Module) -> tuple:
    """What `held_projections` compares: each parameter's storage and version counter (bumped by
    every in-place change: an optimizer step, `load_state_dict`), and which LoRA adapters are
    switched on."""
    return (tuple((p.data_ptr(), p._version) for p in lm.parameters()),
            tuple((m.disable_adapters, tuple(m.active_adapters)) for m in lm.modules()
                  if hasattr(m, "lora_A")))


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
    attention, halves = _layout_of(lm)
    pairs = _pairs(lm, halves)
    layers, head = list(lm.model.layers), lm.get_output_embeddings()
    # MKL's packed buffers kept for the next rollout where the weights are small (mkl_packed)
    layer_bytes = _linear_bytes(layers)
    keep = layer_bytes + _linear_bytes([head]) <= KEEP_MAX_BYTES
    return Projections(plain_projections(layers, attention if pairs else None,
                                         max_bytes=max_bytes, keep=keep,
                                         linear_bytes=layer_bytes),
                       _head_weight(head, keep))


def _linear_bytes(modules: list[nn.Module]) -> int:
    """The bytes of every `nn.Linear` weight in `modules` (peft's base layers included)."""
    return sum(m.weight.numel() * m.weight.element_size() for module in modules
               for m in module.modules() if isinstance(m, nn.Linear))


def _head_weight(head: nn.Module, keep: bool = False) -> Tensor | Packed | None:
    """The weight of an `nn.Linear` output head as `decode_weight` lays it out (`keep` as
    there), where that copy takes at most HEAD_COPY_MAX_BYTES (a large vocabulary's head is
    read in place: its product is throughput-bound however it is laid out); None for other
    heads (their module runs)."""
    if type(head) is not nn.Linear:
        return None
    w = head.weight
    return decode_weight(w, keep) if w.numel() * w.element_size() <= HEAD_COPY_MAX_BYTES else w


def _pairs(lm: nn.Module, halves: bool) -> bool:
    """float32/64 weights: q and k rotated as complex pairs (their rows interleaved)."""
    return halves and next(lm.parameters()).dtype in (torch.float32, torch.float64)


class NativeDecoder:
    """Prefill and per-token decode over a preallocated KV cache, for one batch of prompts."""

    def __init__(self, model: nn.Module, projections: Projections | None = None) -> None:
        """`projections`: `decode_projections(model)` of the model's current weights, when the
        caller keeps them for several calls; built here when not given."""
        lm = unwrap_causal_lm(model)
        self.backbone = lm.model
        self.head = lm.get_output_embeddings()
        self.layers = list(self.backbone.layers)
        self.attention, halves = _layout_of(lm)
        pairs = _pairs(lm, halves)
        projections = projections or decode_projections(model)
        self.plain = projections.layers  # None: call the modules
        self.head_weight = projections.head
        self.rotate_halves = self.plain is not None and halves
        self.pairs = self.rotate_halves and pairs
        # per layer, Qwen3's norms of each q and k head on the rows as this decoder orders them
        self.head_norms = [_head_norms(a, self.pairs) if self.rotate_halves else None
                           for a in self.attention]
        self.final_norm = _rms_norm_of(self.backbone.norm)
        # `_logits`' norm (the decoder runs in inference mode: see `native_decode`)
        self.final_norm_step = _bound_norm(self.backbone.norm, self.final_norm)
        embed = self.backbone.embed_tokens
        # the token embedding without the module call where it is a plain lookup
        self.embed = functools.partial(F.embedding, weight=embed.weight,
                                       padding_idx=embed.padding_idx) \
            if type(embed) is nn.Embedding and embed.max_norm is None else embed
        self.step_layers: list[tuple] | None = None  # see _step_layers
        self.compiled = None  # cpu_kernel's step of these layers, where it runs them
        self.compiled_head = False  # whether that step also computes the logits
        self.half_cos = self.half_sin = torch.empty(0)  # [T_max, 2, D/2]: see prefill
        self.freqs = torch.empty(0)  # [T_max, D/2] complex cos + i sin: see prefill
        self.keys: list[Tensor] = []  # per layer [B, H_kv, T_max, D]
        self.values: list[Tensor] = []
        self.valid = torch.empty(0)  # [B, T_max] bool: key positions a query may attend to
        # [B, H_kv, T_max] float, 0 where valid, -inf elsewhere (per key head: see _attend_one)
        self.bias = torch.empty(0)
        self.positions = torch.empty(0)  # [B] the position id of the first generated token
        self.turns = torch.empty(0)  # [N, B, D/2] complex rotation of each new token: prefill
        self.prompt_columns = 0  # P: the cache column of the first generated token
        self.length = 0  # columns of the cache filled so far
        self.cos = self.sin = torch.empty(0)  # [T_max, D] rotary tables

    def prefill(self, prompt_ids: Tensor, prompt_mask: Tensor, max_new_tokens: int) -> Tensor:
        """Run the prompts [B, P] (left-padded), fill the cache; last-position logits [B, V].

        Rows holding the same prompt (the K completions of a group) are run once: their keys,
        values and first logits are the same, so each distinct row is computed and copied to
        every row that holds it (a K-th of the prefill's arithmetic)."""
        P = prompt_ids.shape[1]
        groups = distinct_prompts(prompt_ids, prompt_mask)
        if groups is None:
            return self._prefill(prompt_ids, prompt_mask, max_new_tokens)
        distinct, inverse = groups  # [U, 2P], [B]
        logits = self._prefill(distinct[:, :P], distinct[:, P:], max_new_tokens)  # [U, V]
        self.keep(inverse)
        return logits[inverse]

    def _prefill(self, prompt_ids: Tensor, prompt_mask: Tensor, max_new_tokens: int) -> Tensor:
        B, P = prompt_ids.shape
        total = P + max_new_tokens
        x = self.backbone.embed_tokens(prompt_ids)  # [B, P, H]
        dtype, device = x.dtype, x.device
        # Rotary tables for every position once: the rows are looked up per token afterwards.
        cos, sin = self.backbone.rotary_emb(x, torch.arange(total, device=device)[None])
        self.cos, self.sin = cos[0], sin[0]  # [T_max, D]
        if self.pairs:
            half = self.cos.shape[-1] // 2
            self.freqs = torch.complex(self.cos[:, :half], self.sin[:, :half])  # [T_max, D/2]
        elif self.rotate_halves:
            self.half_cos, self.half_sin = _halves(self.cos, self.sin)  # [T_max, 2, D/2]
        first = self.attention[0]
        shape = (B, first.kv_heads, total, first.head_dim)
        # columns are written before they are read (a query sees only columns up to its own)
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in self.layers]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in self.layers]
        # every generated column is valid for every live row (finished rows leave the batch),
        # so the masks are complete up front: a decode step only widens its view of them
        self.valid = torch.ones(B, total, dtype=torch.bool, device=device)
        self.valid[:, :P] = prompt_mask.bool()
        bias = torch.zeros(B, 1, total, dtype=dtype, device=device).masked_fill_(
            ~self.valid[:, None], float("-inf"))
        self.bias = bias.expand(B, first.kv_heads, total).contiguous()
        positions = token_positions(prompt_mask.long())  # [B, P], as generate()
        self.positions = positions[:, -1] + 1
        self.prompt_columns = P
        if self.pairs:  # each new token's turn, looked up per row once rather than per token
            steps = torch.arange(max_new_tokens, device=device)
            self.turns = self.freqs[steps[:, None] + self.positions]  # [N, B, D/2]
        # Causal over real tokens; a pad query sees itself only, so no row is all masked.
        causal = torch.ones(P, P, dtype=torch.bool, device=device).tril()
        mask = causal[None] & self.valid[:, None, :P]  # [B, P, P]
        mask = mask | torch.eye(P, dtype=torch.bool, device=device)[None]
        self.length = 0
        hidden = self._forward(x, positions, mask[:, None])  # [B, P, H]
        return self._logits(hidden[:, -1])

    def step(self, tokens: Tensor) -> Tensor:
        """Feed one token per row [B]; next-token logits [B, V]."""
        if self.pairs and tokens.device.type == "cpu":
            return self._step_pairs(tokens)
        x = self.backbone.embed_tokens(tokens[:, None])  # [B, 1, H]
        column = self.length
        if x.device.type == "cpu":  # additive, the same for every layer: see _attend_one
            mask = self._step_bias(column + 1)
        else:
            mask = self.valid[:, None, None, : column + 1]  # [B, 1, 1, S]
        positions = self.positions + (column - self.prompt_columns)
        hidden = self._forward(x, positions[:, None], mask)
        return self._logits(hidden[:, -1])

    def _step_bias(self, columns: int) -> Tensor:
        """The additive mask of a decode step's query over `columns` keys, per key head
        [B * H_kv, 1, columns] (a view; see `_attend_one`)."""
        B, kv_heads, total = self.bias.shape
        return self.bias.view(B * kv_heads, 1, total)[:, :, :columns]

    def _step_pairs(self, tokens: Tensor) -> Tensor:
        """`step` on the plain layers with q, k as complex pairs, on a CPU: the same arithmetic
        as `_forward` with two-dimensional hidden states [B, H] and the one-query attention
        of `_attend_one`, in about two thirds of its operations (at a 0.7 M-parameter model
        a decode step is mostly the cost of launching ~100 small ones), each layer's weights,
        kernels and shapes looked up once per decode call (`_step_layers`)."""
        B, column = len(tokens), self.length
        S = column + 1
        x = self.embed(tokens)  # [B, H]
        if self.step_layers is None and self.compiled is None:  # the first step
            self.compiled, self.compiled_head = _compiled_stack(self, B)
            if self.compiled is None:
                self.step_layers = self._step_layers(B)
        if self.compiled is not None:  # the same layers in one call (cpu_kernel)
            turn = torch.view_as_real(self.turns[column - self.prompt_columns])  # [B, D/2, 2]
            out = self.compiled.step(x, turn, self.bias, self.keys, self.values, column)
            self.length = S
            return out if self.compiled_head else self._logits(out)
        turns = self.turns[column - self.prompt_columns, :, None]  # [B, 1, D/2]
        D = self.attention[0].head_dim
        bias = self._step_bias(S)
        for i, (norm1, norm2, project_qkv, add_out, project_up, add_down, act, heads, kv_heads,
                scaling, head_norms) in enumerate(self.step_layers):
            qkv = project_qkv(norm1(x))  # [B, (H + 2 H_kv) D]
            turned = heads + kv_heads
            qk = qkv[:, :turned * D]
            if head_norms is not None:  # Qwen3: each head normalised, then turned
                qk = head_norms(qk.view(B, turned, D)).view(B, turned * D)
            qk = _rotate_pairs(qk, turned, turns)  # [B, H + H_kv, D]
            self.keys[i][:, :, column] = qk[:, heads:]
            self.values[i][:, :, column] = qkv[:, turned * D:].view(B, kv_heads, D)
            keys = self.keys[i].view(B * kv_heads, -1, D)[:, :S]  # [B H_kv, S, D]
            values = self.values[i].view(B * kv_heads, -1, D)[:, :S]
            q = qk[:, :heads].reshape(B * kv_heads, heads // kv_heads, D)
            scores = torch.baddbmm(bias, q, keys.transpose(1, 2), alpha=scaling)
            attended = torch.bmm(torch.softmax(scores, dim=-1), values)  # [B H_kv, G, D]
            x = add_out(x, attended.view(B, -1))  # (x is this loop's own)
            gate, up = project_up(norm2(x)).chunk(2, dim=-1)
            x = add_down(x, act(gate) * up)
        self.length = S
        return self._logits(x)

    def _step_layers(self, rows: int) -> list[tuple]:
        """Per layer, what `_step_pairs` computes with for at most `rows` rows: the two norms as
        callables (`_bound_norm`), the q/k/v and gate/up projections as `decode_product`s
        (x -> x w^T + b), o_proj and down_proj as `decode_add_product`s ((acc, x) -> acc +
        x w^T + b: they add into the residual stream), the activation, and the attention's
        shapes and per-head norms."""
        layers = []
        for layer, p, a, head_norms in zip(self.layers, self.plain, self.attention,
                                           self.head_norms, strict=True):
            first, second = p.norms or (None, None)
            norms = (_bound_norm(layer.input_layernorm, first),
                     _bound_norm(layer.post_attention_layernorm, second))
            projections = (decode_product(*p.qkv, rows), decode_add_product(*p.out),
                           decode_product(*p.gate_up, rows), decode_add_product(*p.down))
            layers.append((*norms, *projections, p.act, a.heads, a.kv_heads, a.scaling,
                           head_norms))
        return layers

    def keep(self, rows: Tensor) -> None:
        """Keep the rows `rows` of the cache, in that order (after a prefill of distinct
        prompts, each row gets its prompt's). Only the columns written so far are copied: a
        decode step writes its column before any query reads it."""
        self.keys = [_rows_of(k, rows, self.length) for k in self.keys]
        self.values = [_rows_of(v, rows, self.length) for v in self.values]
        self._keep_row_state(rows)

    def keep_unfinished(self, rows: Tensor) -> None:
        """`keep` for rows that rise strictly (the unfinished ones, when others finish): the
        cache's rows move up in place (`_shift_rows`), only those after the first finished
        row, and no new cache is allocated."""
        moves = _row_moves(rows.tolist())
        self.keys = [_shift_rows(k, moves, len(rows), self.length) for k in self.keys]
        self.values = [_shift_rows(v, moves, len(rows), self.length) for v in self.values]
        self._keep_row_state(rows)

    def _keep_row_state(self, rows: Tensor) -> None:
        """The per-row state beside the cache, for `keep` and `keep_unfinished`."""
        self.valid = self.valid[rows]
        self.bias = self.bias[rows]
        self.positions = self.positions[rows]
        if self.pairs:
            self.turns = self.turns[:, rows]

    def _logits(self, hidden: Tensor) -> Tensor:
        hidden = self.final_norm_step(hidden) if hidden.dtype == torch.float32 else \
            self.backbone.norm(hidden)
        if self.head_weight is not None:
            return decode_linear(hidden, self.head_weight, self.head.bias).float()  # [B, V]
        return self.head(hidden).float()

    def _forward(self, x: Tensor, positions: Tensor, mask: Tensor) -> Tensor:
        """The decoder layers on x [B, T, H] at `positions` [B, T], writing T cache columns."""
        if self.pairs:  # [B, T, 1, D/2] complex (sin unused)
            cos = sin = self.freqs[positions][:, :, None]
        elif self.rotate_halves:  # [B, T, 1, 2, D/2]
            cos, sin = self.half_cos[positions][:, :, None], self.half_sin[positions][:, :, None]
        else:
            cos, sin = self.cos[positions], self.sin[positions]  # [B, T, D]
        start, T = self.length, x.shape[1]
        for i, layer in enumerate(self.layers):
            if self.plain is None:
                h = layer.input_layernorm(x)
                x = x + self._attend(i, h, cos, sin, start, mask)
                x = x + layer.mlp(layer.post_attention_layernorm(x))
                continue
            p = self.plain[i]
            first, second = p.norms or (None, None)
            h = _norm(layer.input_layernorm, first, x)
            x = x + self._attend(i, h, cos, sin, start, mask)
            h = _norm(layer.post_attention_layernorm, second, x)
            gate, up = decode_linear(h, *p.gate_up).chunk(2, dim=-1)
            x = x + decode_linear(p.act(gate) * up, *p.down)
        self.length = start + T
        return x

    def _attend(self, i: int, h: Tensor, cos: Tensor, sin: Tensor, start: int,
                mask: Tensor) -> Tensor:
        """Attention of layer i on h [B, T, H]."""
        a = self.attention[i]
        attn = a.module
        B, T, _ = h.shape
        if self.rotate_halves:  # q and k turned together; cos, sin per half (see prefill)
            qkv = decode_linear(h, *self.plain[i].qkv)  # [B, T, (H + 2 H_kv) D]
            heads = a.heads + a.kv_heads
            qk = qkv[..., :heads * a.head_dim]
            if self.head_norms[i] is not None:  # Qwen3: each head normalised, then turned
                qk = self.head_norms[i](qk.unflatten(-1, (heads, a.head_dim))).flatten(-2)
            # [B, T, H + H_kv, D]
            qk = _rotate_pairs(qk, heads, cos) if self.pairs else _turn(qk, heads, cos, sin)
            q, k = qk[:, :, :a.heads].transpose(1, 2), qk[:, :, a.heads:].transpose(1, 2)
            v = qkv[..., heads * a.head_dim:].unflatten(-1, (a.kv_heads, a.head_dim))
            v = v.transpose(1, 2)
        else:
            if self.plain is None:
                q, k, v = _project_qkv(attn, h, a)
            else:
                w, b = self.plain[i].qkv
                q, k, v = decode_linear(h, w, b).split(
                    [a.heads * a.head_dim, a.kv_heads * a.head_dim, a.kv_heads * a.head_dim],
                    dim=-1)
            q = q.view(B, T, a.heads, a.head_dim)
            k = k.view(B, T, a.kv_heads, a.head_dim)
            if hasattr(attn, "q_norm"):  # Qwen3 normalises each head before the rotation
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = a.rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # [B, H, T, D]
            v = v.view(B, T, a.kv_heads, a.head_dim).transpose(1, 2)
        end = start + T
        self.keys[i][:, :, start:end] = k
        self.values[i][:, :, start:end] = v
        keys, values = self.keys[i][:, :, :end], self.values[i][:, :, :end]
        if T == 1 and mask.is_floating_point():
            out = _attend_one(q, keys, values, mask, a.scaling)
        else:
            out = _sdpa(q, keys, values, mask, a)  # [B, H, T, D]
        out = out.transpose(1, 2).reshape(B, T, a.heads * a.head_dim)
        if self.plain is None:
            return attn.o_proj(out)
        return decode_linear(out, *self.plain[i].out)


_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _compiled_stack(decoder: NativeDecoder, rows: int) -> tuple[object | None, bool]:
    """(`cpu_kernel`'s compiled step of the decoder's layers for at most `rows` rows, whether
    it computes the logits too), or (None, False) where it cannot run the layers: no compiled
    module here, or a layer whose norms are not RMSNorms, whose activation is not SiLU or whose
    products are not float32 weights (MKL or oneDNN packed, or plain). The logits too where
    the final norm is an RMSNorm and the head such a weight (`_head_weight`)."""
    kernel = cpu_kernel.module()
    if kernel is None or decoder.plain is None:
        return None, False
    head_dim = decoder.attention[0].head_dim
    if any(a.head_dim != head_dim or a.heads % a.kv_heads for a in decoder.attention):
        return None, False
    layers = []
    for p in decoder.plain:
        products = [(_compiled_weight(w), b) for w, b in (p.qkv, p.out, p.gate_up, p.down)]
        if p.norms is None or not _silu(p.act) or any(w is None for w, _ in products):
            return None, False
        layers.append(products)
    head = None  # the head's weight as the stack takes it, where it computes the logits
    if decoder.final_norm is not None and decoder.head_weight is not None:
        head = _compiled_weight(decoder.head_weight)
    # MKL's compute function where some product is MKL-packed (its weight an address)
    packed = any(isinstance(w, int) for w in [head, *(w for layer in layers for w, _ in layer)])
    stack = kernel.Stack(mkl_packed.compute_address() if packed else 0, rows,
                         decoder.plain[0].qkv[0].shape[1], head_dim,
                         cpu_kernel.PARALLEL_ATTENTION)
    for p, a, products, head_norms in zip(decoder.plain, decoder.attention, layers,
                                          decoder.head_norms, strict=True):
        (first, eps1), (second, eps2) = p.norms
        (qkv, qkv_b), (out, out_b), (gate_up, gate_up_b), (down, down_b) = products
        # Qwen3's per-head q and k norms, their weights in the order of the pairs' rows
        (q_norm, q_eps), (k_norm, k_eps) = head_norms.paired if head_norms else ((None, 0.0),) * 2
        stack.add_layer(first.detach(), eps1, second.detach(), eps2,
                        qkv, p.qkv[0].shape[0], _detached(qkv_b), out, _detached(out_b),
                        gate_up, p.gate_up[0].shape[0], _detached(gate_up_b),
                        down, p.down[0].shape[1], _detached(down_b),
                        a.heads, a.kv_heads, a.scaling, q_norm, q_eps, k_norm, k_eps)
    if head is None:
        return stack, False
    weight, eps = decoder.final_norm
    stack.set_head(weight.detach(), eps, head, decoder.head_weight.shape[0],
                   _detached(decoder.head.bias))
    return stack, True


def _compiled_weight(w: Tensor | Packed) -> int | Tensor | None:
    """A product's weight as the compiled step takes it: an MKL pack's address, or a float32 CPU
    tensor [out, in] (oneDNN's packed layout or plain); None for anything else."""
    if isinstance(w, Packed):
        return w.address
    if isinstance(w, Tensor) and w.dtype == torch.float32 and w.dim() == 2 and \
            w.device.type == "cpu":
        return w.detach()
    return None


def _silu(act: Callable) -> bool:
    """Whether a layer's activation is SiLU (torch's module or function, transformers')."""
    return act is F.silu or type(act) is nn.SiLU or (
        type(act).__name__ == "SiLUActivation" and type(act).__module__.startswith("transformers"))


def _detached(bias: Tensor | None) -> Tensor | None:
    return None if bias is None else bias.detach()


def _layout_of(lm: nn.Module) -> tuple[list[_Attention], bool]:
    """`_attention_of(lm)` and whether `_rotate_halves_possible`: found once per model (a decode
    call would otherwise spend ~0.1 ms on them; the weights, which change, are read anew)."""
    found = _LAYOUTS.get(lm)
    if found is None:
        attention = _attention_of(lm)
        layers = list(lm.model.layers)
        found = _LAYOUTS[lm] = (attention, _rotate_halves_possible(layers, attention, lm.model))
    return found


def _rows_of(cache: Tensor, rows: Tensor, columns: int) -> Tensor:
    """A cache [len(rows), H_kv, T_max, D] holding `cache`'s rows `rows` in its first
    `columns` columns (the rest left unwritten)."""
    out = cache.new_empty((len(rows), *cache.shape[1:]))
    out[:, :, :columns] = cache[rows, :, :columns]
    return out


def _row_moves(rows: list[int]) -> list[tuple[int, int, int]]:
    """The block copies (first, end, shift) that move rows `rows` (strictly rising) of a
    cache to its first len(rows) rows in place: rows first..end-1 take rows first+shift..
    end-1+shift, in this order. A run of rows with the same shift is copied in blocks of at
    most `shift` rows, so no block overlaps its source, and each source is read before an
    earlier block's copy overwrites it. Rows before the first that leaves stay."""
    moves, i, n = [], 0, len(rows)
    while i < n and rows[i] == i:
        i += 1
    while i < n:
        shift = rows[i] - i
        j = i + 1
        while j < n and rows[j] - j == shift:
            j += 1
        moves.extend((first, min(first + shift, j), shift) for first in range(i, j, shift))
        i = j
    return moves


def _shift_rows(cache: Tensor, moves: list[tuple[int, int, int]], rows: int,
                columns: int) -> Tensor:
    """`cache` [B, H_kv, T_max, D] with `moves` (see `_row_moves`) done on its first `columns`
    columns; its first `rows` rows, a view."""
    for first, end, shift in moves:
        cache[first:end, :, :columns].copy_(cache[first + shift:end + shift, :, :columns])
    return cache[:rows]


def _attention_of(lm: nn.Module) -> list[_Attention]:
    """Each decoder layer's attention module and shapes."""
    config = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
    found = []
    for layer in lm.model.layers:
        attn = layer.self_attn
        head_dim = getattr(attn, "head_dim", config.hidden_size // config.num_attention_heads)
        found.append(_Attention(
            module=attn,
            heads=config.num_attention_heads,
            kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            scaling=getattr(attn, "scaling", head_dim**-0.5),
            rotary=sys.modules[type(attn).__module__].apply_rotary_pos_emb,
            head_norms=(attn.q_norm, attn.k_norm) if hasattr(attn, "q_norm") else None,
        ))
    return found


def _attend_one(q: Tensor, keys: Tensor, values: Tensor, bias: Tensor, scale: float) -> Tensor:
    """Attention of one query per row: q [B, H, 1, D] over keys/values [B, H_kv, S, D] with an
    additive bias [B * H_kv, 1, S] (the same for every layer of a step). On CPUs, SDPA's
    flash kernel pads the single query to a block and costs several times these three small
    operations."""
    B, H, _, D = q.shape
    kv_heads, S = keys.shape[1], keys.shape[2]
    q = q.reshape(B * kv_heads, H // kv_heads, D)  # the query heads of each key head together
    # bias + scale * q k^T in one operation (the same products, then the same scale and sum)
    scores = torch.baddbmm(bias, q, keys.reshape(B * kv_heads, S, D).transpose(1, 2), alpha=scale)
    out = torch.bmm(torch.softmax(scores, dim=-1), values.reshape(B * kv_heads, S, D))
    return out.reshape(B, H, 1, D)


def _sdpa(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, a: _Attention) -> Tensor:
    """SDPA of q [N, H, L, D] over keys/values [N, H_kv, S, D] under a boolean mask."""
    if a.heads != a.kv_heads and not _SDPA_GQA:
        keys = keys.repeat_interleave(a.heads // a.kv_heads, dim=1)
        values = values.repeat_interleave(a.heads // a.kv_heads, dim=1)
    kwargs = {"enable_gqa": True} if a.heads != a.kv_heads and _SDPA_GQA else {}
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=a.scaling,
                                          **kwargs)


def _halves(cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Rotary tables [..., D] as the turn of each head's halves (x1, x2): cos (c; c) and
    sin (-s; s), [..., 2, D/2]."""
    half = cos.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    return torch.stack([c, c], dim=-2), torch.stack([-s, s], dim=-2)


def _turn(x: Tensor, heads: int, cos: Tensor, sin: Tensor) -> Tensor:
    """x [N, L, heads * D] rotated per head [N, L, heads, D] by `_halves` tables: (x1, x2) ->
    (x1 c - x2 s, x2 c + x1 s), rotate_half's products and sums, so the result equals the
    modules' to the last bit, in four operations. The halves swap places by `roll`, the same
    values as `flip` on a dimension of two: on a CPU a fifth of flip's time, forward and
    backward (at [16, 31, 4, 2, 16] 26 against 133 µs; the update's forward and backward with
    the reference forward 1.02x faster at 0.7 M, the same bits)."""
    halves = x.unflatten(-1, (heads, 2, x.shape[-1] // heads // 2))
    return (halves * cos + halves.roll(1, -2) * sin).flatten(-2)


def _rotate_pairs(x: Tensor, heads: int, turns: Tensor) -> Tensor:
    """x [..., heads * D] whose heads' rows are interleaved (x1_0, x2_0, x1_1, x2_1, ...: see
    `_pair_rows`) turned by complex factors `turns` [..., 1, D/2] = cos + i sin: one complex
    product per pair computes rotate_half's (x1 c - x2 s, x2 c + x1 s). [..., heads, D]."""
    pairs = torch.view_as_complex(x.unflatten(-1, (heads, -1, 2)))
    return torch.view_as_real(pairs * turns).flatten(-2)


def _pair_rows(attention: _Attention, rows: int, device: torch.device) -> Tensor:
    """An order of the fused q/k/v projection's `rows` that reorders each q and k head's rows
    (0, D/2, 1, D/2 + 1, ...), so each rotary pair of `_rotate_pairs` sits side by side; v
    stays as it is. Keys and queries are reordered alike, so their products, and the attention,
    are unchanged. One tensor per shape, shared by every call (an index: never written)."""
    return _pair_order(attention.heads + attention.kv_heads, attention.head_dim, rows, device)


@functools.cache
def _pair_order(qk_heads: int, D: int, rows: int, device: torch.device) -> Tensor:
    head = torch.arange(D, device=device).view(2, D // 2).t().reshape(-1)
    return torch.cat([(torch.arange(qk_heads, device=device)[:, None] * D + head).reshape(-1),
                      torch.arange(qk_heads * D, rows, device=device)])


def _rms_norm_of(module: nn.Module) -> Norm | None:
    """(weight, eps) of the RMSNorm every supported family but Gemma uses — weight times x over
    its root mean square, computed in float32 — for `F.rms_norm`, the same arithmetic in one
    operation; None for any other norm (its own forward runs)."""
    eps = getattr(module, "variance_epsilon", None)
    weight = getattr(module, "weight", None)
    if not type(module).__name__.endswith("RMSNorm") or eps is None or \
            not isinstance(weight, Tensor) or weight.dtype != torch.float32:
        return None
    return weight, float(eps)  # (not detached: the update's forward trains it)


def _norm(module: nn.Module, fused: Norm | None, x: Tensor) -> Tensor:
    """`module(x)` — through `F.rms_norm` where `_rms_norm_of` found its weights."""
    if fused is None or x.dtype != torch.float32:
        return module(x)
    return _rms(x, fused)


def _bound_norm(module: nn.Module, fused: Norm | None) -> Callable[[Tensor], Tensor]:
    """`_norm(module, fused, .)` as one call for float32 hidden states without autograd (the
    decode step's): where `_rms_norm_of` found the weights, `_rms_norm_step` on a CPU and
    `torch.rms_norm` elsewhere (a GPU runs it as one fused kernel); else the module."""
    if fused is None:
        return module
    weight, eps = fused
    if weight.device.type == "cpu":
        return _rms_norm_step(weight, eps)
    return functools.partial(torch.rms_norm, normalized_shape=weight.shape, weight=weight,
                             eps=eps)


def _rms_norm_step(weight: Tensor, eps: float) -> Callable[[Tensor], Tensor]:
    """x -> `torch.rms_norm(x, weight.shape, weight, eps)` for float32 x without autograd, the
    same values to the bit in seven small operations rather than that function's ten: on CPUs
    `mean` is a sum then a division (here by a ready tensor, not a number wrapped at every
    call), and `pow(2)` is x * x. 1.5x faster at a decode step's 16 rows (Xeon: 16.7 against
    24.9 us at 256 wide); a 0.7 M-parameter model's step runs five."""
    weight = weight.detach()
    count = torch.tensor(float(weight.shape[-1]), device=weight.device)
    eps_t = torch.tensor(eps, dtype=torch.float32, device=weight.device)

    def norm(x: Tensor) -> Tensor:
        inverse = (x * x).sum(-1, keepdim=True).div_(count).add_(eps_t).rsqrt_()
        return (x * inverse).mul_(weight)
    return norm


def _rms(x: Tensor, norm: Norm) -> Tensor:
    weight, eps = norm
    return F.rms_norm(x, weight.shape, weight, eps)


def _rotate_halves_possible(layers: list[nn.Module], attention: list[_Attention],
                            backbone: nn.Module) -> bool:
    """Whether q and k can be rotated together on the plain path: per-head q/k norms between
    projection and rotation (Qwen3's), where there are any, RMSNorms over the head
    (`_head_norm_fits`: their mean is the same whatever the order of a head's rows), and rotary
    tables over the whole head whose halves are equal (cos[j] = cos[j + D/2]: the rotate-half
    form every supported family uses)."""
    if any(a.head_dim % 2 for a in attention) or any(
            a.head_norms is not None and not all(_head_norm_fits(n, a.head_dim)
                                                 for n in a.head_norms) for a in attention):
        return False
    weight = next(layers[0].parameters())
    probe = torch.zeros(1, 1, dtype=weight.dtype, device=weight.device)
    cos, sin = backbone.rotary_emb(probe, torch.arange(4, device=weight.device)[None])
    half = attention[0].head_dim // 2
    return cos.shape[-1] == attention[0].head_dim and \
        bool(torch.equal(cos[..., :half], cos[..., half:])) and \
        bool(torch.equal(sin[..., :half], sin[..., half:]))


def _head_norm_fits(module: nn.Module, head_dim: int) -> bool:
    """Whether a per-head q or k norm is an RMSNorm over one head (weight [D], eps)."""
    weight = getattr(module, "weight", None)
    return type(module).__name__.endswith("RMSNorm") and \
        getattr(module, "variance_epsilon", None) is not None and \
        isinstance(weight, Tensor) and tuple(weight.shape) == (head_dim,)


@dataclass
class _HeadNorms:
    """Qwen3's per-head norms as a decoder runs them: `(qk [..., H + H_kv, D])` normalises each
    q head by `q` and each k head by `k`, before the rotation."""

    heads: int
    q: Callable[[Tensor], Tensor]
    k: Callable[[Tensor], Tensor]
    # on q/k rows in `_pair_rows` order, each norm's (weight, eps) with the weight reordered
    # alike (for the compiled step); None where the rows keep the model's order (the modules)
    paired: tuple[Norm, Norm] | None = None

    def __call__(self, qk: Tensor) -> Tensor:
        return torch.cat([self.q(qk[..., :self.heads, :]), self.k(qk[..., self.heads:, :])],
                         dim=-2)


def _head_norms(a: _Attention, pairs: bool) -> _HeadNorms | None:
    """The per-head q/k norms of a layer for a decoder whose q and k rows are in `_pair_rows`
    order (`pairs`: the weights reordered the same way, an RMSNorm's mean being the same in
    any order; float32/64) or in the model's (the modules run); None where it has none."""
    if a.head_norms is None:
        return None
    if not pairs:
        return _HeadNorms(a.heads, *a.head_norms)
    D = a.head_dim
    order = torch.arange(D).view(2, D // 2).t().reshape(-1)  # as _pair_order orders a head
    norms = tuple((m.weight.detach()[order.to(m.weight.device)], float(m.variance_epsilon))
                  for m in a.head_norms)
    q, k = (_bound_norm(m, n) for m, n in zip(a.head_norms, norms, strict=True))
    return _HeadNorms(a.heads, q, k, paired=norms)


def _project_qkv(attn: nn.Module, h: Tensor, a: _Attention) -> tuple[Tensor, Tensor, Tensor]:
    if hasattr(attn, "qkv_proj"):  # Phi-3: one fused projection
        qkv = attn.qkv_proj(h)
        q_end = a.heads * a.head_dim
        k_end = q_end + a.kv_heads * a.head_dim
        return qkv[..., :q_end], qkv[..., q_end:k_end], qkv[..., k_end:]
    return attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)


def _plain_linear(module: nn.Module) -> Linear | None:
    """(weight, bias) of an nn.Linear, or of a peft LoRA layer with its adapters merged in
    (out of place, as peft computes `W + scale B A`); None for anything else (quantised
    layers, DoRA, LoRA bias terms), whose own forward must then run."""
    if type(module) is nn.Linear:
        return module.weight, module.bias
    base = module.get_base_layer() if hasattr(module, "lora_A") else None
    if type(base) is not nn.Linear:
        return None
    from mogrpo.errors import ModelError
    from mogrpo.rollout.weights import merged_lora_weight  # (imports this module)

    try:
        return merged_lora_weight(module), base.bias
    except ModelError:  # DoRA or LoRA bias: only the layer's own forward computes it
        return None


def _fuse(parts: list[Linear | None], order: Tensor | None = None) -> Linear | None:
    """One (weight, bias) computing every part's output side by side, its rows in `order`
    where given (an order that keeps each part's rows among its own, as `_pair_rows` does:
    applied in the same copy, which for a large model is most of the cost of fusing)."""
    if any(p is None for p in parts):
        return None
    if len(parts) == 1 and order is None:
        return parts[0]
    weights = [w.detach() for w, _ in parts]  # (a copy: nothing to differentiate)
    weight = weights[0].new_empty(sum(len(w) for w in weights), weights[0].shape[1])
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
    return weight, bias if order is None else bias[order]


def _projections(layer: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...], Callable] | None:
    """(attention projection names, gate/up names, activation) of a layer — q/k/v or Phi-3's
    fused qkv, gate/up or its gate_up — or None when its MLP has another layout."""
    attn, mlp = layer.self_attn, layer.mlp
    names = ("qkv_proj",) if hasattr(attn, "qkv_proj") else ("q_proj", "k_proj", "v_proj")
    up = ("gate_up_proj",) if hasattr(mlp, "gate_up_proj") else ("gate_proj", "up_proj")
    act = getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None)  # Phi-3
    if act is None or not all(hasattr(mlp, n) for n in (*up, "down_proj")):
        return None
    return names, up, act



def plain_projections(layers: list[nn.Module], pairs: list[_Attention] | None = None, *,
                      max_bytes: int | None = None, keep: bool = False,
                      linear_bytes: int | None = None) -> list[_Plain] | None:
    """Every layer's projections as plain tensors, or None when one cannot be made plain or the
    copies (at most the layers' linear weights, `linear_bytes` where the caller has counted
    them) would exceed `max_bytes` (None: PLAIN_MAX_BYTES). Built once per rollout (the weights
    change at every optimizer step). With `pairs` (each layer's attention shapes) the q and k
    rows are in `_pair_rows` order; `keep` as for `decode_weight`."""
    if linear_bytes is None:
        linear_bytes = _linear_bytes(layers)
    if linear_bytes > (PLAIN_MAX_BYTES if max_bytes is None else max_bytes):
        return None
    plain = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        parts = _projections(layer)
        if parts is None:
            return None
        names, up, act = parts
        qkv_parts = [_plain_linear(getattr(attn, n)) for n in names]
        order = None
        if pairs is not None and all(p is not None for p in qkv_parts):
            order = _pair_rows(pairs[len(plain)], sum(len(p[0]) for p in qkv_parts),
                               qkv_parts[0][0].device)
        qkv = _fuse(qkv_parts, order)
        gate_up = _fuse([_plain_linear(getattr(mlp, n)) for n in up])
        out, down = _plain_linear(attn.o_proj), _plain_linear(mlp.down_proj)
        if qkv is None or gate_up is None or out is None or down is None:
            return None
        packed = [(decode_weight(w, keep), b) for w, b in (qkv, out, gate_up, down)]
        first, second = (_rms_norm_of(layer.input_layernorm),
                         _rms_norm_of(layer.post_attention_layernorm))
        norms = (first, second) if first and second else None
        plain.append(_Plain(*packed, act=act, norms=norms))
    return plain


@dataclass
class Decoded:
    """Raw output of a decode loop."""

    tokens: Tensor  # [B, C] generated ids, pad after a row's stop token
    nonfinite_logits: int
    logp: Tensor | None = None  # [B, C] log-prob of each token under softmax(logits / T)
    rows_reset: int = 0  # rows whose logits were all non-finite


def decode_attention(device: torch.device) -> AbstractContextManager:
    """The attention kernels a decode may use on `device`: on CUDA, SDPA's flash,
    memory-efficient and math kernels, not cuDNN's.

    cuDNN's kernel (which torch prefers for bf16 on Hopper) builds an execution plan for each
    new shape, and a decode meets a new shape at every step (one more key) and every rollout
    (another prompt length). On an H200 in bf16, inside `mogrpo train` on the smoke test's
    model, that was 2.68 s of a profiled 3.0 s in four rollouts: 10 ms an attention call, the
    native rollout 3.5x slower than generate()'s. With fixed shapes (the plans built) the same
    decode took 48 ms against generate()'s 86. generate() meets new shapes too (0.68 s of its
    1.17 s there), so `generate_rollout` runs both engines' decodes under this."""
    if device.type != "cuda":
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                        SDPBackend.MATH])


def native_decode(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    settings,
    *,
    stop_ids: list[int],
    pad_id: int,
    record_logprobs: bool = False,
    projections: Projections | None = None,
) -> Decoded:
    """Sample up to `settings.max_new_tokens` tokens for every prompt row [B, P]
    (`projections`: see `NativeDecoder`).

    The loop runs in inference mode (no autograd bookkeeping at all: ~10 % of a small model's
    decode, whose operations are tiny); its results are returned as ordinary tensors, which
    the training forward can use (inference tensors cannot be saved for a backward)."""
    with torch.inference_mode():
        out = _decode(NativeDecoder(model, projections), prompt_ids, prompt_mask, settings,
                      stop_ids=stop_ids, pad_id=pad_id, record_logprobs=record_logprobs)
    return Decoded(out.tokens.clone(), out.nonfinite_logits,
                   out.logp.clone() if out.logp is not None else None, out.rows_reset)


def _decode(decoder: NativeDecoder, prompt_ids: Tensor, prompt_mask: Tensor, settings, *,
            stop_ids: list[int], pad_id: int, record_logprobs: bool) -> Decoded:
    B, N = prompt_ids.shape[0], settings.max_new_tokens
    device = prompt_ids.device
    logits = decoder.prefill(prompt_ids, prompt_mask, N)  # [B, V]
    rules = SamplingRules(settings, prompt_ids, logits.shape[-1])
    tokens = torch.full((B, N), pad_id, dtype=torch.long, device=device)
    logp = torch.zeros(B, N, device=device) if record_logprobs else None
    temperature = 1.0 if settings.greedy else settings.temperature
    stops = torch.tensor(stop_ids, device=device)
    live = torch.arange(B, device=device)  # original row of each cache row
    steps = 0
    single_stop = stops[0] if len(stop_ids) == 1 else None
    for t in range(N):
        chosen = rules.choose(rules(logits))  # [b]
        if len(live) == B:  # no row has finished yet: a plain column write
            tokens[:, t] = chosen
        else:
            tokens[live, t] = chosen
        if logp is not None:
            logp[live, t] = torch.log_softmax(logits / temperature, dim=-1).gather(
                1, chosen[:, None]).squeeze(1)
        steps = t + 1
        if t == N - 1:
            break
        rules.observe(chosen)
        done = chosen == single_stop if single_stop is not None else torch.isin(chosen, stops)
        if bool(done.any()):  # a host sync, needed anyway to shrink the batch
            rows = (~done).nonzero().squeeze(1)
            if rows.numel() == 0:
                break
            live, chosen = live[rows], chosen[rows]
            decoder.keep_unfinished(rows)
            rules.keep(rows)
        logits = decoder.step(chosen)
    return Decoded(tokens[:, :steps], rules.guard.replaced,
                   logp[:, :steps] if logp is not None else None, rules.guard.rows_reset)


def _scoring_linear(module: nn.Module) -> Linear | None:
    """(weight, bias) a projection computes with for `score_logits`: an nn.Linear's, or a peft
    LoRA layer's base weights while its adapters are switched off (the KL reference under
    LoRA); None for anything else (active adapters, quantised layers), whose model then takes
    the Hugging Face forward."""
    if type(module) is nn.Linear:
        return module.weight, module.bias
    if hasattr(module, "lora_A") and getattr(module, "disable_adapters", False) \
            and not getattr(module, "merged", True):
        base = module.get_base_layer()
        if type(base) is nn.Linear:
            return base.weight, base.bias
    return None


@dataclass
class _ScoringLayer:
    """One layer's weights as `score_logits` uses them (unfused: the model's own products)."""

    attention: _Attention
    qkv: list[Linear]  # [q, k, v], or [qkv] for Phi-3's fused projection
    out: Linear
    gate_up: list[Linear]  # [gate, up], or [gate_up] (Phi-3)
    down: Linear
    act: Callable[[Tensor], Tensor]
    norms: tuple[Norm, Norm]


def _scoring_layers(lm: nn.Module) -> list[_ScoringLayer] | None:
    """Every layer's weights for `score_logits`, or None when a layer does not fit: a norm
    other than float32 RMSNorm, a per-head q/k norm other than an RMSNorm over the head, rotary
    tables not in rotate-half form, or a projection `_scoring_linear` cannot read."""
    layers, (attention, halves) = list(lm.model.layers), _layout_of(lm)
    if not halves:
        return None
    found = []
    for layer, a in zip(layers, attention, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        parts = _projections(layer)
        first, second = (_rms_norm_of(layer.input_layernorm),
                         _rms_norm_of(layer.post_attention_layernorm))
        if parts is None or first is None or second is None:
            return None
        names, up, act = parts
        qkv = [_scoring_linear(getattr(attn, n)) for n in names]
        gate_up = [_scoring_linear(getattr(mlp, n)) for n in up]
        out, down = _scoring_linear(attn.o_proj), _scoring_linear(mlp.down_proj)
        if any(p is None for p in (*qkv, *gate_up, out, down)):
            return None
        found.append(_ScoringLayer(a, qkv, out, gate_up, down, act, (first, second)))
    return found


def score_logits(model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor,
                 completion_ids: Tensor, completion_mask: Tensor,
                 groups: tuple[Tensor, Tensor] | None = None) -> Tensor | None:
    """Logits [B, C, V] predicting each completion token (the KL reference, rollout-time
    log-probs, and on a CPU the update's own forward), or None where the model needs its own
    forward.

    The Hugging Face forward of rows sharing prompts (`groups` from `distinct_prompts`, found
    here when not given; None when every row has its own prompt) in fewer operations: each
    distinct prompt once, its keys and values reused by the rows that hold it; RMSNorm as
    `F.rms_norm`; q and k turned with rotate_half's products and sums in four operations each;
    masks built once; each projection through the same linear kernel as the model's. Prompts
    are left-padded, completions right-padded (as `completion_logprobs` takes them).

    With gradients enabled it runs where `trains_here` allows (CPU weights, the model's own
    forward otherwise: its hooks, checkpointing or dropout), each product then on
    `trained_linear`: the policy's log-probs are then those of the reference and rollout-time
    passes to the bit while the weights are equal."""
    grad = torch.is_grad_enabled()
    if sharded(model) or (grad and not trains_here(model)):  # FSDP2: its hooks gather weights
        return None
    project = trained_linear if grad else linear
    lm = unwrap_causal_lm(model)
    B, P = prompt_ids.shape
    C = completion_ids.shape[1]
    if unsupported_reason(model, P + C) is not None:
        return None
    head, final = lm.get_output_embeddings(), _rms_norm_of(lm.model.norm)
    if type(head) is not nn.Linear or final is None:
        return None
    layers = _scoring_layers(lm)
    if layers is None:
        return None
    if groups is None:
        groups = distinct_prompts(prompt_ids, prompt_mask)
    if groups is None:  # every row its own prompt: the model's one pass, as in training
        return None
    distinct, inverse = groups  # [U, 2P], [B]
    ids, valid = distinct[:, :P], distinct[:, P:].bool()  # [U, P]
    mask = torch.cat([prompt_mask.long(), completion_mask.long()], dim=1)[:, : P + C - 1]
    # causal over real prompt tokens, a pad query seeing itself only (no row all masked)
    causal = torch.ones(P, P, dtype=torch.bool, device=ids.device).tril()
    prompt_attn = (causal[None] & valid[:, None, :]) | torch.eye(P, dtype=torch.bool,
                                                                  device=ids.device)[None]
    # a completion query sees its prompt's real tokens and the completion up to itself
    T = C - 1
    later = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
    completion_attn = torch.cat([valid[inverse][:, None, :].expand(B, T, P),
                                 later[None].expand(B, T, T)], dim=-1)  # [B, T, P+T]
    stages = [(lm.model.embed_tokens(ids), token_positions(valid.long()), prompt_attn[:, None])]
    if T > 0:
        stages.append((lm.model.embed_tokens(completion_ids[:, :-1]),
                       token_positions(mask)[:, P:], completion_attn[:, None]))
    tables = [_half_tables(lm.model, pos, x.dtype, P + C) for x, pos, _ in stages]
    xs = [x for x, _, _ in stages]
    for layer in layers:
        prompt_kv = None
        for s, (_, _, attn_mask) in enumerate(stages):
            x = xs[s]
            q, k, v = _scoring_qkv(layer, _rms(x, layer.norms[0]), *tables[s], project)
            if s == 0:
                prompt_kv = (k, v)
            else:  # each row's prompt keys and values first, then its own
                k = torch.cat([prompt_kv[0][inverse], k], dim=2)
                v = torch.cat([prompt_kv[1][inverse], v], dim=2)
            out = _sdpa(q, k, v, attn_mask, layer.attention)  # [N, H, L, D]
            N, _, L, _ = out.shape
            x = x + project(out.transpose(1, 2).reshape(N, L, -1), *layer.out)
            h = _rms(x, layer.norms[1])
            if len(layer.gate_up) == 1:
                gate, up = project(h, *layer.gate_up[0]).chunk(2, dim=-1)
            else:
                gate, up = (project(h, *w) for w in layer.gate_up)
            xs[s] = x + project(layer.act(gate) * up, *layer.down)
    # [B, 1, V] predicting completion token 0, then [B, T, V]
    logits = [project(_rms(xs[0][:, -1:], final), head.weight, head.bias)[inverse]]
    if T > 0:
        logits.append(project(_rms(xs[1], final), head.weight, head.bias))
    return torch.cat(logits, dim=1)


def trains_here(model: nn.Module) -> bool:
    """Whether `score_logits` may compute `model`'s update forward, with gradients: CPU
    weights (where it is measured faster than the Hugging Face forward: forward and backward
    4-8 % less time at 0.7 M parameters on a Xeon: `benchmarks/cpu_choices.py`), a forward
    that may share prompts (`shares_prompts`: no DDP wrapper, whose forward prepares its
    gradient reduction, no activation checkpointing), not torch.compile'd (the compiled forward
    is kept), and no dropout left in the model (`score_logits` applies none)."""
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cpu" or not shares_prompts(model):
        return False
    compiled = any(hasattr(m, "_orig_mod") for m in wrapper_chain(model))
    return not compiled and not active_dropout(model)


# per backbone: (what its rotary table was built for, cos, sin [T, 2, D/2]): see _half_tables
_ROTARY_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _half_tables(backbone: nn.Module, positions: Tensor, dtype: torch.dtype, length: int
                 ) -> tuple[Tensor, Tensor]:
    """`_halves` tables at `positions` [N, L] (each below `length`), shaped [N, L, 1, 2, D/2]
    for `_turn`: rows of one table per model, of positions 0 .. length - 1, which its rotary
    module computes once and is kept while the module's frequencies, the dtype and the device
    stay the same and it is long enough (a static rope type: `unsupported_reason`). A
    position's cos and sin are those of its frequencies times the position alone, so the rows
    are the values the module gives `positions` to the bit; the module itself took ~0.2 ms a
    call, four calls a step at 0.7 M parameters."""
    rotary = backbone.rotary_emb
    frequencies = getattr(rotary, "inv_freq", None)
    key = (dtype, positions.device, getattr(rotary, "attention_scaling", None),
           None if frequencies is None else (frequencies.data_ptr(), frequencies._version))
    held = _ROTARY_TABLES.get(backbone)
    if held is None or held[0] != key or len(held[1]) < length:
        # ordinary tensors even when a caller runs in inference mode: a later update's
        # forward saves products with them for its backward
        with torch.inference_mode(False), torch.no_grad():
            probe = torch.zeros(1, dtype=dtype, device=positions.device)
            steps = torch.arange(length, device=positions.device)[None]
            cos, sin = _halves(*rotary(probe, steps))  # [1, length, 2, D/2]
        held = _ROTARY_TABLES[backbone] = (key, cos[0], sin[0])
    _, cos, sin = held
    rows = positions.reshape(-1)  # (index_select: half the time of indexing with positions)
    shape = (*positions.shape, 1, *cos.shape[1:])
    return cos.index_select(0, rows).view(shape), sin.index_select(0, rows).view(shape)


def _scoring_qkv(layer: _ScoringLayer, h: Tensor, cos: Tensor, sin: Tensor,
                 project: Callable[..., Tensor] = linear) -> tuple[Tensor, Tensor, Tensor]:
    """q, k (turned) and v of h [N, L, hidden], each [N, heads, L, D], the projections
    computed by `project` (`linear`, or `trained_linear` with gradients)."""
    a = layer.attention
    if len(layer.qkv) == 1:  # Phi-3
        q, k, v = project(h, *layer.qkv[0]).split(
            [a.heads * a.head_dim, a.kv_heads * a.head_dim, a.kv_heads * a.head_dim], dim=-1)
    else:
        q, k, v = (project(h, *w) for w in layer.qkv)
    if a.head_norms is not None:  # Qwen3: each head through its module, as the model does
        q_norm, k_norm = a.head_norms
        q = q_norm(q.unflatten(-1, (a.heads, a.head_dim))).flatten(-2)
        k = k_norm(k.unflatten(-1, (a.kv_heads, a.head_dim))).flatten(-2)
    q = _turn(q, a.heads, cos, sin).transpose(1, 2)
    k = _turn(k, a.kv_heads, cos, sin).transpose(1, 2)
    return q, k, v.unflatten(-1, (a.kv_heads, a.head_dim)).transpose(1, 2)
