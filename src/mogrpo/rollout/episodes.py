"""Multi-turn rollouts: the policy calls tools, reads their results and goes on.

An episode is ONE completion sequence after its prompt: every model turn, and between two
turns the tool results and the template text the chat template puts around them. So the log-prob
passes score the whole interleaved sequence in one forward, as it was sampled (the inserted
tokens are context), and only the policy's own tokens — each turn up to and including its stop
token — train: `Rollout.generated_mask` is 1 on them and 0 on the inserted tokens, and the
loss, the KL and the length normalisers count that mask (`Rollout.train_mask`).

A turn with no tool call ends the episode; so do `max_iterations` rounds of tool calls and the
token budget (`settings.max_new_tokens` counts every token of the episode, generated or
inserted: the results that would not fit are not inserted and the episode ends there, as TRL
does).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from mogrpo.errors import ConfigError
from mogrpo.rollout.generate import (
    ExternalEngine,
    Rollout,
    decode_rows,
    generate_rollout,
    resolve_stop_ids,
)
from mogrpo.rollout.sampling import SamplingSettings
from mogrpo.rollout.tools import ToolCall, ToolFormat, ToolResult, parse_tool_calls, run_tool_calls

Tools = dict[str, Callable[..., Any]]


@dataclass
class ToolLoop:
    """How an episode runs its tools: each row's tools (name -> function), the call format,
    the rounds of calls allowed (None: until the budget), each call's timeout, and whether a
    round's sync calls run at once (`parallel`) or one at a time (`run_tool_calls`)."""

    tools: list[Tools]
    format: ToolFormat = "auto"
    max_iterations: int | None = None
    timeout_s: float = 10.0
    parallel: bool = True


@dataclass
class Episode:
    """One row's episode as it grows: its tokens after the prompt, which of them the policy
    sampled, their sampling-time log-probs, and what happened."""

    ids: list[int]
    generated: list[int]
    logp: list[float]
    truncated: bool
    turns: int = 1
    calls: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)
    timeouts: Counter = field(default_factory=Counter)
    environment: Any = None
    """The row's environment instance (a task's `environment`), for its reward."""
    observation: str | None = None
    """The text its environment's `reset` added to the row's prompt (None: nothing)."""

    @property
    def inserted(self) -> int:
        return len(self.ids) - sum(self.generated)


def insertion_text(tokenizer: PreTrainedTokenizerBase, calls: list[ToolCall],
                   results: list[ToolResult], stop_text: str) -> str:
    """The text the chat template puts after an assistant turn that made `calls`: the tool
    messages and the next generation prompt. Found as the difference of two renderings, one
    ending with the assistant's turn and one going on past the results; the model's turn ended
    at its stop token, so what the template writes after that token (a newline, say) is
    inserted too."""
    turn = [{"role": "user", "content": "x"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": c.name or "unknown",
                                                  "arguments": c.arguments}} for c in calls]}]
    tool_messages = [{"role": "tool", "name": r.name, "content": r.content} for r in results]
    try:
        before = tokenizer.apply_chat_template(turn, tokenize=False)
        after = tokenizer.apply_chat_template(turn + tool_messages, tokenize=False,
                                              add_generation_prompt=True)
    except Exception as err:  # jinja's TemplateError: the template has no tool role
        raise ConfigError(
            f"the chat template cannot render tool results ({err}); set model.chat_template to "
            "a template with tool calling (Qwen2.5's, Llama 3.1's; for tiny models "
            "mogrpo.modeling.tiny.TOOL_CHAT_TEMPLATE)") from err
    if not after.startswith(before):
        raise ConfigError("the chat template renders an assistant turn differently once tool "
                          "results follow it; mogrpo cannot tell what to insert between turns")
    tail = before[before.rfind(stop_text) + len(stop_text):] if stop_text and \
        stop_text in before else ""
    return tail + after[len(before):]


def _turn_text(tokenizer: PreTrainedTokenizerBase, ids: list[int], stop_ids: list[int]) -> str:
    """A turn's text with its special tokens (tool-call tags may be special), less its stop."""
    if ids and ids[-1] in stop_ids:
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=False)


