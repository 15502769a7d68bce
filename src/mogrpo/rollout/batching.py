"""Select and join rollouts group by group (dynamic sampling drops and refills whole groups),
and cut them into the update's micro-batches."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mogrpo.rollout.generate import Rollout


def select_groups(rollout: Rollout, groups: list[int]) -> Rollout:
    """The rollout restricted to the given prompt indices (each keeps its K completions)."""
    K = rollout.num_generations
    rows = [g * K + k for g in groups for k in range(K)]
    index = torch.tensor(rows, dtype=torch.long, device=rollout.completion_ids.device)
    return Rollout(
        prompt_ids=rollout.prompt_ids[index],
        prompt_mask=rollout.prompt_mask[index],
        completion_ids=rollout.completion_ids[index],
        completion_mask=rollout.completion_mask[index],
        lengths=rollout.lengths[index],
        truncated=rollout.truncated[index],
        texts=[rollout.texts[r] for r in rows],
        num_generations=K,
        prompt_truncated=rollout.prompt_truncated,
        nonfinite_logits=rollout.nonfinite_logits,
        sampler_logp=rollout.sampler_logp[index] if rollout.sampler_logp is not None else None,
        generated_mask=(rollout.generated_mask[index] if rollout.generated_mask is not None
                        else None),
        episodes=[rollout.episodes[r] for r in rows] if rollout.episodes is not None else None,
        extra_fields=([rollout.extra_fields[r] for r in rows]
                      if rollout.extra_fields is not None else None),
    )


def concat_rollouts(parts: list[Rollout], pad_id: int) -> Rollout:
    """Join rollouts of the same K: prompts re-padded on the left, completions on the right."""
    if len(parts) == 1:
        return parts[0]
    P = max(r.prompt_ids.shape[1] for r in parts)
    C = max(r.completion_ids.shape[1] for r in parts)

    def left(t: torch.Tensor, width: int, value: int) -> torch.Tensor:
        return F.pad(t, (width - t.shape[1], 0), value=value)

    def right(t: torch.Tensor, width: int, value: int) -> torch.Tensor:
        return F.pad(t, (0, width - t.shape[1]), value=value)

    return Rollout(
        prompt_ids=torch.cat([left(r.prompt_ids, P, pad_id) for r in parts]),
        prompt_mask=torch.cat([left(r.prompt_mask, P, 0) for r in parts]),
        completion_ids=torch.cat([right(r.completion_ids, C, pad_id) for r in parts]),
        completion_mask=torch.cat([right(r.completion_mask, C, 0) for r in parts]),
        lengths=torch.cat([r.lengths for r in parts]),
        truncated=torch.cat([r.truncated for r in parts]),
        texts=[t for r in parts for t in r.texts],
        num_generations=parts[0].num_generations,
        prompt_truncated=sum(r.prompt_truncated for r in parts),
        nonfinite_logits=sum(r.nonfinite_logits for r in parts),
        sampler_logp=(torch.cat([right(r.sampler_logp, C, 0) for r in parts])
                      if all(r.sampler_logp is not None for r in parts) else None),
        # a single-turn part's sampled tokens are all of its completion's
        generated_mask=(torch.cat([right(r.train_mask, C, 0) for r in parts])
                        if any(r.generated_mask is not None for r in parts) else None),
        episodes=([e for r in parts for e in (r.episodes or [None] * r.batch_size)]
                  if any(r.episodes is not None for r in parts) else None),
        extra_fields=([e for r in parts for e in (r.extra_fields or [{}] * r.batch_size)]
                      if any(r.extra_fields is not None for r in parts) else None),
    )


def length_buckets(prompt_mask: torch.Tensor, completion_mask: torch.Tensor,
                   size: int) -> list[slice | torch.Tensor]:
    """Row sets of at most `size` rows; rows of similar length go together, so `micro_batch`
    trims more padding. The loss normaliser is global, so how rows are grouped changes no
    gradient."""
    B = prompt_mask.shape[0]
    if size >= B:
        return [slice(0, B)]
    lengths = prompt_mask.sum(1) + completion_mask.sum(1)  # [B]
    order = torch.argsort(lengths, stable=True)
    return [order[i:i + size] for i in range(0, B, size)]


def first_row(rows: slice | torch.Tensor) -> slice | torch.Tensor:
    """The first row of a micro-batch (the input of a zero-weighted, collective-only pass)."""
    return slice(rows.start, rows.start + 1) if isinstance(rows, slice) else rows[:1]


def micro_batch(ro: Rollout, rows: slice | torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The rows' (prompt_ids, prompt_mask, completion_ids, completion_mask), trimmed of
    columns that are padding in every row."""
    prompt_ids, prompt_mask = ro.prompt_ids[rows], ro.prompt_mask[rows]
    completion_ids, completion_mask = ro.completion_ids[rows], ro.completion_mask[rows]
    first = int(prompt_mask.any(0).float().argmax())  # left padding shared by all rows
    width = max(int(completion_mask.sum(1).max()), 1)
    return (prompt_ids[:, first:], prompt_mask[:, first:],
            completion_ids[:, :width], completion_mask[:, :width])
