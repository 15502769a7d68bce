"""Agent tasks in a training step: tools and a TRL-shaped environment resolved from the config,
episodes sampled by the native and hf engines, the environment's reward an objective, the
agent metrics written, and only the policy's own tokens in the loss."""

from __future__ import annotations

import json

import pytest

from mogrpo.errors import ConfigError, MogrpoError
from mogrpo.rewards.base import load_spec


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression, e.g. "12 * 7".
    """
    return str(eval(expression, {"__builtins__": {}}))  # noqa: S307 - a test's tool


class Counter:
    """A TRL-documentation-shaped environment: reset, tools as methods, get_reward."""

    def __init__(self):
        self.count = 0

    def reset(self, **kwargs) -> str | None:
        self.count = 0
        return f" (start at {kwargs['start']})"

    def increment(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: How much to add.
        """
        self.count += step
        return self.count

    def get_reward(self) -> float:
        return float(self.count)


def some_reward(prompts, completions, **kwargs) -> list[float]:
    return [float(len(c) % 3) for c in completions]


PROMPTS_SEEN: list = []


def prompt_seen(prompts, completions, start, **kwargs) -> list[float]:
    PROMPTS_SEEN.extend(zip(prompts, start, strict=True))
    return [0.0] * len(completions)


def _config(tmp_path, tiny_model_dir, engine: str, **task):
    from mogrpo.config import load_config

    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} + {i + 1}?", "start": i}) + "\n"
                            for i in range(8)))
    base = {"model": {"name_or_path": str(tiny_model_dir), "chat_template": "tiny_tools"},
            "output": {"dir": str(tmp_path / "run")},
            "rollout": {"num_generations": 2, "max_completion_length": 12, "engine": engine},
            "train": {"max_steps": 1, "micro_batch_size": 4, "gradient_accumulation_steps": 1},
            "sft": {"enabled": False},
            "tasks": {"calc": {"data": str(data), "beta": 0.04,
                               "rewards": [f"{__file__}:some_reward"], **task}}}
    config, _ = load_config(None, [], base=base)
    return config


def _step(config):
    from mogrpo.modeling.reference import make_reference
    from mogrpo.tasks.task import load_tasks
    from mogrpo.trainer.grpo import GRPOTrainer
    from mogrpo.trainer.run import build_context, seed_everything

    seed_everything(0)
    ctx = build_context(config, load_tasks(config))
    trainer = GRPOTrainer(ctx, make_reference(ctx.policy, needed=True))
    seen = {}
    draw = trainer.generate

    def spy(picks):
        seen["rollout"] = rollout = draw(picks)
        return rollout

    trainer.generate = spy
    return ctx, trainer.train_step(), seen["rollout"]


@pytest.mark.parametrize("engine", ["native", "hf"])
def test_a_step_with_tools_and_an_environment(tmp_path, tiny_model_dir, engine):
    config = _config(tmp_path, tiny_model_dir, engine, tools=[f"{__file__}:calculator"],
                     environment=f"{__file__}:Counter", max_tool_calling_iterations=2)
    ctx, metrics, rollout = _step(config)
    task = ctx.tasks[0]
    assert task.reward_labels == ["some_reward", "Counter"]  # get_reward: an objective
    assert rollout.generated_mask is not None and len(rollout.episodes) == 4
    # the reset's text is in each prompt, the tools in the system turn
    prompt = ctx.tokenizer.decode(rollout.prompt_ids[0][rollout.prompt_mask[0].bool()])
    assert "Tools: calculator(expression) increment(step)" in prompt and "(start at" in prompt
    for name in ("turns", "tokens_generated", "tokens_inserted"):
        assert f"task/calc/agent/{name}" in metrics
    for tool in ("calculator", "increment"):
        assert f"task/calc/tool/{tool}/calls" in metrics
    # each rollout got an environment of its own; none was incremented by another's calls
    envs = [e.environment for e in rollout.episodes]
    assert len({id(e) for e in envs}) == 4 and all(type(e).__name__ == "Counter" for e in envs)
    # (loaded from this file by its path: a class of its own module)
    assert metrics["task/calc/reward/Counter/mean"] == pytest.approx(
        sum(e.count for e in envs) / 4)
    assert metrics["task/calc/agent/tokens_generated"] + \
        metrics["task/calc/agent/tokens_inserted"] == pytest.approx(float(rollout.lengths.float().mean()))


def test_rewards_see_the_prompt_with_the_text_its_environment_added(tmp_path, tiny_model_dir):
    # as TRL passes it: a judge of the answer must see what the policy was asked
    config = _config(tmp_path, tiny_model_dir, "hf", environment=f"{__file__}:Counter",
                     max_tool_calling_iterations=1)
    config.tasks["calc"].rewards[0].fn = f"{__file__}:prompt_seen"
    seen = load_spec(f"{__file__}:PROMPTS_SEEN", "list")  # this file as the run loads it
    seen.clear()
    _step(config)
    assert len(seen) == 4
    for prompt, start in seen:
        assert prompt == f"What is {start} + {start + 1}? (start at {start})"


def test_bad_tool_specs_fail_before_a_model_loads(tmp_path, tiny_model_dir):
    from mogrpo.tasks.task import load_tasks

    with pytest.raises(MogrpoError, match="tool .*calculatr.*did you mean 'calculator'"):
        load_tasks(_config(tmp_path, tiny_model_dir, "hf", tools=[f"{__file__}:calculatr"]))
    with pytest.raises(ConfigError, match=r"tasks.calc.environment: .* not a class"):
        load_tasks(_config(tmp_path, tiny_model_dir, "hf", environment=f"{__file__}:calculator"))


@pytest.mark.parametrize("concurrency", ["parallel", "serial"])
def test_tool_concurrency_reaches_the_episodes(tmp_path, tiny_model_dir, monkeypatch, concurrency):
    from mogrpo.tasks import agent_rollout

    loops, make = [], agent_rollout.ToolLoop
    monkeypatch.setattr(agent_rollout, "ToolLoop", lambda *a, **k: (
        loops.append(loop := make(*a, **k)) or loop))
    config = _config(tmp_path, tiny_model_dir, "native", tools=[f"{__file__}:calculator"],
                     tool_timeout_s=3, tool_concurrency=concurrency)
    _step(config)
    assert loops and {(loop.timeout_s, loop.parallel) for loop in loops} == {
        (3, concurrency == "parallel")}
    with pytest.raises(ConfigError, match="tool_concurrency"):
        _config(tmp_path, tiny_model_dir, "native", tools=[f"{__file__}:calculator"],
                tool_concurrency="threads")
