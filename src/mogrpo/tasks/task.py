"""Tasks at run time: their examples and reward functions, and the mixer that fills each step.

The mixer is stateful (`state_dict()` / `load_state_dict()`), so a resumed run draws exactly
the prompts it would have drawn without the stop.
"""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mogrpo.algo.schedules import WeightSchedule, from_config
from mogrpo.config import RewardConfig, RunConfig, TaskConfig
from mogrpo.config.machine import SANDBOXED_REWARDS
from mogrpo.data.problems import ProblemLog
from mogrpo.data.schema import Example, parse_examples, split_examples
from mogrpo.data.sources import ExampleStream, is_streaming, load_records, open_stream
from mogrpo.errors import ConfigError, DataError, RewardError
from mogrpo.rewards.base import check_positional_only, check_reward_call, resolve_reward
from mogrpo.rewards.judge import JudgeReward
from mogrpo.rewards.reward_model import RewardModelReward
from mogrpo.tasks.agents import Agent

log = logging.getLogger(__name__)


@dataclass
class Task:
    """One task of a run: its prompts, held-out prompts, objectives and weights."""

    name: str
    config: TaskConfig
    train: list[Example]
    eval: list[Example]
    reward_fns: list[tuple[str, Callable, dict[str, Any]]] = field(default_factory=list)
    weight_schedules: list[WeightSchedule] = field(default_factory=list)
    stream: ExampleStream | None = None
    """Streamed data: training draws from it, and `train` holds only its checked first rows."""
    agent: Agent | None = None
    """Its tools and environments (`tasks.NAME.tools`, `.environment`): episodes of several
    turns; None: one completion per prompt."""

    @property
    def reward_labels(self) -> list[str]:
        return [label for label, _, _ in self.reward_fns]

    def reward_weights(self, step: int) -> list[float]:
        """Each objective's weight at `step` (constant or scheduled)."""
        return [schedule.at(step) for schedule in self.weight_schedules]


def _examples(spec: Any, task: TaskConfig, seed: int) -> list[Example]:
    """The data's examples; every problem of a file is raised at once (one DataError)."""
    problems = ProblemLog(strict=task.strict)
    return parse_examples(
        load_records(spec, seed, problems),
        format=task.format,
        prompt_template=task.prompt_template,
        drop_incomplete=task.drop_incomplete,
        problems=problems,
    )


def _split(name: str, tc: TaskConfig, seed: int
           ) -> tuple[list[Example], list[Example], ExampleStream | None]:
    """(train, held-out, stream): a streamed task's train examples are its checked preview."""
    if is_streaming(tc.data):
        preview, held_out, stream = open_stream(
            tc.data, task=name, format=tc.format, prompt_template=tc.prompt_template,
            drop_incomplete=tc.drop_incomplete, seed=seed,
            eval_size=0 if tc.eval_data is not None else tc.eval_size, strict=tc.strict)
        if tc.eval_data is not None:
            held_out = _examples(tc.eval_data, tc, seed + 1)
        return preview, held_out, stream
    examples = _examples(tc.data, tc, seed)
    if tc.eval_data is not None:
        return examples, _examples(tc.eval_data, tc, seed + 1), None
    if tc.eval_size:
        return (*split_examples(examples, tc.eval_size, seed), None)
    return examples, [], None


def _reward(task: str, i: int, reward: RewardConfig, config: RunConfig
            ) -> tuple[str, Callable, dict[str, Any]]:
    """(label, callable, per-call kwargs). A `judge` or `reward_model` is built once from its
    options (consumed here, not passed per call); everything else resolves by name or path."""
    if callable(reward.fn):  # passed from Python
        check_positional_only(reward.fn, reward.label)
        return reward.label, reward.fn, dict(reward.kwargs)
    if reward.fn.strip() == "reward_model":
        model = RewardModelReward.from_options(reward.kwargs, where=f"tasks.{task}.rewards.{i}.kwargs",
                                               policy_device=config.device)
        return reward.label, model, {}
    if reward.fn.strip() == "judge":
        judge = JudgeReward.from_options(reward.kwargs, where=f"tasks.{task}.rewards.{i}.kwargs",
                                         cache_dir=Path(config.output.dir))
        return reward.label, judge, {}
    kwargs = dict(reward.kwargs)
    if reward.fn.strip() in SANDBOXED_REWARDS:
        kwargs.setdefault("isolation", config.sandbox.isolation)
    return reward.label, resolve_reward(reward.fn), kwargs


