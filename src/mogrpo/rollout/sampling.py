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

from dataclasses import dataclass, field, fields

import torch
from torch import Tensor

from mogrpo.config.rollout import RolloutConfig
from mogrpo.errors import ConfigError
from mogrpo.rollout.processors import NonFiniteGuard


@dataclass
class SamplingSettings:
    """How completions are sampled during rollout."""

    max_new_tokens: int = 64
    """Upper bound on completion length; a completion reaching it without a stop is truncated."""
    temperature: float = 1.0
    """Softmax temperature (> 0); log-probs at training time must use the same value."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 turns top-k off."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1.0 turns it off."""
    min_p: float = 0.0
    """Drop tokens below min_p x the top probability; 0.0 turns it off."""
    presence_penalty: float = 0.0
    """OpenAI presence penalty over generated tokens."""
    frequency_penalty: float = 0.0
    """OpenAI frequency penalty over generated tokens."""
    repetition_penalty: float = 1.0
    """CTRL-style repetition penalty (1.0 = off)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end a completion; empty = the tokenizer's and checkpoint's EOS ids."""
    greedy: bool = False
    """Argmax decoding (quick-eval); sampling fields are then ignored."""

    def __post_init__(self) -> None:
        checks = [
            (self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1"),
            (self.greedy or self.temperature > 0, "temperature", "must be > 0 when sampling"),
            (self.top_k >= 0, "top_k", "must be >= 0 (0 turns it off)"),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p", "must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty", "must be > 0 (1.0 turns it off)"),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise ConfigError(f"{name} = {getattr(self, name)!r} {rule}")

    @classmethod
    def from_rollout(cls, rollout: RolloutConfig, stop_token_ids: list[int] | None = None
                     ) -> SamplingSettings:
        """The settings a run's `rollout` section asks for: every field of this type that the
        section has (the completion budget is the section's `completion_length`)."""
        same = {f.name: getattr(rollout, f.name) for f in fields(cls)
                if f.name in type(rollout).model_fields}
        same["stop_token_ids"] = list(stop_token_ids if stop_token_ids is not None
                                      else rollout.stop_token_ids)
        return cls(max_new_tokens=rollout.completion_length, **same)


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
