"""The curriculum's config section: stages that change the tasks' shares of the prompts as the
run progresses (the stages at run time: `mogrpo.tasks.curriculum`)."""

from __future__ import annotations

import difflib
from collections.abc import Mapping

from pydantic import Field, model_validator

from mogrpo.config.base import Section
from mogrpo.errors import ConfigError


class UntilConfig(Section):
    steps: int | None = Field(None, ge=1)
    """End the stage after this many steps in it."""
    metric: str | None = None
    """End the stage when this step metric (e.g. `eval/fairness/score`) reaches a threshold."""
    at_least: float | None = None
    """metric: the stage ends when the metric's recent mean is >= this."""
    at_most: float | None = None
    """metric: the stage ends when the metric's recent mean is <= this."""
    window: int = Field(1, ge=1)
    """metric: mean over the last N values of the metric (steps where it is logged)."""
    min_steps: int = Field(0, ge=0)
    """metric: the stage lasts at least this many steps."""

    @model_validator(mode="after")
    def _one_condition(self) -> UntilConfig:
        if (self.steps is None) == (self.metric is None):
            raise ValueError("give either `steps: N` or `metric: NAME` with at_least/at_most")
        if self.metric is not None and (self.at_least is None) == (self.at_most is None):
            raise ValueError(f"metric {self.metric!r} needs exactly one of at_least / at_most")
        if self.steps is not None and (self.at_least, self.at_most) != (None, None):
            raise ValueError("at_least / at_most belong to `metric`, not to `steps`")
        return self


class StageConfig(Section):
    name: str
    """The stage's name in logs and metrics."""
    task_weights: dict[str, float] = Field(default_factory=dict)
    """Task shares during the stage (task name → weight ≥ 0; a task left out keeps its
    `tasks.NAME.weight`; 0 = not drawn)."""
    until: UntilConfig | None = None
    """When the stage ends; the last stage has none and runs to the end."""


class CurriculumConfig(Section):
    stages: list[StageConfig] = Field(default_factory=list)
    """Stages in order (empty = no curriculum: the task weights hold for the whole run)."""

    @model_validator(mode="after")
    def _stages(self) -> CurriculumConfig:
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names):
            raise ValueError(f"stage names must be unique, got {names}")
        for i, stage in enumerate(self.stages):
            last = i == len(self.stages) - 1
            if stage.until is None and not last:
                raise ValueError(f"stage {stage.name!r} needs `until` (only the last stage runs "
                                 "to the end)")
            if stage.until is not None and last:
                raise ValueError(f"the last stage {stage.name!r} runs to the end: remove its "
                                 "`until`")
            if any(w < 0 for w in stage.task_weights.values()):
                raise ValueError(f"stage {stage.name!r}: task weights must be >= 0")
        return self

    def check_tasks(self, tasks: Mapping[str, float]) -> None:
        """Every named task exists and every stage draws some task (ConfigError otherwise)."""
        for stage in self.stages:
            for name in stage.task_weights:
                if name not in tasks:
                    close = difflib.get_close_matches(name, list(tasks), n=1)
                    hint = f"did you mean {close[0]!r}? " if close else ""
                    raise ConfigError(f"curriculum stage {stage.name!r} weights task {name!r}, "
                                      f"which is not a task; {hint}tasks: {', '.join(tasks)}")
            if not any(w > 0 for w in stage_weights(stage, tasks).values()):
                raise ConfigError(f"curriculum stage {stage.name!r} gives every task weight 0; "
                                  "give at least one task a positive weight")


def stage_weights(stage: StageConfig, base: Mapping[str, float]) -> dict[str, float]:
    """The stage's weight for every task (the base weight where the stage names none)."""
    return {name: stage.task_weights.get(name, weight) for name, weight in base.items()}