def _named(task: str, i: int, reward: RewardConfig, config: RunConfig
           ) -> tuple[str, Callable, dict[str, Any]]:
    """`_reward`, its errors saying which entry of which task's rewards is wrong."""
    where = f"tasks.{task}.rewards.{i}"
    try:
        return _reward(task, i, reward, config)
    except RewardError as err:
        if str(err).startswith(where):  # a judge's or reward model's options say it already
            raise
        raise RewardError(f"{where}.fn: {err}") from err


def _check_labels(task: str, labels: list[str], configured: int) -> None:
    """Each objective of a task needs a name of its own: its metrics, its completions-log
    column and a judge's stats and checkpointed budget are keyed by it (two `fn: judge`
    without `name` would share one)."""
    def place(i: int) -> str:
        return f"tasks.{task}.rewards.{i}" if i < configured else \
            f"tasks.{task}.environment (its class's get_reward)"

    for i, label in enumerate(labels):
        if label in labels[:i]:
            first = labels.index(label)
            fix = "set `name` on one of them" if i < configured else \
                "set `name` on the reward, or rename a class"
            raise ConfigError(
                f"{place(i)}: objective {label!r} has the name of {place(first)}; each "
                "objective needs its own (metrics, the completions log and a judge's budget are "
                f"kept by name): {fix}")


def judges(tasks: list[Task]) -> dict[str, JudgeReward]:
    """Every judge reward of the run, keyed `task/label`."""
    return {f"{t.name}/{label}": fn for t in tasks for label, fn, _ in t.reward_fns
            if isinstance(fn, JudgeReward)}


def load_tasks(config: RunConfig, rank: int = 0, world_size: int = 1) -> list[Task]:
    """Read every task's data and resolve its reward functions (no model needed); this is
    process `rank` of `world_size` (each keeps its share of a judge's budget)."""
    tasks, problems = [], []
    for name, tc in config.tasks.items():
        try:  # every data file's problems, not only the first file's
            train, held_out, stream = _split(name, tc, config.seed)
        except DataError as err:
            problems.append(str(err))
            continue
        fns = [_named(name, i, r, config) for i, r in enumerate(tc.rewards)]
        columns = list(dict.fromkeys(k for ex in [*train, *held_out] for k in ex.columns))
        agent = Agent.from_config(name, tc)
        if agent is not None and agent.environments:
            columns.append("environments")  # each rollout's environment, as TRL passes it
        # a rollout_func may return any field its rewards take (TRL's extra_fields)
        fields_open = agent is not None and agent.rollout_func is not None
        for i, (label, fn, kwargs) in enumerate(fns):
            check_reward_call(label, fn, kwargs, columns, where=f"tasks.{name}.rewards.{i}",
                              fields_open=fields_open)
            if isinstance(fn, JudgeReward) and fn.fallback is not None:
                # called with the judge's arguments, first when the judge fails mid-run
                check_reward_call(*fn.fallback, columns,
                                  where=f"tasks.{name}.rewards.{i}.kwargs.fallback",
                                  fields_open=fields_open)
        schedules = [from_config(r.weight, where=f"tasks.{name}.rewards.{i}.weight")
                     for i, r in enumerate(tc.rewards)]
        for label, fn in agent.rewards() if agent is not None else []:
            fns.append((label, fn, {}))  # an environment's get_reward(): weight 1, as in TRL
            schedules.append(from_config(1.0, where=f"tasks.{name}.environment"))
        _check_labels(name, [label for label, _, _ in fns], len(tc.rewards))
        for _, fn, _ in fns if world_size > 1 else []:
            if isinstance(fn, JudgeReward):  # each process judges its own completions
                fn.budget.share(rank, world_size)
        tasks.append(Task(name, tc, train, held_out, fns, schedules, stream, agent))
        log.debug("task %s: %s train / %d eval prompts, rewards %s", name,
                  "streamed" if stream else len(train), len(held_out),
                  ", ".join(label for label, _, _ in fns))
    if problems:
        raise DataError("\n".join(problems))
    return tasks


