"""Does a sampler draw each token from the model's own next-token distribution? An exact test
at every position of every completion, shared by the unit tests and the checks of the engines.

The reference is computed apart from any engine: one teacher-forced forward of the model over
prompt + sampled completion gives the logits at every position, and `generate()`'s own
processor list (repetition penalty, mogrpo's presence/frequency penalties and non-finite
guard, temperature, top-k, top-p, min-p) turns them into the distribution that position must
be drawn from, given the sampled prefix (penalties count the prefix's tokens).

For each sampled token x at a position with distribution p, with the vocabulary ordered from
the most likely token down (ties by id), the randomised probability integral transform

    u = P(tokens before x in that order) + V * p(x),   V ~ Uniform(0, 1) independent,

is Uniform(0, 1) exactly when x ~ p, and the u of one completion's positions are independent
whatever the prefix. A row that stops leaves the sum at a time decided by its past only, so
the u of all (row, position) pairs that were sampled are i.i.d. Uniform(0, 1). The ordering
by probability gives the transform its power: a sampler that is too sharp (temperature too
low, a nucleus too small) puts u near 0, one too flat near 1.

A check of the support and four statistics, each tested at `ALPHA` (so a correct sampler fails
with probability at most 4 x ALPHA; the tests fix every seed, so a run is deterministic):

- `outside`: tokens drawn where the reference gives probability 0 (top-k, top-p, min-p cut
  them): must be none (a correct sampler draws none);
- `temperature_z`: the score test for the temperature, sum(log p(x) + H(p)) / sqrt(sum
  Var_p(log p)), the locally most powerful test against p^(1/T) for T near 1; approximately
  N(0, 1) (a martingale's central limit); two-sided;
- `pooled_p`: chi-square of the u over `BINS` equal bins, all positions pooled;
- `positions_p`: chi-square of the u over `POSITION_BINS` bins at each position with at least
  `POSITION_MIN` tokens, summed over positions (degrees of freedom added), so a bias at some
  positions cannot hide behind the others;
- `worst_position_p`: the smallest of those per-position p-values, against ALPHA / positions
  (Bonferroni), so a bias at one position shows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import LogitsProcessorList

from mogrpo.algo.logprobs import token_positions
from mogrpo.rollout.generate import SamplingSettings, build_generation_config
from mogrpo.rollout.processors import NonFiniteGuard, PresenceFrequencyPenalty

ALPHA = 1e-4
BINS = 20
POSITION_BINS = 10
POSITION_MIN = 100  # >= 10 expected per bin


def reference_scores(model, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
                     completion_mask: Tensor, settings: SamplingSettings, *, stop_ids: list[int],
                     pad_id: int) -> Tensor:
    """[B, C, V] the processed scores each completion token was to be drawn from softmax of:
    the model's teacher-forced logits through generate()'s processor list."""
    P, C = prompt_ids.shape[1], completion_ids.shape[1]
    ids = torch.cat([prompt_ids, completion_ids], 1)  # [B, P + C]
    mask = torch.cat([prompt_mask, completion_mask], 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask,
                       position_ids=token_positions(mask)).logits.float()  # [B, P + C, V]
    config = build_generation_config(settings, stop_ids=stop_ids, pad_id=pad_id)
    custom = LogitsProcessorList([
        PresenceFrequencyPenalty(settings.presence_penalty, settings.frequency_penalty, P),
        NonFiniteGuard(temperature=settings.temperature),
    ])
    processors = model._get_logits_processor(generation_config=config, input_ids_seq_length=P,
                                             logits_processor=custom, device="cpu")
    return torch.stack([processors(ids[:, :P + t], logits[:, P - 1 + t].clone())
                        for t in range(C)], 1)


@dataclass
class Fit:
    """The statistics of one sample (see the module docstring)."""

    tokens: int
    outside: int
    temperature_z: float
    temperature_p: float
    pooled_p: float
    positions_p: float
    worst_position_p: float
    positions: int

    def failures(self, alpha: float = ALPHA) -> list[str]:
        """The checks this sample fails at level `alpha`, in words; [] when it passes."""
        checks = [
            (self.outside == 0, f"{self.outside} tokens drawn outside the distribution's support"),
            (self.temperature_p >= alpha, f"temperature score z = {self.temperature_z:.2f} "
                                          f"(p = {self.temperature_p:.2g})"),
            (self.pooled_p >= alpha, f"pooled PIT chi-square p = {self.pooled_p:.2g}"),
            (self.positions_p >= alpha, f"per-position PIT chi-square sum p = "
                                        f"{self.positions_p:.2g}"),
            (self.worst_position_p >= alpha / max(self.positions, 1),
             f"worst position's PIT chi-square p = {self.worst_position_p:.2g} "
             f"(of {self.positions} positions)"),
        ]
        return [message for ok, message in checks if not ok]


def chi2_sf(statistic: float, dof: int) -> float:
    """P(chi-square with `dof` degrees of freedom >= statistic)."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def _uniform_chi2(u: Tensor, bins: int) -> float:
    counts = torch.bincount((u * bins).long().clamp(max=bins - 1), minlength=bins).double()
    expected = len(u) / bins
    return float(((counts - expected) ** 2 / expected).sum())


