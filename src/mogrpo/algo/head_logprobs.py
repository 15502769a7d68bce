"""Token log-probs from the last hidden states and the output head, a chunk of tokens at a time:
the [N, V] logits are never held whole, in the forward or the backward.

Projecting every completion token onto the vocabulary and keeping the logits for the backward
costs N x V values: at V = 151,936 and 16 x 512 tokens, 2.5 GB in bf16 per pass, plus their
float32 copy and gradient. `_HeadLogProb` keeps only what the backward cannot cheaply recompute
— the hidden states [N, H], the head's weight (and bias), the targets and each token's
logsumexp — and computes each chunk's logits again in the backward. This is the idea of Liger
Kernel's fused linear cross-entropy and of Cut Cross-Entropy (Wijmans et al., arXiv
2411.09009), for a per-token output with any upstream gradient (a loss's gradient is not known
in the forward here, so the backward recomputes rather than the forward precomputing).

A chunk's arithmetic is the full-logit path's, row for row: logits in the model's dtype, an
optional tanh cap (Gemma 2's ``final_logit_softcapping``, in the model's dtype as its forward
applies it), upcast to at least float32, divided by the sampling temperature, then
``gather - logsumexp``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from mogrpo.algo.products import TORCH, Products
from mogrpo.errors import ConfigError

# Logits computed together, in bytes of the float32 copy: small enough that a chunk's few
# temporaries stay modest at a 150k-token vocabulary (~110 tokens a chunk), large enough that
# small models do one or a few big products rather than many small ones.
CHUNK_BYTES = 64 * 2**20


@dataclass(frozen=True)
class OutputHead:
    """The output head as `head_logprobs` projects with it: an `nn.Linear` (possibly tied to
    the input embeddings) or bitsandbytes' NF4 `Linear4bit` (`model.embeddings_in_4bit`), the
    tanh cap the model applies to its logits, if any, and the products it multiplies with."""

    module: nn.Linear
    softcap: float | None = None
    products: Products = TORCH

    @property
    def weight(self) -> Tensor:
        """The head's weight [V, H]; an NF4 head's dequantised in its compute dtype (the dtype
        a 16-bit head would have), a fresh tensor each time: read once a call, and kept for the
        backward (`_HeadLogProb`) as a 16-bit head's weight is."""
        weight = self.module.weight
        state = getattr(weight, "quant_state", None)
        if state is None:
            return weight
        import bitsandbytes as bnb

        dtype = getattr(self.module, "compute_dtype", None) or state.dtype
        return bnb.functional.dequantize_4bit(weight.data, state).to(dtype)

    @property
    def bias(self) -> Tensor | None:
        return self.module.bias


