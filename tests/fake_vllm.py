"""A stand-in for `vllm.LLM` and `vllm.SamplingParams` on CPU, for the vLLM engine's tests.

It has the methods of vLLM's `LLM` that mogrpo calls, with their signatures (`generate`,
`sleep(level)`, `wake_up(tags)`, `apply_model(func)`, `reset_prefix_cache()`), returns objects
shaped like vLLM's `RequestOutput` / `CompletionOutput` / `Logprob`, keeps the rules vLLM keeps
(a request stops after its first stop id or at `max_tokens`; nothing runs while asleep; the
completions of a request may come back in any order), and logs every call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


class FakeSamplingParams:
    """Keeps the keyword arguments it was built with, like vLLM's msgspec struct."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        for name, value in kwargs.items():
            setattr(self, name, value)


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str
    text: str = ""
    cumulative_logprob: float | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    prompt: str | None = None


@dataclass
class FakeModel:
    """vLLM's model inside the worker: `load_weights` gets checkpoint-named tensors."""

    loads: list[dict[str, torch.Tensor]] = field(default_factory=list)

    def load_weights(self, weights) -> set[str]:
        got = {name: tensor.detach().clone() for name, tensor in weights}
        self.loads.append(got)
        return set(got)


def default_script(prompt_index: int, k: int, prompt: list[int], params: Any) -> list[int]:
    """Tokens a completion would draw if nothing stopped it (seeded when the request is)."""
    seed = (params.seed if params.seed is not None else 1000 * prompt_index) + k
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 60, (params.max_tokens + 5,), generator=g).tolist()


def default_logprob(prompt_index: int, k: int, position: int) -> float:
    return -0.25 - 0.5 * k - 0.01 * position - prompt_index


class FakeLLM:
    """Generates `script(i, k, prompt, params)` for completion k of prompt i, cut like vLLM."""

    def __init__(self, script: Callable[..., list[int]] = default_script,
                 logprob: Callable[[int, int, int], float] = default_logprob,
                 **engine_kwargs: Any) -> None:
        self.engine_kwargs = engine_kwargs  # what `LLM(...)` was built with
        self.script = script
        self.logprob = logprob
        self.model = FakeModel()
        self.calls: list[tuple] = []
        self.asleep: set[str] = set()
        self.requests: list[tuple[list[dict], Any]] = []

    def generate(self, prompts, sampling_params=None, *, use_tqdm=True, lora_request=None):
        assert not self.asleep, f"generate() while {sorted(self.asleep)} asleep"
        self.calls.append(("generate", len(prompts)))
        self.requests.append((prompts, sampling_params))
        results = []
        for i, prompt in enumerate(prompts):
            params = sampling_params[i] if isinstance(sampling_params, list) else sampling_params
            completions = []
            for k in range(params.n):
                tokens: list[int] = []
                for token in self.script(i, k, prompt["prompt_token_ids"], params):
                    tokens.append(token)
                    if token in params.stop_token_ids or len(tokens) == params.max_tokens:
                        break
                stopped = tokens[-1] in params.stop_token_ids
                logprobs = None if params.logprobs is None else [
                    {t: Logprob(self.logprob(i, k, j), rank=1)} for j, t in enumerate(tokens)]
                completions.append(CompletionOutput(
                    index=k, token_ids=tokens, logprobs=logprobs,
                    finish_reason="stop" if stopped else "length",
                    stop_reason=tokens[-1] if stopped else None))
            completions.reverse()  # vLLM's aggregation does not promise index order
            results.append(RequestOutput(str(i), list(prompt["prompt_token_ids"]), completions))
        return results

    def sleep(self, level: int = 1) -> None:
        self.calls.append(("sleep", level))
        self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(("wake_up", tuple(tags) if tags else None))
        self.asleep -= set(tags or ("weights", "kv_cache"))

    def apply_model(self, func):
        assert "weights" not in self.asleep, "weights written while asleep"
        self.calls.append(("apply_model",))
        return [func(self.model)]

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        self.calls.append(("reset_prefix_cache",))
        return True
