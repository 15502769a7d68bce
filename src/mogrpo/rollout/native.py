"""mogrpo's own decode loop: one batched prefill (each distinct prompt once), a preallocated KV
cache, finished rows removed.

`generate()` spends most of a small model's decode step in per-token Python (cache objects,
mask building, processor lists, stopping criteria). This engine keeps only what the math
needs: the model's own modules (embeddings, norms, rotary tables, output head) are called
directly, attention runs on a cache allocated once for prompt + completion budget, and the
sampling rules are a few tensor operations (`SamplingRules`). Rows that hit a stop id leave the
batch, so the cost follows the live rows.

The projections run on plain weights (`rollout/projections.py`: q/k/v in one matrix, gate/up in
one, LoRA merged, laid out for the CPU's faster float32 kernel), so a layer costs four matmuls
and no module calls; a decode step writes the q/k/v and gate/up products into buffers it
reuses (`cpu_linear.decode_product`). On CPUs the one-query attention of a decode step is
three small operations instead of SDPA's padded flash kernel, and where the compiled step
builds (`kernels/cpu/decode_step.py`) a step's layers are one call.

Which models run here, and each layer's shapes: `rollout/layout.py`. The same layers over whole
completions, for the passes that score them: `rollout/scoring.py`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mogrpo import kernels
from mogrpo.algo.logprobs import distinct_prompts, token_positions
from mogrpo.kernels import decode_add_product, decode_linear, decode_product
from mogrpo.rollout.cache_rows import row_moves, rows_of, shift_rows
from mogrpo.rollout.layer_ops import (
    attend_one,
    bound_norm,
    rotate_pairs,
    run_norm,
    sdpa,
    turn_halves,
    turn_tables,
)
from mogrpo.rollout.layout import (
    head_norms_for,
    layout_of,
    project_qkv,
    rms_norm_of,
    unwrap_causal_lm,
)
from mogrpo.rollout.projections import Projections, autocast_dtype, decode_projections
from mogrpo.rollout.sampling import SamplingRules
from mogrpo.rollout.static_decode import StaticDecoder


class NativeDecoder:
    """Prefill and per-token decode over a preallocated KV cache, for one batch of prompts."""

    def __init__(self, model: nn.Module, projections: Projections | None = None) -> None:
        """`projections`: `decode_projections(model)` of the model's current weights, when the
        caller keeps them for several calls; built here when not given."""
        lm = unwrap_causal_lm(model)
        self.backbone = lm.model
        self.head = lm.get_output_embeddings()
        self.layers = list(self.backbone.layers)
        self.attention, halves = layout_of(lm)
        projections = projections or decode_projections(model)
        self.plain = projections.layers  # None: call the modules
        self.head_weight = projections.head
        self.rotate_halves = self.plain is not None and halves
        # q and k turned as complex pairs, where the projections put their rows in pair order
        self.pairs = self.rotate_halves and projections.pairs
        # per layer, Qwen3's norms of each q and k head on the rows as this decoder orders them
        self.head_norms = [head_norms_for(a, self.pairs) if self.rotate_halves else None
                           for a in self.attention]
        self.final_norm = rms_norm_of(self.backbone.norm)
        # `_logits`' norm (the decoder runs in inference mode: see `native_decode`)
        self.final_norm_step = bound_norm(self.backbone.norm, self.final_norm)
        embed = self.backbone.embed_tokens
        # the token embedding without the module call where it is a plain lookup
        self.embed = functools.partial(F.embedding, weight=embed.weight,
                                       padding_idx=embed.padding_idx) \
            if type(embed) is nn.Embedding and embed.max_norm is None else embed
        self.step_layers: list[tuple] | None = None  # see _step_layers
        self.compiled = None  # the compiled step of these layers (mogrpo.kernels), where it runs them
        self.compiled_head = False  # whether that step also computes the logits
        self.half_cos = self.half_sin = torch.empty(0)  # [T_max, 2, D/2]: see prefill
        self.freqs = torch.empty(0)  # [T_max, D/2] complex cos + i sin: see prefill
        self.keys: list[Tensor] = []  # per layer [B, H_kv, T_max, D]
        self.values: list[Tensor] = []
        self.valid = torch.empty(0)  # [B, T_max] bool: key positions a query may attend to
        # [B, H_kv, T_max] float, 0 where valid, -inf elsewhere (per key head: see attend_one)
        self.bias = torch.empty(0)
        self.positions = torch.empty(0)  # [B] the position id of the first generated token
        self.turns = torch.empty(0)  # [N, B, D/2] complex rotation of each new token: prefill
        self.prompt_columns = 0  # P: the cache column of the first generated token
        self.length = 0  # columns of the cache filled so far
        self.cos = self.sin = torch.empty(0)  # [T_max, D] rotary tables
        # whether the cache starts as zeros: `static_step` reads every column, and a column
        # not yet written must add nothing (its weight is 0, but 0 x NaN from unset memory is NaN)
        self.zero_cache = False

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
        device = x.device
        # the cache in autocast's dtype under mixed precision: what its attention casts
        # keys and values to anyway, at half the memory of the float32 residual stream
        dtype = autocast_dtype(device) or x.dtype
        # Rotary tables for every position once: the rows are looked up per token afterwards.
        cos, sin = self.backbone.rotary_emb(x, torch.arange(total, device=device)[None])
        self.cos, self.sin = cos[0], sin[0]  # [T_max, D]
        if self.pairs:
            half = self.cos.shape[-1] // 2
            self.freqs = torch.complex(self.cos[:, :half], self.sin[:, :half])  # [T_max, D/2]
        elif self.rotate_halves:
            self.half_cos, self.half_sin = turn_tables(self.cos, self.sin)  # [T_max, 2, D/2]
        first = self.attention[0]
        shape = (B, first.kv_heads, total, first.head_dim)
        # columns are written before they are read (a query sees only columns up to its own)
        allocate = torch.zeros if self.zero_cache else torch.empty
        self.keys = [allocate(shape, dtype=dtype, device=device) for _ in self.layers]
        self.values = [allocate(shape, dtype=dtype, device=device) for _ in self.layers]
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
        if x.device.type == "cpu":  # additive, the same for every layer: see attend_one
            mask = self._step_bias(column + 1)
        else:
            mask = self.valid[:, None, None, : column + 1]  # [B, 1, 1, S]
        positions = self.positions + (column - self.prompt_columns)
        hidden = self._forward(x, positions[:, None], mask)
        return self._logits(hidden[:, -1])

    def static_step(self, tokens: Tensor, column: Tensor, columns: Tensor) -> Tensor:
        """`step` with every shape fixed for the whole decode, so that one CUDA graph replays
        it (`rollout/static_decode.py`): one token per cache row [b], the column to write as
        a tensor [1] (a replay reruns the captured kernels, not the Python that chose a slice),
        attention over all T_max columns (`columns`: arange(T_max)) with the columns after
        `column` masked out; next-token logits [b, V]. The caller advances `length` (a replay
        runs no Python)."""
        x = self.backbone.embed_tokens(tokens[:, None])  # [b, 1, H]
        b, kv_heads, total = len(tokens), self.attention[0].kv_heads, len(columns)
        seen = self.valid & (columns <= column)  # [b, T_max]
        bias = self.keys[0].new_zeros(seen.shape).masked_fill_(~seen, float("-inf"))
        # per key head, as `attend_one` takes it: [b H_kv, 1, T_max]
        bias = bias[:, None].expand(b, kv_heads, total).reshape(b * kv_heads, 1, total)
        positions = self.positions + (column - self.prompt_columns)  # [b]
        hidden = self._forward(x, positions[:, None], bias, column=column)
        return self._logits(hidden[:, -1])

    def _step_bias(self, columns: int) -> Tensor:
        """The additive mask of a decode step's query over `columns` keys, per key head
        [B * H_kv, 1, columns] (a view; see `attend_one`)."""
        B, kv_heads, total = self.bias.shape
        return self.bias.view(B * kv_heads, 1, total)[:, :, :columns]

    def _step_pairs(self, tokens: Tensor) -> Tensor:
        """`step` on the plain layers with q, k as complex pairs, on a CPU: the same arithmetic
        as `_forward` with two-dimensional hidden states [B, H] and the one-query attention
        of `attend_one`, in about two thirds of its operations (at a 0.7 M-parameter model
        a decode step is mostly the cost of launching ~100 small ones), each layer's weights,
        kernels and shapes looked up once per decode call (`_step_layers`)."""
        B, column = len(tokens), self.length
        S = column + 1
        x = self.embed(tokens)  # [B, H]
        if self.step_layers is None and self.compiled is None:  # the first step
            self.compiled, self.compiled_head = kernels.compiled_decoder(self, B, x.device)
            if self.compiled is None:
                self.step_layers = self._step_layers(B)
        if self.compiled is not None:  # the same layers in one call (kernels.cpu.decode_step)
            turn = torch.view_as_real(self.turns[column - self.prompt_columns])  # [B, D/2, 2]
            out = self.compiled.step(x, turn, self.bias, self.keys, self.values, column)
            self.length = S
            return out if self.compiled_head else self._logits(out)
        turns = self.turns[column - self.prompt_columns, :, None]  # [B, 1, D/2]
        D = self.attention[0].head_dim
        bias = self._step_bias(S)
        for i, (norm1, norm2, qkv_of, add_out, project_up, add_down, act, heads, kv_heads,
                scaling, head_norms) in enumerate(self.step_layers):
            qkv = qkv_of(norm1(x))  # [B, (H + 2 H_kv) D]
            turned = heads + kv_heads
            qk = qkv[:, :turned * D]
            if head_norms is not None:  # Qwen3: each head normalised, then turned
                qk = head_norms(qk.view(B, turned, D)).view(B, turned * D)
            qk = rotate_pairs(qk, turned, turns)  # [B, H + H_kv, D]
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
        callables (`bound_norm`), the q/k/v and gate/up projections as `decode_product`s
        (x -> x w^T + b), o_proj and down_proj as `decode_add_product`s ((acc, x) -> acc +
        x w^T + b: they add into the residual stream), the activation, and the attention's
        shapes and per-head norms."""
        layers = []
        for layer, p, a, head_norms in zip(self.layers, self.plain, self.attention,
                                           self.head_norms, strict=True):
            first, second = p.norms or (None, None)
            norms = (bound_norm(layer.input_layernorm, first),
                     bound_norm(layer.post_attention_layernorm, second))
            projections = (decode_product(*p.qkv, rows), decode_add_product(*p.out),
                           decode_product(*p.gate_up, rows), decode_add_product(*p.down))
            layers.append((*norms, *projections, p.act, a.heads, a.kv_heads, a.scaling,
                           head_norms))
        return layers

    def keep(self, rows: Tensor) -> None:
        """Keep the rows `rows` of the cache, in that order (after a prefill of distinct
        prompts, each row gets its prompt's). Only the columns written so far are copied: a
        decode step writes its column before any query reads it."""
        self.keys = [rows_of(k, rows, self.length, self.zero_cache) for k in self.keys]
        self.values = [rows_of(v, rows, self.length, self.zero_cache) for v in self.values]
        self._keep_row_state(rows)

    def keep_unfinished(self, rows: Tensor) -> None:
        """`keep` for rows that rise strictly (the unfinished ones, when others finish): the
        cache's rows move up in place (`shift_rows`), only those after the first finished
        row, and no new cache is allocated."""
        moves = row_moves(rows.tolist())
        self.keys = [shift_rows(k, moves, len(rows), self.length) for k in self.keys]
        self.values = [shift_rows(v, moves, len(rows), self.length) for v in self.values]
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

    def _forward(self, x: Tensor, positions: Tensor, mask: Tensor,
                 column: Tensor | None = None) -> Tensor:
        """The decoder layers on x [B, T, H] at `positions` [B, T], writing T cache columns
        from `length` on; or, with `column` (`static_step`: T = 1), that one column, leaving
        `length` as it is."""
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
                x = x + self._attend(i, h, cos, sin, start, mask, column)
                x = x + layer.mlp(layer.post_attention_layernorm(x))
                continue
            p = self.plain[i]
            first, second = p.norms or (None, None)
            h = run_norm(layer.input_layernorm, first, x)
            x = x + self._attend(i, h, cos, sin, start, mask, column)
            h = run_norm(layer.post_attention_layernorm, second, x)
            gate, up = decode_linear(h, *p.gate_up).chunk(2, dim=-1)
            x = x + decode_linear(p.act(gate) * up, *p.down)
        if column is None:
            self.length = start + T
        return x

    def _attend(self, i: int, h: Tensor, cos: Tensor, sin: Tensor, start: int,
                mask: Tensor, column: Tensor | None = None) -> Tensor:
        """Attention of layer i on h [B, T, H] (`column`: see `_forward`)."""
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
            qk = rotate_pairs(qk, heads, cos) if self.pairs else turn_halves(qk, heads, cos, sin)
            q, k = qk[:, :, :a.heads].transpose(1, 2), qk[:, :, a.heads:].transpose(1, 2)
            v = qkv[..., heads * a.head_dim:].unflatten(-1, (a.kv_heads, a.head_dim))
            v = v.transpose(1, 2)
        else:
            if self.plain is None:
                q, k, v = project_qkv(attn, h, a)
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
        if column is None:
            end = start + T
            self.keys[i][:, :, start:end] = k
            self.values[i][:, :, start:end] = v
            keys, values = self.keys[i][:, :, :end], self.values[i][:, :, :end]
        else:  # the static step: its column written at a tensor index, every column read
            keys, values = self.keys[i], self.values[i]
            keys.index_copy_(2, column, k.to(keys.dtype))
            values.index_copy_(2, column, v.to(values.dtype))
        if T == 1 and mask.is_floating_point():
            out = attend_one(q, keys, values, mask, a.scaling)
        else:
            out = sdpa(q, keys, values, mask, a)  # [B, H, T, D]
        out = out.transpose(1, 2).reshape(B, T, a.heads * a.head_dim)
        if self.plain is None:
            return attn.o_proj(out)
        return decode_linear(out, *self.plain[i].out)