def check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ConfigError(f"sampling temperature must be > 0, got {temperature!r}")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or float64 when the logits already are (never downcast)."""
    return torch.promote_types(dtype, torch.float32)


def chunk_rows(vocab: int, dtype: torch.dtype) -> int:
    """Tokens per chunk: CHUNK_BYTES of logits in `dtype`."""
    return max(1, CHUNK_BYTES // max(1, vocab * torch.finfo(dtype).bits // 8))


def entropy_from(z: Tensor, lse: Tensor) -> Tensor:
    """logsumexp(z) - sum_v p_v z_v for z [..., V] and its logsumexp [...]. p is 0 where
    z = -inf (masked vocabulary entries), and 0 * -inf is NaN: nansum leaves those terms out (a
    NaN logit still makes the entropy NaN, through the logsumexp)."""
    p = torch.softmax(z, dim=-1)
    return lse - torch.nansum(p * z, dim=-1)


def head_logprobs(hidden: Tensor, head: OutputHead, targets: Tensor, temperature: float = 1.0,
                  with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """Log-prob of each target under ``softmax(cap(head(hidden)) / temperature)`` and, when
    asked, the entropy of that distribution (without gradients).

    hidden [N, H] (the last hidden states, after the final norm), targets [N] int ->
    ([N], [N] or None), float32 (float64 for a float64 head). Gradients reach the hidden
    states, the head's weight and its bias; the logits are computed `chunk_rows` tokens at a
    time, again in the backward, so no [N, V] tensor is kept.
    """
    check_temperature(temperature)
    weight, bias = head.weight, head.bias
    args = (hidden.contiguous(), weight, bias, targets.long(), float(temperature), head.softcap,
            with_entropy, head.products)
    grads = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias))
    if grads:
        logp, entropy = _HeadLogProb.apply(*args)
    else:
        logp, entropy, _, _ = _forward(*args)
    return logp, entropy if with_entropy else None


def _logits(h: Tensor, weight: Tensor, bias: Tensor | None, temperature: float,
            softcap: float | None, products: Products
            ) -> tuple[Tensor, Tensor | None, torch.dtype]:
    """(z, tanh, the logits' dtype) for h [n, H]: z [n, V] = cap(h W^T + b) upcast, /
    temperature, as the full-logit path computes it; tanh the cap's tanh [n, V] (its backward
    needs it), or None; the dtype the product gave (the model's, or autocast's under mixed
    precision)."""
    raw = products.linear(h, weight, bias)  # [n, V] in the model's dtype
    tanh = None
    if softcap is not None:  # Gemma 2's order: / cap, tanh, * cap, in the model's dtype
        tanh = torch.tanh(raw / softcap)
        raw = tanh * softcap
    z = raw.to(compute_dtype(raw.dtype))  # a fresh tensor either way: divided in place
    return (z.div_(temperature) if temperature != 1.0 else z), tanh, raw.dtype


def _forward(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
             temperature: float, softcap: float | None, with_entropy: bool,
             products: Products, keep: bool = False
             ) -> tuple[Tensor, Tensor, Tensor,
                        tuple[Tensor, Tensor | None, torch.dtype] | None]:
    """(logp [N], entropy [N] or [0], logsumexp [N], kept), one chunk of tokens at a time.

    `keep` and the tokens fit in one chunk: `kept` is (the softmax [N, V], the cap's tanh or
    None, the logits' dtype) for the backward, which then does not compute the logits again;
    else None."""
    N, dtype = hidden.shape[0], compute_dtype(weight.dtype)
    logp = hidden.new_empty(N, dtype=dtype)
    lse = torch.empty_like(logp)
    entropy = torch.empty_like(logp) if with_entropy else logp.new_empty(0)
    rows = chunk_rows(weight.shape[0], dtype)
    kept = None
    for s in range(0, N, rows):
        z, tanh, raw = _logits(hidden[s:s + rows], weight, bias, temperature, softcap, products)
        lse[s:s + rows] = torch.logsumexp(z, dim=-1)
        picked = z.gather(-1, targets[s:s + rows, None]).squeeze(-1)  # [n]
        logp[s:s + rows] = picked - lse[s:s + rows]
        if with_entropy:
            entropy[s:s + rows] = entropy_from(z, lse[s:s + rows])
        if keep and N <= rows:  # the backward's first operation, on the same values
            kept = z.sub_(lse[:, None]).exp_(), tanh, raw
    return logp, entropy, lse, kept


def _autocast_state(device: str) -> tuple[str, torch.dtype | None]:
    """(device, the dtype autocast computes in there, None where it is off or unknown for
    the device: meta tensors)."""
    try:
        on = torch.is_autocast_enabled(device)
    except RuntimeError:
        return device, None
    return device, torch.get_autocast_dtype(device) if on else None


class _HeadLogProb(torch.autograd.Function):
    """`_forward` with a backward that recomputes each chunk's logits from the saved hidden
    states and weight: the saved tensors are O(N H + V H), not O(N V). Where every token fits
    in one chunk (a small vocabulary or few tokens: at most CHUNK_BYTES of float32 logits) the
    forward keeps that chunk's softmax instead, and the backward skips the recomputation —
    one [N, H] x [H, V] product fewer, the full-logit path's cost, within the chunk's memory.

    Under mixed precision the forward runs inside `torch.autocast` and the backward after it
    has closed (on CUDA, on autograd's own thread, where it never was on). The backward
    therefore enters the forward's autocast state again: its recomputed logits are the
    forward's (the same bf16 product the saved logsumexp came from, so the softmax sums to 1),
    its products run in autocast's dtype as autograd's backward of the model's own head does,
    and a float32 hidden state (a norm upcast over a quantised base) meets a 16-bit head as it
    did in the forward instead of failing on the dtypes."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None,  # type: ignore[override]
                targets: Tensor, temperature: float, softcap: float | None,
                with_entropy: bool, products: Products) -> tuple[Tensor, Tensor]:
        logp, entropy, lse, kept = _forward(hidden, weight, bias, targets, temperature,
                                            softcap, with_entropy, products, keep=True)
        probs, tanh, ctx.raw_dtype = kept if kept is not None else (None, None, None)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, probs, tanh)
        ctx.temperature, ctx.softcap, ctx.products = temperature, softcap, products
        ctx.autocast = _autocast_state(hidden.device.type)
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad: Tensor, _entropy: Tensor | None  # type: ignore[override]
                 ) -> tuple[Tensor | None, ...]:
        device, dtype = ctx.autocast
        if dtype is None:
            return _HeadLogProb._backward(ctx, grad)
        with torch.autocast(device, dtype=dtype):  # the forward's state
            return _HeadLogProb._backward(ctx, grad)

    @staticmethod
    def _backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, targets, lse, probs, kept_tanh = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        T, cap, products = ctx.temperature, ctx.softcap, ctx.products
        grad_h = torch.empty_like(hidden) if need_h else None
        # weight and bias gradients summed over chunks in at least float32: a bf16 sum rounded
        # once per chunk would lose what the one product of the full-logit path keeps
        acc = compute_dtype(weight.dtype)
        grad_w = grad_b = None
        rows = chunk_rows(weight.shape[0], compute_dtype(weight.dtype))
        for s in range(0, hidden.shape[0], rows):
            h, g = hidden[s:s + rows], grad[s:s + rows, None]  # [n, H], [n, 1]
            if probs is not None:  # one chunk, its softmax kept by the forward
                dz, tanh, raw = probs * -g, kept_tanh, ctx.raw_dtype
            else:
                z, tanh, raw = _logits(h, weight, bias, T, cap, products)  # [n, V]
                # logsumexp's backward as autograd writes it, -g * exp(z - lse), in place in
                # z; then the gathered entry's +g
                dz = z.sub_(lse[s:s + rows, None]).exp_().mul_(-g)
            dz.scatter_add_(-1, targets[s:s + rows, None], g)
            if T != 1.0:
                dz.div_(T)
            d_raw = dz.to(raw)  # [n, V]: the gradient of the logits in the product's dtype
            if tanh is not None:  # autograd's order: * cap, tanh's 1 - y^2, / cap
                d_raw = d_raw * cap * (1 - tanh * tanh) / cap
            if need_h:
                grad_h[s:s + rows] = products.times(d_raw, weight)  # [n, H]
            if need_w:  # [V, H]
                if grad_w is None:
                    grad_w = products.times_t(d_raw, h).to(acc)
                elif grad_w.dtype == d_raw.dtype:  # in place: no [V, H] temporary
                    grad_w.addmm_(d_raw.t(), h)
                else:
                    grad_w.add_(products.times_t(d_raw, h))
            if need_b:
                part = d_raw.sum(0)  # [V]
                grad_b = part.to(acc) if grad_b is None else grad_b.add_(part)
        grad_w = grad_w.to(weight.dtype) if grad_w is not None else None
        grad_b = grad_b.to(bias.dtype) if grad_b is not None else None
        return grad_h, grad_w, grad_b, None, None, None, None, None