class TaskMixer:
    """Draws each step's prompts: task slots by smooth weighted round-robin, prompts by
    reshuffled passes over each task's data."""

    def __init__(self, tasks: list[Task], seed: int) -> None:
        self.tasks = tasks
        self.seed = seed
        self.weights = [t.config.weight for t in tasks]  # a curriculum stage may change them
        self.credit = [0.0] * len(tasks)  # smooth WRR credit per task
        self.epoch = [0] * len(tasks)
        self.position = [0] * len(tasks)
        self._orders = [self._order(i) for i in range(len(tasks))]
        self._streams: dict[int, Iterator[Example]] = {}  # open streamed tasks

    def _order(self, t: int) -> list[int]:
        order = list(range(len(self.tasks[t].train)))
        random.Random(f"{self.seed}/{self.tasks[t].name}/{self.epoch[t]}").shuffle(order)
        return order

    def _next_task(self) -> int:
        # Smooth weighted round-robin (as in nginx): every slot adds each task's weight to its
        # credit and picks the largest, so shares hold exactly over any window of slots.
        weights = self.weights
        for i, w in enumerate(weights):
            self.credit[i] += w
        drawn = [i for i, w in enumerate(weights) if w > 0]  # weight 0: not drawn
        best = max(drawn, key=lambda i: self.credit[i])
        self.credit[best] -= sum(weights)
        return best

    def set_weights(self, weights: list[float]) -> None:
        """New task shares (a curriculum stage); the round-robin starts afresh."""
        if weights != self.weights:
            self.weights = list(weights)
            self.credit = [0.0] * len(self.tasks)

    def _next_streamed(self, t: int) -> Example:
        task = self.tasks[t]
        if t not in self._streams:  # (re)opened where the saved position says
            self._streams[t] = itertools.islice(task.stream(self.epoch[t]), self.position[t], None)
        example = next(self._streams[t], None)
        if example is None:  # the pass is over: the next one, in a new order
            if self.position[t] == 0:
                raise DataError(f"task {task.name}: its streamed data has no usable rows")
            self.epoch[t] += 1
            self.position[t] = 0
            self._streams[t] = iter(task.stream(self.epoch[t]))
            example = next(self._streams[t], None)
            if example is None:
                raise DataError(f"task {task.name}: its streamed data has no usable rows")
        self.position[t] += 1
        return example

    def _next_example(self, t: int) -> Example:
        if self.tasks[t].stream is not None:
            return self._next_streamed(t)
        if self.position[t] >= len(self._orders[t]):
            self.epoch[t] += 1
            self.position[t] = 0
            self._orders[t] = self._order(t)
        example = self.tasks[t].train[self._orders[t][self.position[t]]]
        self.position[t] += 1
        return example

    def epoch_of(self, t: int) -> float:
        """Passes over task t's prompts so far, fractional (TRL's `trainer_state.epoch`); whole
        passes only for streamed data, whose length is unknown."""
        if self.tasks[t].stream is not None:
            return float(self.epoch[t])
        return self.epoch[t] + self.position[t] / max(len(self.tasks[t].train), 1)

    def next_batch(self, n: int) -> list[tuple[int, Example]]:
        """`n` (task index, example) pairs, grouped by task in task order."""
        picks = [self._next_task() for _ in range(n)]
        return [(t, self._next_example(t)) for t in sorted(picks)]

    def state_dict(self) -> dict[str, Any]:
        return {"credit": list(self.credit), "epoch": list(self.epoch),
                "position": list(self.position), "weights": list(self.weights)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.credit = list(state["credit"])
        self.epoch = list(state["epoch"])
        self.position = list(state["position"])
        self.weights = list(state.get("weights", self.weights))
        self._orders = [self._order(i) for i in range(len(self.tasks))]
        self._streams = {}
