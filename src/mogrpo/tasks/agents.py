"""A task's tools and environments, as TRL's GRPOTrainer takes them (`tools`,
`environment_factory`), resolved once and instantiated for each rollout.

An environment is a class: one instance per rollout row, so episodes share no state; its
`reset(**row)` may return text that is added to the row's last user message; its public
methods are the episode's tools (besides the task's own); a `get_reward()` is an extra
objective of the task, named after the class, weight 1. Instances live for one rollout: a
resumed run builds them afresh, as the uninterrupted run did at that step.
"""

from __future__ import annotations

import inspect
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mogrpo.config import TaskConfig
from mogrpo.data.schema import Example
from mogrpo.errors import ConfigError, DataError, RewardError
from mogrpo.rewards.base import load_spec
from mogrpo.rollout.tools import tool_schema
from mogrpo.user_loop import await_all

_RESERVED = ("reset", "get_reward")


def _resolve(spec: Any, what: str, where: str) -> Any:
    obj = load_spec(spec, what) if isinstance(spec, str) else spec
    if what in ("tool", "rollout_func") and not callable(obj):
        raise ConfigError(f"{where}: {spec!r} is a {type(obj).__name__}, not a function")
    if what == "environment" and not inspect.isclass(obj):
        raise ConfigError(f"{where}: {spec!r} is a {type(obj).__name__}, not a class; give "
                          "the environment's class (one instance is made per rollout)")
    return obj


def _raised_at(err: BaseException) -> str:
    """Where in the user's code `err` was raised (the frames past the call made here)."""
    frames = traceback.extract_tb(err.__traceback__)[1:]
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def _instance(env_cls: type, where: str) -> Any:
    """An instance of an environment class, made as TRL's `environment_factory` is called."""
    try:
        return env_cls()
    except Exception as err:
        raise ConfigError(
            f"{where}: {env_cls.__name__}() raised {type(err).__name__}: {err}{_raised_at(err)}; an "
            "environment class is made with no arguments, one instance per rollout (TRL's "
            "environment_factory): give its parameters defaults, or read them from the row in "
            "reset(**row)") from err


def environment_methods(cls: type) -> list[str]:
    """The tools of an environment class: its public functions but `reset` and `get_reward`
    (read on the class, so properties are not evaluated), as TRL lists them."""
    return [name for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
            if name not in _RESERVED and not name.startswith("_")]


@dataclass
class EnvironmentReward:
    """`get_reward()` of each rollout's environment of exactly this class (None for the rows
    of another environment: not scored), called as a reward function with `environments`."""

    cls: type
    __name__: str = ""

    def __post_init__(self) -> None:
        self.__name__ = self.cls.__name__

    def __call__(self, prompts: list, completions: list, **kwargs: Any) -> list[float | None]:
        envs = kwargs.get("environments") or [None] * len(completions)
        values = [env.get_reward() if type(env) is self.cls else None for env in envs]
        # async ones together, on the loop async tools ran on (`mogrpo.user_loop`)
        waiting = [i for i, value in enumerate(values) if inspect.isawaitable(value)]
        if waiting:
            for i, value in zip(waiting, await_all([values[i] for i in waiting]),
                                strict=True):
                values[i] = value
        return values