@dataclass
class Decoded:
    """Raw output of a decode loop."""

    tokens: Tensor  # [B, C] generated ids, pad after a row's stop token
    nonfinite_logits: int
    logp: Tensor | None = None  # [B, C] log-prob of each token under softmax(logits / T)
    rows_reset: int = 0  # rows whose logits were all non-finite


StepCallback = Callable[[Tensor, Tensor], None]
"""Called after each decode step with (rows still decoding [b], the token each chose [b])."""


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
    on_step: StepCallback | None = None,
    static: bool | None = None,
) -> Decoded:
    """Sample up to `settings.max_new_tokens` tokens for every prompt row [B, P]
    (`projections`: see `NativeDecoder`). `on_step(rows, tokens)`, when given, is called after
    every decode step with the rows still decoding [b] and the token each just chose [b]
    (`mogrpo serve` streams them). `static`: whether the steps run on fixed shapes
    (`rollout/static_decode.py`), replayed from CUDA graphs where `mogrpo.kernels` has them;
    None: where it has them (CUDA, unless MOGRPO_DECODE_GRAPH=0).

    The loop runs in inference mode (no autograd bookkeeping at all: ~10 % of a small model's
    decode, whose operations are tiny); its results are returned as ordinary tensors, which
    the training forward can use (inference tensors cannot be saved for a backward)."""
    with torch.inference_mode():
        decoder = NativeDecoder(model, projections)
        graphs = kernels.graph_runner(prompt_ids.device)
        if static or (static is None and graphs is not None):
            decoder = StaticDecoder(decoder, graphs)
        out = _decode(decoder, prompt_ids, prompt_mask, settings, stop_ids=stop_ids,
                      pad_id=pad_id, record_logprobs=record_logprobs, on_step=on_step)
    return Decoded(out.tokens.clone(), out.nonfinite_logits,
                   out.logp.clone() if out.logp is not None else None, out.rows_reset)


def _decode(decoder: NativeDecoder | StaticDecoder, prompt_ids: Tensor, prompt_mask: Tensor, settings, *,
            stop_ids: list[int], pad_id: int, record_logprobs: bool,
            on_step: StepCallback | None = None) -> Decoded:
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
        if on_step is not None:
            on_step(live, chosen)
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
