"""An agent task's rollout in a training step: each row's environment made and reset, its
prompt rendered with its tools, its episode sampled (`mogrpo.rollout.episodes`); and what the
episodes did, as the step's metrics."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from mogrpo.data.schema import Example
from mogrpo.modeling.chat import render_prompt
from mogrpo.rollout.episodes import ToolLoop, generate_episodes
from mogrpo.rollout.generate import Rollout
from mogrpo.tasks.agents import start_episodes, with_observation
from mogrpo.tasks.context import TrainContext
from mogrpo.tasks.task import Task
from mogrpo.tracking import names


def agent_rollout(ctx: TrainContext, task: Task, examples: list[Example], *,
                  num_generations: int, record_logprobs: bool,
                  generation_batch_size: int | None = None) -> Rollout:
    """K episodes of each example of `task` (an agent task), row `i * K + k`, each with an
    environment of its own; `generation_batch_size`: rows decoded together (None: all)."""
    agent, tc, rc = task.agent, task.config, ctx.config.rollout
    assert agent is not None
    rows = [ex for ex in examples for _ in range(num_generations)]
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
                    tc.tool_timeout_s)
    rollout = generate_episodes(
        ctx.policy, ctx.tokenizer, texts, ctx.sampling, loop, num_generations=num_generations,
        max_prompt_length=rc.prompt_length, add_special_tokens=add_special, engine=ctx.engine,
        generation_batch_size=generation_batch_size, record_logprobs=record_logprobs,
        plain_max_bytes=ctx.plain_max_bytes)
    for episode, env in zip(rollout.episodes or [], started.environments, strict=True):
        episode.environment = env
    return rollout


def environments_of(rollout: Rollout, rows: list[int]) -> list[Any]:
    """Each row's environment (None without one), for reward functions' `environments`."""
    episodes = rollout.episodes or []
    return [episodes[r].environment if r < len(episodes) and episodes[r] is not None else None
            for r in rows]


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
