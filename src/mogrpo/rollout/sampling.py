"""The next-token rules of `SamplingSettings` as a few tensor operations per token.

The native engine applies these itself instead of going through `generate()`'s processor
lists. They are applied in the order `generate()` uses, with the same arithmetic, so both
engines sample the same distribution (tests compare the processed logits of the two exactly):

1. repetition penalty over prompt and generated tokens (CTRL);
2. OpenAI presence / frequency penalties over generated tokens only;
3. the non-finite guard (NaN / +inf replaced, counted for the health monitor);
4. when sampling: temperature, top-k, top-p, min-p; then one multinomial draw.
   When greedy: argmax after steps 1-3.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from mogrpo.rollout.processors import NonFiniteGuard

if TYPE_CHECKING:
    from mogrpo.rollout.generate import SamplingSettings


class SamplingRules:
    """Per-row sampling state (tokens seen, token counts) and the rules that use it.

    `prompt_ids` [B, P] are the left-padded prompts; the repetition penalty counts them (pad
    ids included, exactly as `generate()` does), the presence/frequency penalties do not.
    """

    def __init__(self, settings: SamplingSettings, prompt_ids: Tensor, vocab_size: int) -> None:
        self.settings = settings
        B, device = prompt_ids.shape[0], prompt_ids.device
        self.seen: Tensor | None = None  # [B, V] bool, for the repetition penalty
        if settings.repetition_penalty != 1.0:
            self.seen = torch.zeros(B, vocab_size, dtype=torch.bool, device=device)
            self.seen.scatter_(1, prompt_ids, True)
        self.counts: Tensor | None = None  # [B, V] float, generated-token counts
        if settings.presence_penalty != 0.0 or settings.frequency_penalty != 0.0:
            self.counts = torch.zeros(B, vocab_size, dtype=torch.float32, device=device)
        self.guard = NonFiniteGuard(temperature=1.0 if settings.greedy else settings.temperature)

    def __call__(self, logits: Tensor) -> Tensor:
        """Processed float32 scores [B, V] from raw next-token logits [B, V]."""
        s = self.settings
        scores = logits.float()
        if self.seen is not None:
            penalised = torch.where(scores < 0, scores * s.repetition_penalty,
                                    scores / s.repetition_penalty)
            scores = torch.where(self.seen, penalised, scores)
        if self.counts is not None:
            scores = scores - (s.presence_penalty * (self.counts > 0).to(scores.dtype)
                               + s.frequency_penalty * self.counts)
        scores = self.guard(None, scores)
        if s.greedy:
            return scores
        if s.temperature != 1.0:
            scores = scores / s.temperature
        if s.top_k > 0:
            kth = torch.topk(scores, min(s.top_k, scores.shape[-1])).values[..., -1:]  # [B, 1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if s.top_p < 1.0:
            scores = _top_p(scores, s.top_p)
        if s.min_p > 0.0:
            scores = _min_p(scores, s.min_p)
        return scores

    def choose(self, scores: Tensor) -> Tensor:
        """The next token of each row [B]: argmax when greedy, else one draw from softmax."""
        if self.settings.greedy:
            return scores.argmax(dim=-1)
        return draw(torch.softmax(scores, dim=-1))

    def observe(self, tokens: Tensor) -> None:
        """Record the tokens just generated [B] for the penalties of the next steps."""
        if self.seen is not None:
            self.seen.scatter_(1, tokens[:, None], True)
        if self.counts is not None:
            self.counts.scatter_add_(1, tokens[:, None], torch.ones_like(tokens[:, None],
                                                                        dtype=self.counts.dtype))

    def keep(self, rows: Tensor) -> None:
        """Keep only the given rows (finished ones leave the batch)."""
        if self.seen is not None:
            self.seen = self.seen[rows]
        if self.counts is not None:
            self.counts = self.counts[rows]


def draw(probs: Tensor) -> Tensor:
    """One token per row of probs [B, V], by inverting the cumulative distribution.

    The same distribution as `torch.multinomial(probs, 1)`, which on CPUs draws an exponential
    variate for every vocabulary entry: here one uniform per row and a binary search.
    u is in (0, total], and the search takes the first index whose cumulative mass reaches u,
    so a zero-probability token is never chosen and the index is always in range. The sum runs
    in float64: a float32 running sum over a 150k-token vocabulary would misplace the share of
    the least likely tokens by up to ~1e-7 each.
    """
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)  # [B, V]
    u = (1.0 - torch.rand(probs.shape[0], 1, dtype=cdf.dtype, device=cdf.device)) * cdf[:, -1:]
    return torch.searchsorted(cdf, u).squeeze(1)


def _top_p(scores: Tensor, top_p: float) -> Tensor:
    """Nucleus filter: drop the least likely tokens whose total mass is at most 1 - top_p."""
    sorted_scores, order = torch.sort(scores, descending=False)  # [B, V] ascending
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= (1 - top_p)
    remove_sorted[..., -1:] = False  # the most likely token always stays
    remove = remove_sorted.scatter(1, order, remove_sorted)
    return scores.masked_fill(remove, float("-inf"))


def _min_p(scores: Tensor, min_p: float) -> Tensor:
    """Drop tokens whose probability is below min_p x the most likely token's."""
    probs = torch.softmax(scores, dim=-1)
    remove = probs < min_p * probs.amax(dim=-1, keepdim=True)
    remove.scatter_(-1, probs.argmax(dim=-1, keepdim=True), False)
    return scores.masked_fill(remove, float("-inf"))
