"""Dynamic sampling (DAPO, arXiv 2503.14476, section 3.2): drop groups that carry no signal.

A group whose completions all get the same reward has zero group-relative advantage for
every completion, so it adds nothing to the gradient but still dilutes the batch. DAPO drops
such groups and samples more prompts until the batch is full; :class:`RefillBudget` caps
the extra rollout rounds and counts what happened for the logs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

# Shared with group_advantages so "uninformative" means exactly what the advantages see.
from mogrpo.algo.advantages import _impute_missing
from mogrpo.errors import ConfigError

EQUAL_ATOL = 1e-8
"""Combined rewards closer than this (absolute) count as equal."""


def informative_groups(rewards: Tensor, weights: Tensor | Sequence[float]) -> Tensor:
    """Which groups carry a learning signal; rewards [N, K, J] (NaN = missing) -> [N] bool.

    A group is uninformative when its combined reward ``sum_j w_j r_j`` is the same for all
    completions (within ``EQUAL_ATOL``), or when fewer than 2 of its completions were scored
    by any objective. Missing rewards are handled per objective exactly as in
    :func:`~mogrpo.algo.advantages.group_advantages`: a NaN takes its objective's group
    mean, so it neither adds nor hides spread.

    The criterion is the weighted sum, which is exact for ``sum_then_normalize``. Under
    ``normalize_then_sum`` a group whose objectives vary but whose weighted sum is constant
    (say A = [0, 1], B = [2, 0], w = [1, 0.5]) is dropped too, although it has a small
    signal: a trade-off that cancels at the configured weights.
    """
    if rewards.ndim != 3:
        raise ValueError(f"rewards must be [N, K, J], got shape {tuple(rewards.shape)}")
    J = rewards.shape[-1]
    w = torch.as_tensor(weights, dtype=torch.float64, device=rewards.device).flatten()  # [J]
    if w.numel() != J:
        raise ConfigError(
            f"got {w.numel()} objective weights for {J} objectives; give one per objective"
        )
    # float64 so a rounding difference of the weighted sum is not taken for a signal.
    r = rewards.to(torch.float64)  # [N, K, J]
    scored = (~torch.isnan(r)).any(dim=-1).sum(dim=1)  # [N] completions scored at all
    combined = (_impute_missing(r) * w).sum(dim=-1)  # [N, K]
    spread = combined.amax(dim=1) - combined.amin(dim=1)  # [N]
    return (scored >= 2) & (spread > EQUAL_ATOL)


class RefillBudget:
    """Extra rollout rounds of one step, and the dropped/refilled counts for logging.

    Per step::

        budget.reset(target=num_prompts)
        keep = budget.observe(informative_groups(rewards, weights))   # the regular rollout
        while budget.needs_refill():
            ...  # roll out more prompts
            keep = budget.observe(informative_groups(rewards, weights))  # an extra round

    ``observe`` returns which groups of that round to keep: the informative ones, up to the
    number still missing. When the cap is reached first, the batch stays short (``missing``
    > 0); with nothing kept at all the trainer has no update to make this step.

    Counts, reset by :meth:`reset`: ``kept`` informative groups kept; ``dropped`` groups
    without signal; ``rounds`` extra rollout rounds (the regular rollout is not one);
    ``refilled`` groups kept from extra rounds; ``surplus`` informative groups not needed
    because the batch was already full.
    """

    def __init__(self, max_extra_rounds: int) -> None:
        if isinstance(max_extra_rounds, bool) or not isinstance(max_extra_rounds, int) or (
            max_extra_rounds < 0
        ):
            raise ConfigError(
                f"dynamic sampling max_extra_rounds={max_extra_rounds!r} must be an integer "
                ">= 0 (0 = drop uninformative groups without sampling more)"
            )
        self.max_extra_rounds = max_extra_rounds
        self.reset(0)

    def reset(self, target: int) -> None:
        """Start a step that needs ``target`` informative groups."""
        self.target = target
        self.kept = self.rounds = self.dropped = self.refilled = self.surplus = 0
        self._observed = False

    @property
    def missing(self) -> int:
        """Informative groups still needed to fill the batch."""
        return max(self.target - self.kept, 0)

    def needs_refill(self) -> bool:
        """Whether to roll out another round: the batch is short and the cap allows it."""
        return self.missing > 0 and self.rounds < self.max_extra_rounds

    def observe(self, informative: Tensor) -> Tensor:
        """Count one round's groups ([G] bool from :func:`informative_groups`); returns the
        [G] bool mask of the groups to keep."""
        extra = self._observed
        if extra and self.rounds >= self.max_extra_rounds:
            raise RuntimeError(
                f"refill budget exhausted ({self.max_extra_rounds} extra rounds); "
                "check needs_refill() before rolling out again"
            )
        informative = informative.bool()  # [G]
        rank = informative.long().cumsum(0)  # [G] 1-based rank among informative groups
        keep = informative & (rank <= self.missing)  # [G]
        n_keep, n_inf = int(keep.sum()), int(informative.sum())
        self.dropped += informative.numel() - n_inf
        self.surplus += n_inf - n_keep
        self.kept += n_keep
        if extra:
            self.rounds += 1
            self.refilled += n_keep
        self._observed = True
        return keep

    def metrics(self, prefix: str) -> dict[str, float]:
        """This step's counts as metrics named `<prefix>/<count>` (the trainer's prefix:
        `rollout/dynamic_sampling`)."""
        names = ("dropped", "refilled", "rounds", "surplus", "missing")
        return {f"{prefix}/{k}": float(getattr(self, k)) for k in names}
