"""Logits processors used during rollout: OpenAI-style penalties and a guard against NaN/inf."""

from __future__ import annotations

import math

import torch
from transformers import LogitsProcessor


class PresenceFrequencyPenalty(LogitsProcessor):
    """OpenAI presence/frequency penalties over the tokens generated so far (never the prompt).

    `logits[v] -= presence * [count_v > 0] + frequency * count_v`, where `count_v` counts token `v`
    in `input_ids[:, prompt_length:]`. Rows are left-padded to a common width, so one
    `prompt_length` (the input width when generation started) is right for every row.
    """

    def __init__(self, presence: float, frequency: float, prompt_length: int) -> None:
        if prompt_length < 0:
            raise ValueError(f"prompt_length must be >= 0, got {prompt_length}")
        self.presence = float(presence)
        self.frequency = float(frequency)
        self.prompt_length = int(prompt_length)

    @property
    def active(self) -> bool:
        """True when at least one penalty is non-zero."""
        return self.presence != 0.0 or self.frequency != 0.0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        generated = input_ids[:, self.prompt_length :]  # [B, t]
        if not self.active or generated.shape[1] == 0:
            return scores
        counts = torch.zeros_like(scores)  # [B, V]
        counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        penalty = self.presence * (counts > 0).to(scores.dtype) + self.frequency * counts
        return scores - penalty


class NonFiniteGuard(LogitsProcessor):
    """Replace non-finite logits so sampling never sees NaN, and count how often that happened.

    NaN becomes the most negative finite value and +inf the largest finite value; -inf stays
    (it is how other processors mask tokens). A row with no finite value at all is reset to
    zeros (uniform) so `torch.multinomial` stays defined. `replaced` counts changed entries and
    `rows_reset` the reset rows, for the health monitor.

    `temperature` scales the replacement magnitude down when the sampling temperature is below
    1: generate() divides logits by the temperature *after* custom processors, and
    `finfo.max / 0.5` would overflow back to +inf.
    """

    def __init__(self, temperature: float = 1.0) -> None:
        self.headroom = min(1.0, float(temperature)) if temperature > 0 else 1.0
        self.replaced = 0
        self.rows_reset = 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        # One host sync per step; cheap next to a forward pass and keeps the common path a no-op.
        # A finite sum means every entry is finite (NaN and ±inf propagate into it); an
        # overflowing sum of finite values only sends it to the full check below.
        if math.isfinite(scores.sum().item()):
            return scores
        finite = torch.isfinite(scores)  # [B, V]
        if bool(finite.all()):
            return scores
        info = torch.finfo(scores.dtype)
        nan = torch.isnan(scores)
        pos_inf = scores == float("inf")
        dead_rows = ~finite.any(dim=-1)  # [B]
        out = torch.where(nan, torch.full_like(scores, info.min * self.headroom), scores)
        out = torch.where(pos_inf, torch.full_like(scores, info.max * self.headroom), out)
        out = torch.where(dead_rows[:, None], torch.zeros_like(scores), out)

        partial = ~dead_rows[:, None]
        self.replaced += (
            int(((nan | pos_inf) & partial).sum()) + int(dead_rows.sum()) * scores.shape[-1]
        )
        self.rows_reset += int(dead_rows.sum())
        return out
