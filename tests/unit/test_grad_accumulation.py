"""The full-batch gradient equals the sum of micro-batch gradients, for every aggregation.

This is the property that makes gradient accumulation (and data-parallel processes) exact:
each micro-batch divides by the *global* normaliser of the optimizer step and gradients add.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mogrpo.algo.logprobs import token_logprobs
from mogrpo.algo.loss import LOSS_AGGREGATIONS, grpo_loss, loss_normalizer

V, D, B, T = 11, 6, 5, 7
LENGTHS = [7, 2, 5, 1, 4]  # different lengths, so per-sequence and per-token means differ
SPLITS = {
    "ones": [[0], [1], [2], [3], [4]],
    "twos": [[0, 1], [2, 3], [4]],
    "uneven": [[0], [1, 2, 3, 4]],
    "uneven2": [[0, 1, 2], [3, 4]],
}


class TinyLM(nn.Module):
    """Logits for position t from the token at t (no mixing across rows), in float64."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D, dtype=torch.float64)
        self.head = nn.Linear(D, V, dtype=torch.float64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(ids)))  # [B, T, V]


@pytest.fixture(scope="module")
def setup():
    g = torch.Generator().manual_seed(0)
    model = TinyLM()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
    inputs = torch.randint(0, V, (B, T), generator=g)
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.arange(T) < torch.tensor(LENGTHS)[:, None]).long()  # [B, T]
    with torch.no_grad():
        logp = token_logprobs(model(inputs), targets)
    # Rollout-time and reference log-probs away from the current ones, so ratios leave the
    # clip band on both sides and the KL term is non-trivial.
    old_logp = logp + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref_logp = logp + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    advantages = torch.tensor([1.0, -0.7, 0.4, -1.3, 0.9], dtype=torch.float64)
    beta = torch.tensor([0.05, 0.2, 0.0, 0.1, 0.3], dtype=torch.float64)  # per task
    return model, dict(inputs=inputs, targets=targets, mask=mask, old_logp=old_logp,
                       ref_logp=ref_logp, advantages=advantages, beta=beta)


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
