"""float32 linear layers on CPUs through oneDNN instead of the BLAS `torch.matmul` uses.

PyTorch's CPU builds compute a float32 `F.linear` with MKL's sgemm. On CPUs MKL does not
recognise as Intel's (AMD EPYC, for one), sgemm runs its AVX2 code, while oneDNN, which the same
builds ship, uses AVX-512: on a 2-core EPYC the oneDNN linear takes about half the time at the
shapes of a training forward ([720, 256] x [256, 1920]: 3.5 ms instead of 7.3 ms) and a third at
decode shapes ([16, 256] x [256, 1920]). It is the same float32 product (IEEE, no reduced
precision); only the summation order differs, by float rounding (~1e-6 relative).

`linear(x, w, b)` is that kernel without autograd (the native decode loop, on weights `pack`ed
once per decode call); `onednn_linears()` is a context in which every `nn.Linear` of a model —
its own, peft's base layers, the output head — runs on it, with a backward whose three
products (input, weight and bias gradients) run on it too. Both fall back to `F.linear` off
CPUs, for other dtypes, and where the build has no oneDNN.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@functools.cache
def available() -> bool:
    """Whether this build runs oneDNN's float32 linear, and it agrees with F.linear."""
    try:
        op = torch.ops.mkldnn._linear_pointwise
        # fixed values, not random ones: drawing here would shift the run's RNG stream at
        # the first call, which a resumed run makes at a different point than an unbroken one
        x = torch.linspace(-1, 1, 24).reshape(3, 8)
        w, b = torch.linspace(-2, 2, 40).reshape(5, 8), torch.linspace(0, 1, 5)
        return bool(torch.allclose(op(x, w, b, "none", [], ""), F.linear(x, w, b), atol=1e-5))
    except (AttributeError, RuntimeError):
        return False


def usable(x: Tensor, w: Tensor) -> bool:
    """The oneDNN kernel applies: CPU float32 operands, an input of at least 2 dimensions."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and w.dtype == torch.float32
            and x.dim() >= 2 and w.dim() == 2 and available())


def pack(w: Tensor) -> Tensor:
    """w [out, in] reordered once into oneDNN's blocked layout, for many `linear` calls (it then
    skips the reorder each call does: at decode shapes that is half its time); w itself where
    oneDNN does not apply. A copy: pack again after the weights change."""
    if w.device.type == "cpu" and w.dtype == torch.float32 and w.dim() == 2 and available():
        return torch.ops.mkldnn._reorder_linear_weight(w.detach())
    return w


def linear(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
    """`F.linear(x, w, b)` (x [..., in], w [out, in], plain or `pack`ed), on oneDNN where it
    applies; no autograd."""
    if w.is_mkldnn or usable(x, w):
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    return F.linear(x, w, b)


class _Linear(torch.autograd.Function):
    """y = x w^T + b with every product of the forward and the backward on oneDNN."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, w = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = product(grad, w.t())  # [..., in]
        flat = grad.reshape(-1, grad.shape[-1])  # [N, out]
        if ctx.needs_input_grad[1]:
            grad_w = weight_product(flat, x.reshape(-1, x.shape[-1]))  # [out, in]
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = flat.sum(0)
        return grad_x, grad_w, grad_b


def product(a: Tensor, b: Tensor) -> Tensor:
    """a [..., k] @ b^T for b [n, k], on oneDNN. Each operand is made either contiguous or the
    transpose of a contiguous tensor first: oneDNN takes a generic path for other strides (the
    weight gradient of a one-position slice of [B, T, H] — the last prompt position's logit —
    ran ~250x slower than on a copy)."""
    a = a if _plain_strides(a) else a.contiguous()
    b = b if _plain_strides(b) else b.contiguous()
    return torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")


def weight_product(grad: Tensor, x: Tensor) -> Tensor:
    """grad^T x for grad [N, out] and x [N, in] (a weight gradient [out, in]), on oneDNN.

    oneDNN copies a transposed input but reorders its weight operand anyway, so the narrower of
    the two is the one transposed: at [N, 640] x [N, 128] computing (x^T grad)^T copies a fifth
    of what grad^T x copies (the gate and up projections' weight gradients: -30 %)."""
    if grad.shape[1] <= x.shape[1]:
        return product(grad.t(), x.t())
    return product(x.t(), grad.t()).t().contiguous()


def _plain_strides(t: Tensor) -> bool:
    return t.is_contiguous() or (t.dim() == 2 and t.t().is_contiguous())


class OneDNNLinear(nn.Linear):
    """An `nn.Linear` whose forward is `_Linear` where oneDNN applies (see `onednn_linears`)."""

    def forward(self, x: Tensor) -> Tensor:
        if usable(x, self.weight):
            return _Linear.apply(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


@contextmanager
def onednn_linears(model: nn.Module) -> Iterator[None]:
    """A context in which every `nn.Linear` of `model` — the model's own, peft's base layers,
    the output head — computes on oneDNN, forward and backward (when it applies).

    The layers are made `OneDNNLinear` for the context and plain `nn.Linear` again after it:
    only the linears pay for the switch (a mode intercepting every torch call of the forward
    cost a LoRA forward ~10 %). Off for models that are not on a CPU in float32, and for
    torch.compile'd ones (the compiler picks its own kernels)."""
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cpu" or param.dtype != torch.float32 \
            or hasattr(model, "_orig_mod") or not available():
        yield
        return
    layers = [m for m in model.modules() if type(m) is nn.Linear]
    for layer in layers:
        layer.__class__ = OneDNNLinear
    try:
        yield
    finally:
        for layer in layers:
            layer.__class__ = nn.Linear
