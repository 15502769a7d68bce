"""The full-batch gradient equals the sum of micro-batch gradients, for every aggregation.

This is the property that makes gradient accumulation (and data-parallel processes) exact:
each micro-batch divides by the *global* normaliser of the optimizer step and gradients add.
"""

from __future__ import annotations

import pytest
import torch

from grpo_batch import B, T, make_batch
from mogrpo.algo.choices import LOSS_AGGREGATIONS
from mogrpo.algo.logprobs import token_logprobs
from mogrpo.algo.loss import grpo_loss, loss_normalizer

SPLITS = {
    "ones": [[0], [1], [2], [3], [4]],
    "twos": [[0, 1], [2, 3], [4]],
    "uneven": [[0], [1, 2, 3, 4]],
    "uneven2": [[0, 1, 2], [3, 4]],
}


@pytest.fixture(scope="module")
def setup():
    return make_batch()


def _micro_loss(model, data, rows, aggregation, normalizer):
    idx = torch.tensor(rows)
    width = int(data["mask"][idx].sum(-1).max())  # pad each micro-batch only to its longest
    sl = (idx, slice(0, width))
    logp = token_logprobs(model(data["inputs"][sl]), data["targets"][sl])
    out = grpo_loss(logp, data["old_logp"][sl], data["advantages"][idx], data["mask"][sl],
                    normalizer=normalizer, aggregation=aggregation, ref_logp=data["ref_logp"][sl],
                    beta=data["beta"][idx], kl_importance_weight=True)
    return out


def _grad(model, data, split, aggregation, normalizer, overwrite=False):
    """Backward on each micro-batch; grads accumulate unless ``overwrite`` (the bug)."""
    model.zero_grad(set_to_none=False)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)
    for rows in split:
        loss = _micro_loss(model, data, rows, aggregation, normalizer).loss
        if overwrite:
            for p, g in zip(params, torch.autograd.grad(loss, params), strict=True):
                p.grad.copy_(g)
        else:
            loss.backward()
    return torch.cat([p.grad.flatten() for p in params]).clone()


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS)
@pytest.mark.parametrize("split", sorted(SPLITS))
def test_micro_batches_sum_to_full_batch(setup, aggregation, split):
    model, data = setup
    normalizer = loss_normalizer(data["mask"], aggregation, max_completion_length=T)
    full = _grad(model, data, [list(range(B))], aggregation, normalizer)
    assert full.norm() > 0
    micro = _grad(model, data, SPLITS[split], aggregation, normalizer)
    assert _rel_err(micro, full) <= 1e-5


def test_exercises_clipping_and_kl(setup):
    model, data = setup
    with torch.no_grad():
        out = _micro_loss(model, data, list(range(B)), "token_mean", 1.0)
    assert 0 < out.clip_frac_tokens.item() < out.num_tokens
    assert (out.kl[data["beta"] > 0] > 0).all()


@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS)
def test_overwriting_grads_is_detected(setup, aggregation):
    # The bug users hit: p.grad.copy_(g) per micro-batch keeps only the last micro-batch.
    model, data = setup
    normalizer = loss_normalizer(data["mask"], aggregation, max_completion_length=T)
    full = _grad(model, data, [list(range(B))], aggregation, normalizer)
    wrong = _grad(model, data, SPLITS["twos"], aggregation, normalizer, overwrite=True)
    assert _rel_err(wrong, full) > 0.1


def test_per_micro_batch_token_mean_is_detected(setup):
    # The other classic bug: normalising each micro-batch by its own token count. With
    # uneven lengths the short sequences get over-weighted and the gradient changes.
    model, data = setup
    full = _grad(model, data, [list(range(B))], "token_mean",
                 loss_normalizer(data["mask"], "token_mean", T))
    model.zero_grad(set_to_none=True)
    for rows in SPLITS["uneven"]:
        local = loss_normalizer(data["mask"][torch.tensor(rows)], "token_mean", T)
        # sum of local means over the 2 micro-batches; average them like a naive trainer would
        (_micro_loss(model, data, rows, "token_mean", local).loss / 2).backward()
    wrong = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert _rel_err(wrong, full) > 0.1