def _first_turns(first: Rollout, record: bool) -> list[Episode]:
    lengths = first.lengths.tolist()
    return [Episode(ids=first.completion_ids[b, :n].tolist(), generated=[1] * n,
                    logp=(first.sampler_logp[b, :n].tolist() if record and
                          first.sampler_logp is not None else [0.0] * n),
                    truncated=bool(first.truncated[b]))
            for b, n in enumerate(lengths)]


def _run_calls(tokenizer: PreTrainedTokenizerBase, episodes: list[Episode], rows: list[int],
               loop: ToolLoop, stop_ids: list[int], budget: int) -> list[int]:
    """Parse the last turn of each row, run every call of the batch at once and insert their
    results; the rows that go on (made calls whose results fit in the budget)."""
    parsed: dict[int, list[ToolCall]] = {}
    for b in rows:
        turn = episodes[b].ids[-_last_turn_length(episodes[b]):]
        calls = parse_tool_calls(_turn_text(tokenizer, turn, stop_ids), loop.format)
        if calls:
            parsed[b] = calls
    flat = [(loop.tools[b], call) for b, calls in parsed.items() for call in calls]
    results = iter(run_tool_calls(flat, loop.timeout_s, loop.parallel))
    going_on = []
    for b, calls in parsed.items():
        ep, mine = episodes[b], [next(results) for _ in calls]
        for call, result in zip(calls, mine, strict=True):
            ep.calls[call.name or "unknown"] += 1
            ep.errors[call.name or "unknown"] += result.error and not result.timed_out
            ep.timeouts[call.name or "unknown"] += result.timed_out
        stop_text = tokenizer.decode(ep.ids[-1:]) if ep.ids and ep.ids[-1] in stop_ids else ""
        text = insertion_text(tokenizer, calls, mine, stop_text)
        inserted = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ep.ids) + len(inserted) >= budget:  # no room for the results and a turn
            continue
        ep.ids += inserted
        ep.generated += [0] * len(inserted)
        ep.logp += [0.0] * len(inserted)
        going_on.append(b)
    return going_on


def _last_turn_length(ep: Episode) -> int:
    """Tokens of the episode's last model turn (the trailing run of sampled tokens)."""
    n = 0
    for g in reversed(ep.generated):
        if not g:
            break
        n += 1
    return n


def _next_turns(model: nn.Module, prompts: list[list[int]], episodes: list[Episode],
                rows: list[int], settings: SamplingSettings, engine: str | ExternalEngine, *,
                stop_ids: list[int], pad_id: int, budget: int, record: bool,
                generation_batch_size: int | None, plain_max_bytes: int | None) -> None:
    """Sample the next turn of `rows`, each continuing its prompt and episode so far, within
    what is left of its budget."""
    sequences = [prompts[b] + episodes[b].ids for b in rows]
    width = max(len(s) for s in sequences)
    device = next(model.parameters()).device
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, seq in enumerate(sequences):
        ids[i, width - len(seq):] = torch.tensor(seq)
        mask[i, width - len(seq):] = 1
    room = [budget - len(episodes[b].ids) for b in rows]
    out = decode_rows(model, ids.to(device), mask.to(device),
                      replace(settings, max_new_tokens=max(room)), engine, stop_ids=stop_ids,
                      pad_id=pad_id, generation_batch_size=generation_batch_size,
                      record_logprobs=record, plain_max_bytes=plain_max_bytes)
    tokens = out.tokens.tolist()
    for i, b in enumerate(rows):
        turn = tokens[i][:room[i]]
        stop = next((j for j, t in enumerate(turn) if t in stop_ids), None)
        turn = turn[:stop + 1] if stop is not None else turn
        ep = episodes[b]
        ep.ids += turn
        ep.generated += [1] * len(turn)
        ep.logp += out.logp[i, :len(turn)].tolist() if out.logp is not None \
            else [0.0] * len(turn)
        ep.truncated = stop is None
        ep.turns += 1


