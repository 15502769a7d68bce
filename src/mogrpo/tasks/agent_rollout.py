"""An agent task's rollout in a training step: each row's environment made and reset, its
prompt rendered with its tools, its episode sampled (`mogrpo.rollout.episodes`); and what the
episodes did, as the step's metrics."""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import torch

from mogrpo.data.schema import Example
from mogrpo.modeling.chat import render_prompt
from mogrpo.rollout.custom import rollout_from_output
from mogrpo.rollout.episodes import ToolLoop, generate_episodes
from mogrpo.rollout.generate import Rollout, SamplingSettings, resolve_stop_ids
from mogrpo.tasks.agents import start_episodes, with_observation
from mogrpo.tasks.context import TrainContext
from mogrpo.tasks.task import Task
from mogrpo.tracking import names


def agent_rollout(ctx: TrainContext, task: Task, examples: list[Example], *,
                  num_generations: int, record_logprobs: bool,
                  generation_batch_size: int | None = None,
                  sampling: SamplingSettings | None = None) -> Rollout:
    """K episodes of each example of `task` (an agent task), row `i * K + k`, each with an
    environment of its own; `generation_batch_size`: rows decoded together (None: all);
    `sampling`: the settings of the turns (None: the run's; the eval's are greedy)."""
    agent, tc, rc = task.agent, task.config, ctx.config.rollout
    assert agent is not None
    rows = [ex for ex in examples for _ in range(num_generations)]
    if agent.rollout_func is not None:
        return custom_rollout(ctx, task, rows, num_generations=num_generations,
                              record_logprobs=record_logprobs)
    started = start_episodes(agent, rows)
    texts, add_special = [], False
    for ex, env, observation in zip(rows, started.environments, started.observations,
                                    strict=True):
        text, add_special = render_prompt(
            ctx.tokenizer, with_observation(ex.prompt, observation),
            system_prompt=tc.system_prompt, use_chat_template=ctx.config.model.use_chat_template,
            tools=agent.schemas(type(env) if env is not None else None))
        texts.append(text)
    loop = ToolLoop(started.tools, tc.tool_call_format, tc.max_tool_calling_iterations,
                    tc.tool_timeout_s, parallel=tc.tool_concurrency == "parallel")
    rollout = generate_episodes(
        ctx.policy, ctx.tokenizer, texts, sampling or ctx.sampling, loop,
        num_generations=num_generations,
        max_prompt_length=rc.prompt_length, add_special_tokens=add_special, engine=ctx.engine,
        generation_batch_size=generation_batch_size, record_logprobs=record_logprobs,
        plain_max_bytes=ctx.plain_max_bytes)
    for episode, env, observation in zip(rollout.episodes or [], started.environments,
                                         started.observations, strict=True):
        episode.environment, episode.observation = env, observation
    return rollout


@dataclass
class RolloutFuncTrainer:
    """What a `rollout_func` gets as TRL's `trainer`: the attributes TRL-written rollout
    functions read (`processing_class`, `model`, `num_generations`, `args`)."""

    processing_class: Any
    model: Any
    num_generations: int
    args: SimpleNamespace


def custom_rollout(ctx: TrainContext, task: Task, rows: list[Example], *,
                   num_generations: int, record_logprobs: bool) -> Rollout:
    """The rows' rollout sampled by the task's `rollout_func`, called as TRL calls it: each
    prompt K times (row `i * K + k`), a copy, and the trainer."""
    assert task.agent is not None and task.agent.rollout_func is not None
    rc = ctx.config.rollout
    trainer = RolloutFuncTrainer(
        processing_class=ctx.tokenizer, model=ctx.policy, num_generations=num_generations,
        args=SimpleNamespace(max_completion_length=rc.completion_length,
                             max_prompt_length=rc.prompt_length,
                             temperature=ctx.sampling.temperature,
                             num_generations=num_generations))
    output = task.agent.rollout_func(copy.deepcopy([ex.prompt for ex in rows]), trainer)
    return rollout_from_output(
        output, ctx.tokenizer, num_generations=num_generations, rows=len(rows),
        stop_ids=resolve_stop_ids(ctx.policy, ctx.tokenizer, ctx.sampling),
        max_completion_length=rc.completion_length, record_logprobs=record_logprobs,
        device=next(ctx.policy.parameters()).device, where=f"tasks.{task.name}.rollout_func")


def environments_of(rollout: Rollout, rows: list[int]) -> list[Any]:
    """Each row's environment (None without one), for reward functions' `environments`."""
    episodes = rollout.episodes or []
    return [episodes[r].environment if r < len(episodes) and episodes[r] is not None else None
            for r in rows]


def reward_examples(rollout: Rollout, rows: list[int], examples: list[Example]
                    ) -> list[Example]:
    """The examples of `rows` as their reward functions see them: each prompt with the text
    its environment's `reset` added, the prompt the policy answered (TRL passes its rewards
    that prompt too)."""
    episodes = rollout.episodes or []
    seen = []
    for r, example in zip(rows, examples, strict=True):
        episode = episodes[r] if r < len(episodes) else None
        observation = episode.observation if episode is not None else None
        seen.append(replace(example, prompt=with_observation(example.prompt, observation))
                    if observation else example)
    return seen


def reward_extras(task: Task, rollout: Rollout, rows: list[int], examples: list[Example]
                  ) -> dict[str, list] | None:
    """What an agent task's reward functions get besides the data's columns, one value per
    row of `rows` (`examples`: each row's example): `environments`, and the keys its
    `rollout_func` returned (TRL's `extra_fields`, which take the place of a column of the same
    name; a row the function gave no value keeps its column's, else None)."""
    if task.agent is None:
        return None
    extras: dict[str, list] = {}
    if task.agent.environments:
        extras["environments"] = environments_of(rollout, rows)
    fields = [rollout.extra_fields[r] for r in rows] if rollout.extra_fields is not None else []
    for key in dict.fromkeys(k for row in fields for k in row):
        extras[key] = [row[key] if key in row else ex.columns.get(key)
                       for row, ex in zip(fields, examples, strict=True)]
    return extras or None


def agent_metrics(tasks: list[Task], rollout: Rollout, task_ids: torch.Tensor
                  ) -> dict[str, float]:
    """Per agent task: turns, tokens sampled and inserted per episode; per tool its calls per
    episode and the shares of them that failed or timed out."""
    metrics: dict[str, float] = {}
    if rollout.episodes is None:
        return metrics
    ids = task_ids.tolist()
    for t, task in enumerate(tasks):
        episodes = [e for e, i in zip(rollout.episodes, ids, strict=True) if i == t and e]
        if task.agent is None or not episodes:
            continue
        n = len(episodes)
        metrics[names.TASK_TURNS.of(task.name)] = sum(e.turns for e in episodes) / n
        metrics[names.TASK_TOKENS_GENERATED.of(task.name)] = \
            sum(sum(e.generated) for e in episodes) / n
        metrics[names.TASK_TOKENS_INSERTED.of(task.name)] = sum(e.inserted for e in episodes) / n
        calls, errors, timeouts = Counter(), Counter(), Counter()
        for e in episodes:
            calls.update(e.calls)
            errors.update(e.errors)
            timeouts.update(e.timeouts)
        for tool in sorted(set(task.agent.tool_names()) | set(calls)):
            made = calls[tool]
            metrics[names.TOOL_CALLS.of(task.name, tool)] = made / n
            metrics[names.TOOL_ERRORS.of(task.name, tool)] = errors[tool] / made if made else 0.0
            metrics[names.TOOL_TIMEOUTS.of(task.name, tool)] = \
                timeouts[tool] / made if made else 0.0
    return metrics
