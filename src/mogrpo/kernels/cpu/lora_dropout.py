"""LoRA's adapter dropout with its random masks drawn fast on CPUs.

peft applies `nn.Dropout(lora.dropout)` to the input of every adapter. On a CPU, PyTorch draws
the mask one Mersenne-Twister number per element (~4.4 ns each on the benchmark machine) and then
makes two more passes over it; with p = 0.05 on a 0.7 M-parameter model that is ~12 ms of a 36 ms
LoRA forward and backward. `FastDropout` draws the same Bernoulli(1 - p) mask from NumPy's PCG64
generator: for small rates (p <= 0.25) as the geometric gaps between dropped entries (about n p
draws instead of n), else 32 random bits per entry (the keep probability exact to 2^-32, finer
than PyTorch's own float draw).

The PCG64 stream of each call is seeded by one draw from PyTorch's default generator, so a run's
seed fixes every mask and a resumed run (which restores that generator) draws the same ones.
Anywhere else — CUDA, other dtypes, eval mode, p = 0 — it is `nn.Dropout` itself.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn

_SEED_BOUND = 2**63 - 1


class FastDropout(nn.Dropout):
    """`nn.Dropout(p)` whose training-mode mask on a CPU float32 input comes from `keep_mask`."""

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0 or x.device.type != "cpu" \
                or x.dtype != torch.float32 or self.inplace:
            return super().forward(x)
        return x * keep_mask(x.shape, self.p)


def keep_mask(shape: torch.Size, p: float) -> Tensor:
    """A float32 tensor of `shape`: 1 / (1 - p) with probability 1 - p, else 0, independently
    (0 at `dropped_positions`, drawn from the same stream)."""
    if p >= 1.0:
        return torch.zeros(shape)
    n = int(np.prod(shape, dtype=np.int64))
    kept = torch.full((n,), 1.0 / (1.0 - p))
    kept[dropped_positions(n, p)] = 0.0
    return kept.view(shape)


def dropped_positions(n: int, p: float) -> Tensor:
    """The flat positions below n that a dropout of rate p < 1 zeroes, ascending [~n p] int64:
    each independently with probability p."""
    seed = int(torch.randint(_SEED_BOUND, (), dtype=torch.int64))  # PyTorch's default generator
    rng = np.random.PCG64(seed)
    if p <= SPARSE_BELOW:
        dropped = _dropped(np.random.Generator(rng), n, p)
    else:
        # PCG64's raw 64-bit outputs, each two 32-bit numbers (the generator's own stream,
        # without the range reduction of `integers`, which costs ~60 % more here)
        bits = rng.random_raw((n + 1) // 2).view(np.uint32)[:n]
        threshold = np.uint32(min(round(p * 2**32), 2**32 - 1))  # P(bits < threshold) = p
        dropped = np.flatnonzero(bits < threshold)
    return torch.from_numpy(dropped.astype(np.int64, copy=False))


# Up to this rate the dropped entries are drawn directly, as the gaps between them.
SPARSE_BELOW = 0.25


def _dropped(rng: np.random.Generator, n: int, p: float) -> np.ndarray:
    """The indices below n of the dropped entries: in a sequence of independent Bernoulli(p)
    draws the gaps between successes are independent Geometric(p), so drawing the gaps gives
    the same mask with ~n p numbers instead of n (half the time at p = 0.05)."""
    expected = n * p
    count = int(expected + 6 * expected**0.5 + 16)  # enough but for a > 6-sigma shortfall
    positions = np.cumsum(rng.geometric(p, size=count)) - 1
    while positions[-1] < n:  # the sequence has not passed the end yet: continue it
        more = positions[-1] + np.cumsum(rng.geometric(p, size=count))
        positions = np.concatenate([positions, more])
    return positions[positions < n]


def use_fast_dropout(model: nn.Module) -> int:
    """Put `FastDropout` in place of every `nn.Dropout` of peft's LoRA layers (their
    `lora_dropout` dicts); the number replaced."""
    replaced = 0
    for module in model.modules():
        rates = getattr(module, "lora_dropout", None)
        if not isinstance(rates, nn.ModuleDict):
            continue
        for name, dropout in rates.items():
            if type(dropout) is nn.Dropout:
                rates[name] = FastDropout(dropout.p)
                replaced += 1
    return replaced
