"""The `health` config section: per check, whether it runs, its thresholds, patience and action."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mogrpo.config.base import Section

Action = Literal["warn", "stop"]


class CheckConfig(Section):
    enabled: bool = True
    """Run this check."""
    patience: int = Field(5, ge=1)
    """Consecutive steps the condition must hold before the alert fires."""
    action: Action = "warn"
    """`warn`: log the alert and write it to metrics.jsonl; `stop`: also end the run."""


class NotLearningConfig(CheckConfig):
    patience: int = Field(10, ge=1)
    """Consecutive steps with KL and update size at 0 (while lr > 0 and advantages ≠ 0)."""
    action: Action = "stop"
    """`stop` (default: every further step is wasted GPU time) or `warn`."""
    kl_epsilon: float = Field(1e-8, ge=0)
    """KL at or below this is 0: the policy still equals the reference."""
    update_epsilon: float = Field(0.0, ge=0)
    """`policy/update_norm` (else `policy/grad_norm`) at or below this is no update."""


class KLExplosionConfig(CheckConfig):
    patience: int = Field(3, ge=1)
    """Consecutive steps above the ceiling or the growth factor."""
    ceiling: float = Field(1.0, gt=0)
    """Absolute KL ceiling per task (healthy runs sit around 0.02–0.3); a task whose KL
    controller steers toward a larger budget gets `budget_factor` × that budget instead."""
    growth_factor: float = Field(5.0, gt=1)
    """Alert when KL exceeds this × its median over the earlier half of the window (tasks
    with a fixed β only: where a controller steers KL toward a budget, the ceiling applies)."""
    window: int = Field(20, ge=4)
    """Steps of KL history for the growth test."""
    min_kl: float = Field(0.05, ge=0)
    """Growth only counts once KL is at least this (0.001 → 0.005 is not an explosion)."""
    budget_factor: float = Field(3.0, gt=1)
    """A task with a KL budget (band `high`, proportional `target`) has the ceiling
    max(`ceiling`, this × budget)."""
    smooth: int = Field(5, ge=1)
    """The check judges the median KL of the last N steps: one step's KL, estimated from a
    few hundred sampled tokens, is noisy, and a KL that stays high with an occasional low step
    would otherwise restart the patience every time. 1 = judge each step's value."""


class LengthCollapseConfig(CheckConfig):
    patience: int = Field(3, ge=1)
    """Consecutive steps below the floor or the drop threshold."""
    floor: float = Field(2.0, ge=0)
    """Mean completion length (tokens) below which completions have collapsed."""
    drop_factor: float = Field(0.3, gt=0, lt=1)
    """Alert when the mean falls below this × its median over the window."""
    window: int = Field(20, ge=2)
    """Steps of length history for the drop test."""


class TruncationConfig(CheckConfig):
    threshold: float = Field(0.2, gt=0, le=1)
    """Fraction of completions cut at max_completion_length (healthy runs: ≈ 0)."""


class NoSignalConfig(CheckConfig):
    patience: int = Field(10, ge=1)
    """Consecutive steps with too many zero-variance groups."""
    threshold: float = Field(0.9, gt=0, le=1)
    """Fraction of a task's groups whose K rewards are all equal (no advantage, no gradient)."""


class NonFiniteConfig(CheckConfig):
    patience: int = Field(3, ge=1)
    """Steps (not necessarily consecutive) with NaN/inf in loss, grad norm, KL or logits."""
    action: Action = "stop"
    """`stop` (default: the run is diverging) or `warn`."""


class GradSpikeConfig(CheckConfig):
    patience: int = Field(1, ge=1)
    """Consecutive spiking steps."""
    factor: float = Field(10.0, gt=1)
    """A spike is a grad norm above this × the running median."""
    window: int = Field(50, ge=2)
    """Steps in the running median."""
    min_history: int = Field(10, ge=1)
    """Steps of history needed before spikes are judged."""


class SamplingIgnoredConfig(CheckConfig):
    entropy_floor: float = Field(0.01, ge=0)
    """Mean token entropy (nats) below which sampling looks greedy."""
    identical_threshold: float = Field(0.9, gt=0, le=1)
    """Fraction of groups with K identical completions (`rollout/identical_group_frac`)."""
    min_temperature: float = Field(0.3, ge=0)
    """Only judge runs sampling at least this hot (cold sampling is near-greedy by design)."""


class RewardStalledConfig(CheckConfig):
    patience: int = Field(200, ge=1)
    """Steps without improvement of a task's smoothed reward mean."""
    min_delta: float = Field(0.01, ge=0)
    """Improvement that counts (in reward units)."""
    smooth: int = Field(10, ge=1)
    """Steps in the moving average the best value is taken over."""


class HealthConfig(Section):
    enabled: bool = True
    """Watch every step's metrics; alerts go to the log, metrics.jsonl and the run summary."""
    not_learning: NotLearningConfig = Field(default_factory=NotLearningConfig)
    """KL to the reference and the update size stay 0 (accumulation bug, frozen parameters)."""
    kl_explosion: KLExplosionConfig = Field(default_factory=KLExplosionConfig)
    """KL above a ceiling, or growing by a factor within a window."""
    length_collapse: LengthCollapseConfig = Field(default_factory=LengthCollapseConfig)
    """Mean completion length below a floor, or falling sharply."""
    truncation: TruncationConfig = Field(default_factory=TruncationConfig)
    """Too many completions cut by the length budget."""
    no_signal: NoSignalConfig = Field(default_factory=NoSignalConfig)
    """Too many groups whose K completions all score the same."""
    non_finite: NonFiniteConfig = Field(default_factory=NonFiniteConfig)
    """NaN/inf in loss, grad norm, KL or logits."""
    grad_spike: GradSpikeConfig = Field(default_factory=GradSpikeConfig)
    """Gradient norm far above its running median."""
    sampling_ignored: SamplingIgnoredConfig = Field(default_factory=SamplingIgnoredConfig)
    """Entropy or in-group diversity inconsistent with the sampling temperature."""
    reward_stalled: RewardStalledConfig = Field(default_factory=RewardStalledConfig)
    """No improvement of a task's reward over a long window."""