@dataclass
class Agent:
    """A task's tools (name -> function) and environment classes (key -> class; key None for
    a single environment), checked and with their schemas."""

    task: str
    tools: dict[str, Callable[..., Any]] = field(default_factory=dict)
    environments: dict[str | None, type] = field(default_factory=dict)
    rollout_func: Callable[..., Any] | None = None
    """TRL's `rollout_func(prompts, trainer)`: the task's rollouts sampled by the user's code."""
    _probes: dict[type, Any] = field(default_factory=dict)
    """One instance of each environment class, made at start (as TRL does) for its tools'
    schemas: their methods are bound, so `self` is not an argument."""

    @classmethod
    def from_config(cls, task: str, tc: TaskConfig) -> Agent | None:
        """The task's agent, or None for a single-turn task; every spec resolved and every
        tool's schema built, so a bad one fails before a model loads."""
        if not tc.has_tools and tc.rollout_func is None:
            return None
        agent = cls(task)
        if tc.rollout_func is not None:
            agent.rollout_func = _resolve(tc.rollout_func, "rollout_func",
                                          f"tasks.{task}.rollout_func")
        for i, spec in enumerate(tc.tools):
            where = f"tasks.{task}.tools.{i}"
            fn = _resolve(spec, "tool", where)
            tool_schema(fn, where)
            agent.tools[fn.__name__] = fn
        env = tc.environment
        specs = env if isinstance(env, dict) else {} if env is None else {None: env}
        for key, spec in specs.items():
            where = f"tasks.{task}.environment" + (f".{key}" if key is not None else "")
            env_cls = _resolve(spec, "environment", where)
            if not callable(getattr(env_cls, "reset", None)):
                raise ConfigError(f"{where}: {env_cls.__name__} has no `reset` method; an "
                                  "environment must define reset(self, **kwargs)")
            probe = agent._probes.setdefault(env_cls, _instance(env_cls, where))
            for name in environment_methods(env_cls):
                tool_schema(getattr(probe, name), f"{where} ({env_cls.__name__}.{name})")
            agent.environments[key] = env_cls
        return agent

    def tool_names(self) -> list[str]:
        """Every tool an episode of the task may call: its own, its environments' methods."""
        names = list(self.tools)
        for env_cls in self.environments.values():
            names += [n for n in environment_methods(env_cls) if n not in names]
        return names

    def rewards(self) -> list[tuple[str, EnvironmentReward]]:
        """(label, reward) for each environment class with a `get_reward`, once per class."""
        classes = list(dict.fromkeys(self.environments.values()))
        return [(c.__name__, EnvironmentReward(c)) for c in classes
                if callable(getattr(c, "get_reward", None))]

    def environment_of(self, example: Example) -> type | None:
        if not self.environments:
            return None
        if None in self.environments:
            return self.environments[None]
        key = example.columns.get("environment")
        if key not in self.environments:
            raise DataError(f"task {self.task}: row {example.source} has environment={key!r}, "
                            f"not one of {sorted(map(str, self.environments))}; set its "
                            "`environment` column to one of them")
        return self.environments[key]

    def schemas(self, env_cls: type | None) -> list[dict[str, Any]]:
        """The tools a row's prompt lists: the task's, then its environment's methods."""
        schemas = [tool_schema(fn) for fn in self.tools.values()]
        if env_cls is not None:
            probe = self._probes[env_cls]
            schemas += [tool_schema(getattr(probe, n)) for n in environment_methods(env_cls)]
        return schemas


@dataclass
class Rollouts:
    """One step's episodes of one task's rows: each row's environment (or None), its tools
    (bound to that environment), and the text its reset added to the prompt."""

    environments: list[Any]
    tools: list[dict[str, Callable[..., Any]]]
    observations: list[str | None]


def start_episodes(agent: Agent, examples: list[Example]) -> Rollouts:
    """A fresh environment per row (rows are completions: each prompt's K rows get K
    instances), reset with the row's columns (TRL: the whole row; `environment` kept out when
    it selects the class), and each row's tools."""
    envs, tools, observations = [], [], []
    for example in examples:
        env_cls = agent.environment_of(example)
        env = _instance(env_cls, f"task {agent.task}") if env_cls is not None else None
        row_tools = dict(agent.tools)
        observation = None
        if env is not None:
            row = {"prompt": example.prompt, **example.columns}
            if None not in agent.environments:
                row.pop("environment", None)
            try:
                observation = env.reset(**row)
            except Exception as err:  # the user's code: say whose, and on which row
                raise RewardError(
                    f"task {agent.task}: {env_cls.__name__}.reset() raised {type(err).__name__}: "
                    f"{err} on row {example.source}{_raised_at(err)}") from err
            row_tools.update({n: getattr(env, n) for n in environment_methods(type(env))})
        envs.append(env)
        tools.append(row_tools)
        observations.append(observation if isinstance(observation, str) else None)
    return Rollouts(envs, tools, observations)


def with_observation(prompt: str | list[dict[str, str]], observation: str | None
                     ) -> str | list[dict[str, str]]:
    """The prompt with a reset's text added to its last user message (a copy)."""
    if not observation:
        return prompt
    if isinstance(prompt, str):
        return prompt + observation
    messages = [dict(m) for m in prompt]
    last = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
    if last is None:
        return [*messages, {"role": "user", "content": observation}]
    messages[last]["content"] = messages[last]["content"] + observation
    return messages
