"""`score_hidden()`: the native engine's layers run over whole completions, for the passes that
score them — the KL reference and rollout-time log-probs without gradients, and on a CPU the
update's forward with them (`trains_here`).

Each distinct prompt runs once, with the model's own linear products. It returns the last
hidden states, which `completion_logprobs` projects onto the vocabulary a chunk of tokens at a
time, as it does the model's own; the log-probs equal the model's forward bit for bit where it
applies (float32 RMSNorm models: Llama, Mistral,
Qwen2, Qwen3, Phi-3): KL is exactly 0 while the policy equals its reference, and the policy's
log-probs equal the reference's to the bit while their weights are equal.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from mogrpo.algo.logprobs import (
    distinct_prompts,
    output_head,
    sharded,
    shares_prompts,
    token_positions,
    wrapper_chain,
)
from mogrpo.kernels import linear, trained_linear
from mogrpo.modeling.dropout import active_dropout
from mogrpo.rollout.layer_ops import Attention, Linear, Norm, rms, sdpa, turn_halves, turn_tables
from mogrpo.rollout.layout import (
    layout_of,
    rms_norm_of,
    unsupported_reason,
    unwrap_causal_lm,
)
from mogrpo.rollout.projections import projection_names


def _scoring_linear(module: nn.Module) -> Linear | None:
    """(weight, bias) a projection computes with for `score_hidden`: an nn.Linear's, or a peft
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
    """One layer's weights as `score_hidden` uses them (unfused: the model's own products)."""

    attention: Attention
    qkv: list[Linear]  # [q, k, v], or [qkv] for Phi-3's fused projection
    out: Linear
    gate_up: list[Linear]  # [gate, up], or [gate_up] (Phi-3)
    down: Linear
    act: Callable[[Tensor], Tensor]
    norms: tuple[Norm, Norm]


def _scoring_layers(lm: nn.Module) -> list[_ScoringLayer] | None:
    """Every layer's weights for `score_hidden`, or None when a layer does not fit: a norm
    other than float32 RMSNorm, a per-head q/k norm other than an RMSNorm over the head, rotary
    tables not in rotate-half form, or a projection `_scoring_linear` cannot read."""
    layers, (attention, halves) = list(lm.model.layers), layout_of(lm)
    if not halves:
        return None
    found = []
    for layer, a in zip(layers, attention, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        parts = projection_names(layer)
        first, second = (rms_norm_of(layer.input_layernorm),
                         rms_norm_of(layer.post_attention_layernorm))
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


def score_hidden(model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor,
                 completion_ids: Tensor, completion_mask: Tensor,
                 groups: tuple[Tensor, Tensor] | None = None) -> Tensor | None:
    """The last hidden states [B, C, H] (after the final norm) that predict each completion
    token (the KL reference, rollout-time log-probs, and on a CPU the update's own forward),
    or None where the model needs its own forward. The output head, a plain `nn.Linear` here,
    is left to the caller (`completion_logprobs` projects a chunk of tokens at a time).

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
    final = rms_norm_of(lm.model.norm)
    if output_head(model) is None or final is None:  # nothing to project these states with
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
            q, k, v = _scoring_qkv(layer, rms(x, layer.norms[0]), *tables[s], project)
            if s == 0:
                prompt_kv = (k, v)
            else:  # each row's prompt keys and values first, then its own
                k = torch.cat([prompt_kv[0][inverse], k], dim=2)
                v = torch.cat([prompt_kv[1][inverse], v], dim=2)
            out = sdpa(q, k, v, attn_mask, layer.attention)  # [N, H, L, D]
            N, _, L, _ = out.shape
            x = x + project(out.transpose(1, 2).reshape(N, L, -1), *layer.out)
            h = rms(x, layer.norms[1])
            if len(layer.gate_up) == 1:
                gate, up = project(h, *layer.gate_up[0]).chunk(2, dim=-1)
            else:
                gate, up = (project(h, *w) for w in layer.gate_up)
            xs[s] = x + project(layer.act(gate) * up, *layer.down)
    # [B, 1, H] predicting completion token 0, then [B, T, H]
    hidden = [rms(xs[0][:, -1:], final)[inverse]]
    if T > 0:
        hidden.append(rms(xs[1], final))
    return torch.cat(hidden, dim=1)


def trains_here(model: nn.Module) -> bool:
    """Whether `score_hidden` may compute `model`'s update forward, with gradients: CPU
    weights (where it is measured faster than the Hugging Face forward: forward and backward
    4-8 % less time at 0.7 M parameters on a Xeon: `benchmarks/cpu_choices.py`), a forward
    that may share prompts (`shares_prompts`: no DDP wrapper, whose forward prepares its
    gradient reduction, no activation checkpointing), not torch.compile'd (the compiled forward
    is kept), and no dropout left in the model (`score_hidden` applies none)."""
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cpu" or not shares_prompts(model):
        return False
    compiled = any(hasattr(m, "_orig_mod") for m in wrapper_chain(model))
    return not compiled and not active_dropout(model)


# per backbone: (what its rotary table was built for, cos, sin [T, 2, D/2]): see _half_tables
_ROTARY_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _half_tables(backbone: nn.Module, positions: Tensor, dtype: torch.dtype, length: int
                 ) -> tuple[Tensor, Tensor]:
    """`turn_tables` tables at `positions` [N, L] (each below `length`), shaped [N, L, 1, 2, D/2]
    for `turn_halves`: rows of one table per model, of positions 0 .. length - 1, which its rotary
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
            cos, sin = turn_tables(*rotary(probe, steps))  # [1, length, 2, D/2]
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
    q = turn_halves(q, a.heads, cos, sin).transpose(1, 2)
    k = turn_halves(k, a.kv_heads, cos, sin).transpose(1, 2)
    return q, k, v.unflatten(-1, (a.kv_heads, a.head_dim)).transpose(1, 2)
