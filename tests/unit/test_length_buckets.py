"""Micro-batches of similar-length rows: every row once, padding trimmed, same gradient."""

from __future__ import annotations

import torch

from grpo_batch import make_batch
from mogrpo.algo.logprobs import token_logprobs
from mogrpo.algo.loss import grpo_loss, loss_normalizer
from mogrpo.rollout.batching import length_buckets


def masks(prompt_lengths, completion_lengths, P=6, C=8):
    prompt = torch.tensor([[0] * (P - n) + [1] * n for n in prompt_lengths])
    completion = torch.tensor([[1] * n + [0] * (C - n) for n in completion_lengths])
    return prompt, completion


def test_rows_are_grouped_by_total_length_and_each_row_appears_once():
    prompt, completion = masks([3, 3, 3, 3, 3, 3, 3], [8, 1, 7, 2, 8, 1, 3])
    buckets = length_buckets(prompt, completion, 3)
    rows = [b.tolist() for b in buckets]
    assert rows == [[1, 5, 3], [6, 2, 0], [4]]
    totals = [(prompt.sum(1) + completion.sum(1))[b].tolist() for b in buckets]
    assert totals == [[4, 4, 5], [6, 10, 11], [11]]
    # the widest completion in the first micro-batch is 2 tokens, not 8: padding trimmed
    assert int(completion[buckets[0]].sum(1).max()) == 2


def test_one_micro_batch_keeps_the_rows_in_order():
    prompt, completion = masks([3, 2], [5, 1])
    assert length_buckets(prompt, completion, 8) == [slice(0, 2)]


def test_length_buckets_leave_the_step_gradient_unchanged():
    model, data = make_batch()
    mask = data["mask"]
    normalizer = loss_normalizer(mask, "token_mean", mask.shape[1])
    B = mask.shape[0]

    def gradient(buckets):
        model.zero_grad()
        for rows in buckets:
            idx = torch.arange(B)[rows]
            width = int(mask[idx].sum(-1).max())
            sl = (idx, slice(0, width))
            logp = token_logprobs(model(data["inputs"][sl]), data["targets"][sl])
            grpo_loss(logp, data["old_logp"][sl], data["advantages"][idx], mask[sl],
                      normalizer=normalizer, aggregation="token_mean",
                      ref_logp=data["ref_logp"][sl], beta=data["beta"][idx]).loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    whole = gradient([slice(0, B)])
    bucketed = gradient(length_buckets(torch.ones(B, 1), mask, 2))
    torch.testing.assert_close(bucketed, whole, rtol=1e-5, atol=1e-7)
