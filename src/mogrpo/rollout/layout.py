"""What the native engine sees of a model: whether it can run it, and each decoder layer's
attention shapes, norms and per-head q/k norms.

The engine covers the decoder families whose layers share the Llama layout (pre-norm, rotary,
grouped-query attention, an MLP module): Llama, Mistral, Qwen2, Qwen3, Gemma, Phi-3.
`unsupported_reason()` says why any other model cannot run there; the caller falls back to
`generate()`.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from mogrpo.algo.logprobs import wrapper_chain
from mogrpo.rollout.layer_ops import Attention, Norm, bound_norm, head_pair_order

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "phi3")
_STATIC_ROPE = ("default", "linear", "llama3")
# RMSNorms whose forward scales by 1 + weight (`rms_norm_of`)
_UNIT_OFFSET_NORMS = ("GemmaRMSNorm",)


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


# per model: (each layer's Attention, whether q and k can be turned together): `layout_of`
_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def layout_of(lm: nn.Module) -> tuple[list[Attention], bool]:
    """`_attention_of(lm)` and whether `_rotate_halves_possible`: found once per model (a decode
    call would otherwise spend ~0.1 ms on them; the weights, which change, are read anew)."""
    found = _LAYOUTS.get(lm)
    if found is None:
        attention = _attention_of(lm)
        layers = list(lm.model.layers)
        found = _LAYOUTS[lm] = (attention, _rotate_halves_possible(layers, attention, lm.model))
    return found


def _attention_of(lm: nn.Module) -> list[Attention]:
    """Each decoder layer's attention module and shapes."""
    config = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
    found = []
    for layer in lm.model.layers:
        attn = layer.self_attn
        head_dim = getattr(attn, "head_dim", config.hidden_size // config.num_attention_heads)
        found.append(Attention(
            module=attn,
            heads=config.num_attention_heads,
            kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            scaling=getattr(attn, "scaling", head_dim**-0.5),
            rotary=sys.modules[type(attn).__module__].apply_rotary_pos_emb,
            head_norms=(attn.q_norm, attn.k_norm) if hasattr(attn, "q_norm") else None,
        ))
    return found


def rms_norm_of(module: nn.Module) -> Norm | None:
    """(weight, eps) of a float32 RMSNorm — x over its root mean square, times a weight — for
    `F.rms_norm`, the same arithmetic in one operation: the module's weight (Llama, Mistral,
    Qwen, Phi-3), or 1 + weight for Gemma's, which scales by that (computed anew at each call,
    so gradients reach the weight); None for any other norm (its own forward runs)."""
    name = type(module).__name__
    offset = name in _UNIT_OFFSET_NORMS
    eps = getattr(module, "eps" if offset else "variance_epsilon", None)
    weight = getattr(module, "weight", None)
    if not name.endswith("RMSNorm") or eps is None or \
            not isinstance(weight, Tensor) or weight.dtype != torch.float32:
        return None
    # (not detached: the update's forward trains it)
    return (1.0 + weight if offset else weight), float(eps)


def _rotate_halves_possible(layers: list[nn.Module], attention: list[Attention],
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
class HeadNorms:
    """Qwen3's per-head norms as a decoder runs them: `(qk [..., H + H_kv, D])` normalises each
    q head by `q` and each k head by `k`, before the rotation."""

    heads: int
    q: Callable[[Tensor], Tensor]
    k: Callable[[Tensor], Tensor]
    # on q/k rows in `pair_rows` order, each norm's (weight, eps) with the weight reordered
    # alike (for the compiled step); None where the rows keep the model's order (the modules)
    paired: tuple[Norm, Norm] | None = None

    def __call__(self, qk: Tensor) -> Tensor:
        return torch.cat([self.q(qk[..., :self.heads, :]), self.k(qk[..., self.heads:, :])],
                         dim=-2)


def head_norms_for(a: Attention, pairs: bool) -> HeadNorms | None:
    """The per-head q/k norms of a layer for a decoder whose q and k rows are in `pair_rows`
    order (`pairs`: the weights reordered the same way, an RMSNorm's mean being the same in
    any order; float32/64) or in the model's (the modules run); None where it has none."""
    if a.head_norms is None:
        return None
    if not pairs:
        return HeadNorms(a.heads, *a.head_norms)
    norms = tuple((m.weight.detach()[head_pair_order(a.head_dim, m.weight.device)],
                   float(m.variance_epsilon)) for m in a.head_norms)
    q, k = (bound_norm(m, n) for m, n in zip(a.head_norms, norms, strict=True))
    return HeadNorms(a.heads, q, k, paired=norms)


def project_qkv(attn: nn.Module, h: Tensor, a: Attention) -> tuple[Tensor, Tensor, Tensor]:
    if hasattr(attn, "qkv_proj"):  # Phi-3: one fused projection
        qkv = attn.qkv_proj(h)
        q_end = a.heads * a.head_dim
        k_end = q_end + a.kv_heads * a.head_dim
        return qkv[..., :q_end], qkv[..., q_end:k_end], qkv[..., k_end:]
    return attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
