"""A rollout written by the user: what TRL's `rollout_func` returns, as a `Rollout`.

TRL 1.16's `GRPOTrainer(rollout_func=...)` calls `rollout_func(prompts, trainer)` with one
prompt per completion (each prompt K times) and takes back a dict of lists, one entry per
prompt: `prompt_ids`, `completion_ids` and `logprobs` (required), `env_mask` (optional: 1 on
the tokens the policy sampled, 0 on those an environment inserted), other keys forwarded to
the reward functions. mogrpo takes the same dict: `env_mask` becomes `generated_mask`, so only
the policy's own tokens train, as in an episode of `mogrpo.rollout.episodes`; every other key
reaches the reward functions by keyword as TRL passes it (`extra_fields`): a list gives row i
its i-th value, anything else is given to every row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from mogrpo.data.schema import RESERVED_COLUMNS
from mogrpo.errors import RewardError
from mogrpo.rollout.generate import Rollout

REQUIRED = ("prompt_ids", "completion_ids", "logprobs")
MASK = "env_mask"
_MISSING = object()


class RolloutFuncError(RewardError):
    """A `rollout_func` returned something mogrpo cannot train on."""


def _check(output: Any, rows: int, where: str) -> None:
    if not isinstance(output, dict):
        raise RolloutFuncError(f"{where} returned a {type(output).__name__}; return a dict "
                               f"with keys {list(REQUIRED)} (and optionally env_mask)")
    missing = [k for k in REQUIRED if k not in output]
    if missing:
        raise RolloutFuncError(f"{where} must return keys {missing} in its output dict")
    for key in (*REQUIRED, "env_mask"):
        value = output.get(key)
        if key == "logprobs" and value is None or key == "env_mask" and value is None:
            continue
        if len(value) != rows:
            raise RolloutFuncError(f"{where}: {key} has {len(value)} entries for {rows} prompts; "
                                   "return one per prompt it was given (each prompt comes K "
                                   "times, once per completion)")
    for b, ids in enumerate(output["completion_ids"]):
        for key in ("logprobs", "env_mask"):
            value = output.get(key)
            if value is not None and value[b] is not None and len(value[b]) != len(ids):
                raise RolloutFuncError(f"{where}: row {b}: {key} has {len(value[b])} entries "
                                       f"for {len(ids)} completion tokens; give one per token")


def extra_fields(output: dict[str, Any], rows: int, where: str) -> list[dict[str, Any]] | None:
    """Per row, the output's other keys with that row's value, as TRL merges its
    `extra_fields` into each row's inputs: a list gives row i its item i (a row past the end of
    the list gets none), any other value goes to every row. None without such keys."""
    keys = [k for k in output if k not in REQUIRED and k != MASK]
    clash = [k for k in keys if k in (*RESERVED_COLUMNS, "environments")]
    if clash:
        raise RolloutFuncError(f"{where} returned key {clash[0]!r}, a name the trainer itself "
                               "passes to every reward function; rename that key")
    if not keys:
        return None
    per_row: list[dict[str, Any]] = [{} for _ in range(rows)]
    for key in keys:
        values = output[key]
        for i, row in enumerate(per_row):
            value = values[i] if isinstance(values, list) and i < len(values) else \
                _MISSING if isinstance(values, list) else values
            if value is not _MISSING:
                row[key] = value
    return per_row


def _rows(values: Sequence[Sequence[float]], width: int, fill: float,
          dtype: torch.dtype, left: bool = False) -> torch.Tensor:
    """[len(values), width] with each row's values, padded with `fill` on the right (left)."""
    out = torch.full((len(values), width), fill, dtype=dtype)
    for b, v in enumerate(values):
        if not v:
            continue
        if left:
            out[b, width - len(v):] = torch.tensor(list(v), dtype=dtype)
        else:
            out[b, :len(v)] = torch.tensor(list(v), dtype=dtype)
    return out


def rollout_from_output(output: Any, tokenizer: PreTrainedTokenizerBase, *,
                        num_generations: int, rows: int, stop_ids: list[int],
                        max_completion_length: int, record_logprobs: bool,
                        device: torch.device, where: str = "rollout_func") -> Rollout:
    """The `Rollout` of a `rollout_func`'s dict. A completion longer than
    `max_completion_length` is cut there; one with no stop id counts as truncated; `logprobs`
    become the sampler's log-probs (where `record_logprobs`), 0 on inserted tokens; the other
    keys are the rollout's `extra_fields`."""
    _check(output, rows, where)
    completions = [list(ids)[:max_completion_length] for ids in output["completion_ids"]]
    n = [len(ids) for ids in completions]
    masks = output.get("env_mask") or [[1] * k for k in n]
    masks = [list(m)[:k] if m is not None else [1] * k for m, k in zip(masks, n, strict=True)]
    logprobs = output["logprobs"] or [None] * rows
    logprobs = [list(lp)[:k] if lp is not None else [0.0] * k
                for lp, k in zip(logprobs, n, strict=True)]
    prompts = [list(ids) for ids in output["prompt_ids"]]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None \
        else tokenizer.eos_token_id
    P, C = max(max(map(len, prompts)), 1), max(max(n), 1)
    prompt_ids = _rows(prompts, P, pad_id, torch.long, left=True)  # [B, P]
    prompt_mask = _rows([[1] * len(p) for p in prompts], P, 0, torch.long, left=True)
    completion_ids = _rows(completions, C, pad_id, torch.long)  # [B, C]
    generated = _rows(masks, C, 0, torch.long)  # [B, C]
    sampler = _rows(logprobs, C, 0.0, torch.float32) * generated  # [B, C]
    lengths = torch.tensor(n)
    truncated = torch.tensor([not any(t in stop_ids for t in ids) for ids in completions])
    texts = [tokenizer.decode(ids, skip_special_tokens=True).strip() for ids in completions]
    return Rollout(
        prompt_ids=prompt_ids.to(device), prompt_mask=prompt_mask.to(device),
        completion_ids=completion_ids.to(device),
        completion_mask=(torch.arange(C)[None] < lengths[:, None]).long().to(device),
        lengths=lengths.to(device), truncated=truncated.to(device), texts=texts,
        num_generations=num_generations,
        sampler_logp=sampler.to(device) if record_logprobs else None,
        generated_mask=generated.to(device), extra_fields=extra_fields(output, rows, where))
