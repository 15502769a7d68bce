"""The matrix products the math runs on, as one small value the caller hands in.

The math (`head_logprobs`, `completion_logprobs`) names no processor: it multiplies through a
`Products`. `TORCH` is PyTorch's own operators, right on any device. The engines pass the one
`mogrpo.kernels.products()` chooses for the machine (on CPUs, float32 products on oneDNN or MKL
by CPU and shape), which gives the same values to float rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch.nn.functional as F
from torch import Tensor, nn


def _times(a: Tensor, b: Tensor) -> Tensor:
    return a @ b


def _times_t(a: Tensor, b: Tensor) -> Tensor:
    return a.t() @ b


def _no_change(model: nn.Module) -> AbstractContextManager[None]:
    return nullcontext()


@dataclass(frozen=True)
class Products:
    """`linear(x, w, b)` = x w^T + b, `times(a, b)` = a b, `times_t(a, b)` = a^T b (forward
    products: the math that calls them writes its own backward); `model_linears(model)`: a
    context inside which the
    model's own `nn.Linear` layers multiply on the same kernel (the forward of a log-prob pass);
    `linear_types`: the classes an output head may be while it is still a plain linear."""

    linear: Callable[[Tensor, Tensor, Tensor | None], Tensor] = F.linear
    times: Callable[[Tensor, Tensor], Tensor] = _times
    times_t: Callable[[Tensor, Tensor], Tensor] = _times_t
    model_linears: Callable[[nn.Module], AbstractContextManager[None]] = _no_change
    linear_types: tuple[type, ...] = field(default=(nn.Linear,))


TORCH = Products()
"""PyTorch's own operators."""
