"""The `health` config section: per check, whether it runs, its thresholds, patience and action."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mogrpo.config.base import Section

Action = Literal["warn", "stop"]
EvalAction = Literal["warn", "stop", "rollback"]


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
    """Consecutive steps above the factor that make one spike."""
    repeats: int = Field(2, ge=1)
    """Spikes within `window` steps that raise the alert: gradient clipping
    (train.max_grad_norm) contains a lone spike; repeated ones precede divergence."""
    factor: float = Field(10.0, gt=1)
    """A spike is a grad norm above this × the running median."""
    window: int = Field(50, ge=2)
    """Steps in the running median."""
    min_history: int = Field(10, ge=1)
    """Steps of history needed before spikes are judged."""
    contained: float = Field(4.0, ge=1)
    """A spike that gradient clipping (train.max_grad_norm) cuts to at most this × the running
    median is contained and does not count: the optimizer received a gradient a few typical
    ones in size. A converged policy meets such spikes now and then (a rare sampled answer in
    a group of otherwise equal rewards carries a large advantage and a large log-prob
    gradient); the demo's seed 4 met two in 30 steps, 14× and 30× its median, both clipped to 2×."""


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


class RewardRegressionConfig(CheckConfig):
    """Thresholds chosen on recorded runs (tests/unit/fixtures/health): they catch issue 18's
    collapse (sampled reward 0.94 → 0.1 in 40 steps of 16 samples) by step 20 and stay silent
    on the demo's three seeds and on a healthy lr 1e-5 run."""

    patience: int = Field(2, ge=1)
    """Consecutive steps the test must hold. Each step's test already compares two windows of
    `window` steps, so 2 only guards against one step tipping a borderline comparison."""
    window: int = Field(8, ge=3)
    """Steps in the recent window and in each reference window (the run's first `window`
    steps, and the best `window` consecutive steps that ended before the recent window began).
    8 steps of 16 completions = 128 samples a side; nothing is judged before 2 × window steps."""
    p_value: float = Field(0.01, gt=0, lt=0.5)
    """One-sided Mann–Whitney p-value below which the recent window counts as lower than the
    reference (a rank test: one step's mean of 16 samples is noisy and bounded)."""
    min_effect: float = Field(2.0, ge=0)
    """Below the run's first window: the drop of the window means must also be this many times
    one step's noise (estimated from the run, see `health.stats.StepNoise`)."""
    best_effect: float = Field(3.0, ge=0)
    """Below the best window so far, the drop must be this many times one step's noise: the best
    of a long run's windows sits above the true level by its noise (of 100 simulated flat runs
    of 250 steps, 2× alerted in 10, 3× in none; a 0.9 → 0.5 fall is still caught)."""
    min_drop: float = Field(0.05, ge=0)
    """The drop × the objective's weight must also be at least this much: the task's reward
    falls by that much (a deterministic reward has no noise; a format bonus of weight 0.1
    dipping by 0.15 early in the demo is no regression)."""
    kl_growth: float = Field(1.5, gt=1)
    """Tasks with a fixed β: the alert adds the KL signal when the recent window's median KL
    is at least this × the reference window's (and higher by the same rank test)."""
    min_kl: float = Field(0.01, ge=0)
    """KL below this is not called grown (0.001 → 0.003 means nothing)."""


class EvalRegressionConfig(CheckConfig):
    patience: int = Field(1, ge=1)
    """Consecutive quick-evals below the start or the best (evals are 20–50 steps apart)."""
    action: EvalAction = "warn"
    """`warn`; `stop`: end the run and name the best checkpoint on the Pareto front;
    `rollback`: restore that checkpoint, multiply the learning rate by `lr_factor` and go on
    (a checkpoint is then saved before GRPO and at every eval, so one exists to go back to)."""
    z: float = Field(2.33, gt=0)
    """Below the start by more than z × the sampling error of the two scores (binomial
    √(p(1-p)/n) on the eval size, or the scores' std): 2.33 = one-sided 99 %."""
    min_drop: float = Field(0.02, ge=0)
    """The drop below the start must also be at least this much (score units): 1 prompt of 50
    is no regression."""
    best_margin: float = Field(0.1, ge=0)
    """Below the best eval so far by more than this (and z × the sampling error): the best of
    several evals is biased upward by their noise, so it needs a margin of its own."""
    lr_factor: float = Field(0.1, gt=0, lt=1)
    """`rollback`: the learning rate is multiplied by this (e.g. 1e-4 → 1e-5)."""
    max_rollbacks: int = Field(2, ge=0)
    """`rollback`: after this many rollbacks a further regression stops the run."""


class TaskStalledConfig(CheckConfig):
    patience: int = Field(4, ge=1)
    """Quick-evals over which a task's score has not moved, nor ever risen `min_rise` above its
    first eval, while another task's rose (evals are 20–50 steps apart: 4 is 80–200 steps)."""
    min_delta: float = Field(0.03, ge=0)
    """Not moved: the task's scores over those evals lie within this of each other (greedy
    accuracy on 200 prompts has a sampling error of ~0.035)."""
    min_rise: float = Field(0.05, gt=0)
    """Another task improved: its score rose by at least this over the same evals."""
    lag: int = Field(2, ge=0)
    """...and had risen `lag` evals before the latest: the task has stayed flat that long
    while the other was ahead (tasks learn at different times; one eval behind is no stall)."""


class KLOutOfBandConfig(CheckConfig):
    patience: int = Field(1, ge=1)
    """Consecutive steps whose window is mostly outside before the alert fires."""
    window: int = Field(50, ge=5)
    """Steps of a task's KL judged together (after the first `window` steps of the run)."""
    factor: float = Field(2.0, ge=1)
    """Far outside: above `factor` × `high` or below `low` / `factor`."""
    fraction: float = Field(0.8, gt=0, le=1)
    """Alert when at least this fraction of the window's steps is far outside the band."""


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
    reward_regression: RewardRegressionConfig = Field(default_factory=RewardRegressionConfig)
    """A task's objective falls below its best window (with KL growth, for a fixed β)."""
    eval_regression: EvalRegressionConfig = Field(default_factory=EvalRegressionConfig)
    """A quick-eval score below the start or the best eval by more than its sampling error."""
    task_stalled: TaskStalledConfig = Field(default_factory=TaskStalledConfig)
    """A task whose quick-eval score does not move while another task's rises."""
    kl_out_of_band: KLOutOfBandConfig = Field(default_factory=KLOutOfBandConfig)
    """A task whose KL sits far outside its band (`band`, `dual`) for most of a window."""
