"""Curriculum: stages that change the tasks' shares of the prompts as the run progresses.

Each stage sets task weights (a task left out keeps its `tasks.NAME.weight`; 0 = not drawn)
and ends when its `until` condition holds: a number of steps in the stage, or a metric of the
step (any key of metrics.jsonl, e.g. `eval/fairness/score` or `task/code/reward/mean`)
averaged over its last `window` values reaching `at_least` / `at_most`. The last stage runs
to the end. Each change is one `[Curriculum@N]` line; the stage is a metric and part of every
checkpoint, so a resumed run continues in the stage it was in.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from mogrpo.config.curriculum import CurriculumConfig, StageConfig, stage_weights
from mogrpo.errors import ConfigError

log = logging.getLogger(__name__)


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
