"""What a GRPO step hands from phase to phase: the scored rollout and what the update needs."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mogrpo.data.schema import Example
from mogrpo.rollout.generate import Rollout


@dataclass
class RewardBatch:
    """Prompts, their K completions each, and every objective's reward per completion."""

    picks: list[tuple[int, Example]]  # (task index, example) per prompt
    rollout: Rollout
    rewards: list[torch.Tensor]  # per prompt: [K, J of its task], NaN = could not score
    extras: list[dict[str, list]] = field(default_factory=list)
    """per prompt: the columns its reward functions logged with `log_extra`, K values each"""


@dataclass
class ScoredBatch:
    """A step's rollout with everything the update needs."""

    rollout: Rollout
    task_ids: torch.Tensor  # [B] task index of each completion
    advantages: torch.Tensor  # [B]
    beta: torch.Tensor  # [B] KL coefficient of each completion's task
    ref_logp: torch.Tensor | None = None  # [B, C]; None when no task has β > 0
    old_logp: torch.Tensor | None = None  # [B, C] rollout-time log-probs; None when μ = 1