def randomised_pit(logp: Tensor, tokens: Tensor, generator: torch.Generator) -> Tensor:
    """[n] u of each token [n] under its distribution logp [n, V] (float64), the vocabulary
    ordered by probability, most likely first."""
    p = logp.exp()
    order = torch.sort(p, dim=-1, descending=True, stable=True).indices  # [n, V]
    sorted_p = p.gather(1, order)
    rank = (order == tokens[:, None]).int().argmax(1, keepdim=True)  # [n, 1]
    before = sorted_p.cumsum(1).gather(1, rank) - sorted_p.gather(1, rank)
    px = p.gather(1, tokens[:, None])
    v = torch.rand(len(tokens), 1, generator=generator, dtype=torch.float64)
    return (before + v * px).squeeze(1).clamp(0, 1)


def fit(scores: Tensor, tokens: Tensor, live: Tensor, seed: int = 0) -> Fit:
    """The statistics of sampled `tokens` [B, C] at the `live` [B, C] positions (the
    completion mask) against the reference `scores` [B, C, V]."""
    logp = torch.log_softmax(scores.double(), dim=-1)  # [B, C, V]
    rows = live.bool()
    position = torch.arange(tokens.shape[1]).expand_as(tokens)[rows]  # [n]
    logp, x = logp[rows], tokens[rows]  # [n, V], [n]
    lx = logp.gather(1, x[:, None]).squeeze(1)
    outside = int(torch.isneginf(lx).sum())
    p = logp.exp()
    plogp = torch.where(p > 0, p * logp, 0.0)
    entropy = -plogp.sum(1)
    variance = torch.where(p > 0, plogp * logp, 0.0).sum(1) - entropy**2
    finite = torch.isfinite(lx)
    z = float((lx + entropy)[finite].sum() / variance[finite].sum().clamp_min(1e-300).sqrt())
    u = randomised_pit(logp, x, torch.Generator().manual_seed(seed))
    per_position = [_uniform_chi2(u[position == t], POSITION_BINS)
                    for t in range(tokens.shape[1])
                    if int((position == t).sum()) >= POSITION_MIN]
    dof = POSITION_BINS - 1
    return Fit(
        tokens=len(x), outside=outside, temperature_z=z,
        temperature_p=float(torch.special.erfc(torch.tensor(abs(z) / 2**0.5))),
        pooled_p=chi2_sf(_uniform_chi2(u, BINS), BINS - 1),
        positions_p=chi2_sf(sum(per_position), dof * len(per_position)),
        worst_position_p=min((chi2_sf(c, dof) for c in per_position), default=1.0),
        positions=len(per_position),
    )
