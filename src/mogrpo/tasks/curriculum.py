"""Curriculum: stages that change the tasks' shares of the prompts as the run progresses.

Each stage sets task weights (a task left out keeps its `tasks.NAME.weight`; 0 = not drawn)
and ends when its `until` condition holds: a number of steps in the stage, or a metric of the
step (any key of metrics.jsonl, e.g. `eval/fairness/score` or `task/code/reward/mean`)
averaged over its last `window` values reaching `at_least` / `at_most`. The last stage runs
to the end. Each change is one `[Curriculum@N]` line; the stage is a metric and part of every
checkpoint, so a resumed run continues in the stage it was in.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Mapping
from typing import Any

from pydantic import Field, model_validator

from mogrpo.config.base import Section
from mogrpo.errors import ConfigError

log = logging.getLogger(__name__)


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


class Curriculum:
    """Which stage the run is in; `observe` each step's metrics to move on."""

    def __init__(self, config: CurriculumConfig, base_weights: Mapping[str, float]) -> None:
        self.config = config
        self.base = dict(base_weights)
        self.index = 0
        self.entered = 0  # the step count when the current stage began
        self.values: list[float] = []  # the until-metric's recent values in this stage
        self.changes: list[str] = []

    @property
    def active(self) -> bool:
        return bool(self.config.stages)

    @property
    def stage(self) -> StageConfig | None:
        return self.config.stages[self.index] if self.active else None

    def weights(self) -> list[float]:
        """The current stage's weight per task, in task order."""
        stage = self.stage
        chosen = stage_weights(stage, self.base) if stage else self.base
        return [chosen[name] for name in self.base]

    def observe(self, step: int, metrics: Mapping[str, Any]) -> str | None:
        """Count step `step` toward the stage; returns the change line when the stage ends."""
        stage = self.stage
        if stage is None or stage.until is None:
            return None
        until, done = stage.until, step - self.entered
        if until.steps is not None:
            if done < until.steps:
                return None
            reason = f"{done} steps"
        else:
            value = metrics.get(until.metric)
            if not isinstance(value, int | float):
                return None
            self.values = [*self.values, float(value)][-until.window:]
            mean = sum(self.values) / len(self.values)
            reached = mean >= until.at_least if until.at_least is not None \
                else mean <= until.at_most
            if len(self.values) < until.window or done < until.min_steps or not reached:
                return None
            sign, bound = (">=", until.at_least) if until.at_least is not None \
                else ("<=", until.at_most)
            mean_of = f" (mean of {until.window})" if until.window > 1 else ""
            reason = f"{until.metric} {mean:.3f}{mean_of} {sign} {bound:g}"
        following = self.config.stages[self.index + 1]
        self.index, self.entered, self.values = self.index + 1, step, []
        weights = ", ".join(f"{n} {w:g}" for n, w in stage_weights(following, self.base).items())
        line = (f"[Curriculum@{step}] stage {stage.name} -> {following.name}: {reason}; "
                f"task weights {weights}")
        self.changes.append(line)
        return line

    def state_dict(self) -> dict[str, Any]:
        return {"index": self.index, "stage": self.stage.name if self.stage else None,
                "entered": self.entered, "values": list(self.values),
                "changes": list(self.changes)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue in the saved stage: found by name when the stages changed on a resume
        (`--allow-config-change`), else by position; a position the new curriculum does not
        have is a ConfigError naming the way out."""
        index, name = int(state["index"]), state.get("stage")
        names = [stage.name for stage in self.config.stages]
        if self.active and name in names:
            index = names.index(name)
        elif self.active and index >= len(names):
            saved = f"stage {index + 1}" + (f" ({name!r})" if name else "")
            rename = f"name one of them {name!r} (the run goes on in it), " if name else ""
            raise ConfigError(
                f"the checkpoint is in curriculum {saved}, but the config's curriculum has "
                f"{len(names)} stage(s): {', '.join(names)}. To continue, {rename}put the "
                "removed stages back, or start a new run")
        elif self.active and name is not None:
            log.warning("curriculum: the checkpoint's stage %r is not in the config; "
                        "continuing in stage %d (%r), at the same position", name, index + 1,
                        names[index])
        self.index, self.entered = index, int(state["entered"])
        self.values, self.changes = list(state["values"]), list(state["changes"])