def _as_rollout(first: Rollout, episodes: list[Episode], texts: list[str], pad_id: int,
                num_generations: int, record: bool) -> Rollout:
    """The episodes as one right-padded completion each, after the first turn's prompts."""
    B, C = len(episodes), max(max(len(ep.ids) for ep in episodes), 1)
    ids = torch.full((B, C), pad_id, dtype=torch.long)
    generated = torch.zeros((B, C), dtype=torch.long)
    logp = torch.zeros((B, C))
    for b, ep in enumerate(episodes):
        n = len(ep.ids)
        ids[b, :n] = torch.tensor(ep.ids, dtype=torch.long)
        generated[b, :n] = torch.tensor(ep.generated, dtype=torch.long)
        logp[b, :n] = torch.tensor(ep.logp)
    lengths = torch.tensor([len(ep.ids) for ep in episodes])
    device = first.prompt_ids.device
    return Rollout(
        prompt_ids=first.prompt_ids, prompt_mask=first.prompt_mask,
        completion_ids=ids.to(device),
        completion_mask=(torch.arange(C)[None] < lengths[:, None]).long().to(device),
        lengths=lengths.to(device),
        truncated=torch.tensor([ep.truncated for ep in episodes], device=device),
        texts=texts, num_generations=num_generations,
        prompt_truncated=first.prompt_truncated, nonfinite_logits=first.nonfinite_logits,
        sampler_logp=(logp * generated).to(device) if record else None,
        generated_mask=generated.to(device), episodes=episodes,
    )


def generate_episodes(
    model: nn.Module, tokenizer: PreTrainedTokenizerBase, row_texts: list[str],
    settings: SamplingSettings, loop: ToolLoop, *, num_generations: int,
    max_prompt_length: int, add_special_tokens: bool = True,
    engine: str | ExternalEngine = "auto", generation_batch_size: int | None = None,
    record_logprobs: bool = False, plain_max_bytes: int | None = None,
) -> Rollout:
    """One episode per row of `row_texts` (each prompt already repeated K times, row
    `i * K + k`: an environment's reset may give each row its own text), calling `loop.tools`
    between turns. Returns the rollout, `generated_mask` and `episodes` (what each row's
    episode did) set."""
    if len(loop.tools) != len(row_texts):
        raise ValueError(f"{len(loop.tools)} tool sets for {len(row_texts)} rows")
    if loop.max_iterations is not None and loop.max_iterations < 0:
        raise ConfigError(f"max_tool_calling_iterations = {loop.max_iterations} must be >= 0")
    first = generate_rollout(model, tokenizer, row_texts, settings, num_generations=1,
                             max_prompt_length=max_prompt_length,
                             add_special_tokens=add_special_tokens, engine=engine,
                             generation_batch_size=generation_batch_size,
                             record_logprobs=record_logprobs, plain_max_bytes=plain_max_bytes)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None \
        else tokenizer.eos_token_id
    stop_ids = resolve_stop_ids(model, tokenizer, settings)
    budget = settings.max_new_tokens
    prompts = [ids[mask.bool()].tolist() for ids, mask in zip(first.prompt_ids.cpu(),
                                                               first.prompt_mask.cpu(), strict=True)]
    episodes = _first_turns(first, record_logprobs)
    rows = [b for b, ep in enumerate(episodes) if not ep.truncated]
    rounds = 0
    while rows and (loop.max_iterations is None or rounds < loop.max_iterations):
        rows = _run_calls(tokenizer, episodes, rows, loop, stop_ids, budget)
        if not rows:
            break
        _next_turns(model, prompts, episodes, rows, settings, engine, stop_ids=stop_ids,
                    pad_id=pad_id, budget=budget, record=record_logprobs,
                    generation_batch_size=generation_batch_size, plain_max_bytes=plain_max_bytes)
        rows = [b for b in rows if not episodes[b].truncated]
        rounds += 1
    texts = [tokenizer.decode(ep.ids, skip_special_tokens=True).strip() for ep in episodes]
    return _as_rollout(first, episodes, texts, pad_id, num_generations, record_logprobs)
