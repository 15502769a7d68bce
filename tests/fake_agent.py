"""An agent task for the tests that need episodes with tool calls in them: a TRL-shaped
environment, a tool, and a `FakeLLM` script under which the policy calls them.

A tiny random model never writes a well-formed tool call, so the calls come from the fake vLLM
(`fake_vllm.FakeLLM`): its first turn is a `<tool_call>` block (mogrpo's tiny tool template,
Hermes form), its turn after a tool result is plain tokens. Which tool and what argument are
drawn from torch's global generator, as a sampler's tokens are, so a resumed run repeats them
only if it restored the generator's state.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


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
        return None

    def increment(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: How much to add.
        """
        self.count += step
        return self.count

    def get_reward(self) -> float:
        return float(self.count)


def tool_calling_script(tokenizer: Any):
    """A `FakeLLM` script: a call to `increment` or `calculator` (drawn) when the prompt holds
    no tool result yet, else a few plain tokens; each turn ends with the stop id."""
    eos = tokenizer.eos_token_id

    def script(prompt_index: int, k: int, prompt: list[int], params: Any) -> list[int]:
        if "<tool_response>" in tokenizer.decode(prompt):
            return torch.randint(10, 60, (3,)).tolist() + [eos]
        step, pick = (int(x) for x in torch.randint(1, 5, (2,)))
        call = {"name": "increment", "arguments": {"step": step}} if pick % 2 else \
            {"name": "calculator", "arguments": {"expression": f"{step} * 7"}}
        text = "<tool_call>" + json.dumps(call) + "</tool_call>"
        return tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]

    return script


def digits(prompts: list, completions: list, **kwargs: Any) -> list[float]:
    """A reward that differs between episodes (their tool results differ), so advantages are
    not zero."""
    return [float(sum(ch.isdigit() for ch in str(c))) for c in completions]


class AsyncCounter(Counter):
    """The same environment with an async `get_reward` (TRL allows both)."""

    async def get_reward(self) -> float:
        return float(self.count)


def use_fake_vllm(monkeypatch: Any, model: Path) -> None:
    """`rollout.engine: vllm` runs on a `FakeLLM` with `tool_calling_script` in this test."""
    from transformers import AutoTokenizer

    from fake_vllm import FakeLLM, FakeSamplingParams
    from mogrpo.config import engines
    from mogrpo.rollout import vllm_engine

    script = tool_calling_script(AutoTokenizer.from_pretrained(model))
    monkeypatch.setattr(engines, "vllm_unavailable_reason", lambda: None)
    monkeypatch.setattr(vllm_engine, "import_vllm", lambda: (
        lambda **kwargs: FakeLLM(script=script, **kwargs), FakeSamplingParams))
