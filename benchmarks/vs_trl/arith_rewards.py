"""The benchmark's reward functions, written once in TRL's contract and used by both tools.

TRL's GRPOTrainer imports this module; mogrpo loads it by path (`arith_rewards.py:correct`).
When the environment variable `VS_TRL_REWARD_LOG` names a file, every call appends one JSON
line (function, prompts, scores), so the runner reads both tools' prompts and reward curves
from the same place, written by the same code.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

NUMBER = re.compile(r"-?\d+")
LOG_ENV = "VS_TRL_REWARD_LOG"
WEIGHTS = {"correct": 1.0, "starts_with_number": 0.2}
"""Weight of each function in the combined reward (the same in TRL and mogrpo)."""


def _first_number(text: str) -> int | None:
    match = NUMBER.search(text)
    return int(match.group()) if match else None


def _log(name: str, prompts: list[Any], scores: list[float]) -> None:
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"fn": name, "prompts": prompts, "scores": scores}) + "\n")


def correct(prompts: list[Any], completions: list[Any], answer: list[Any],
            **kwargs: Any) -> list[float]:
    """1.0 when the first number in the completion is the sum, else 0.0."""
    scores = [1.0 if _first_number(str(c)) == int(a) else 0.0
              for c, a in zip(completions, answer, strict=True)]
    _log("correct", prompts, scores)
    return scores


def starts_with_number(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    """Format: 1.0 when the completion opens with a number (the answer comes first), else 0.0."""
    scores = [1.0 if re.match(r"\s*-?\d", str(c)) else 0.0 for c in completions]
    _log("starts_with_number", prompts, scores)
    return scores
