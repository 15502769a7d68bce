"""Truncated importance weights for another engine's samples, and their place in the loss."""

from __future__ import annotations

import math

import pytest
import torch

from mogrpo.algo.importance import truncated_importance_weights
from mogrpo.algo.loss import grpo_loss
from mogrpo.errors import ConfigError

LN2 = math.log(2.0)


def test_weights_by_hand():
    trainer = torch.tensor([[-1.0, -2.0, -0.5, -1.0], [-0.3, -4.0, -1.0, 0.0]],
                           dtype=torch.float64)
    sampler = torch.tensor([[-1.0, -2.5, -3.0, -9.0],
                            [-0.3 + LN2, float("nan"), float("-inf"), 5.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]])
    weights = truncated_importance_weights(trainer, sampler, mask, cap=3.0)
    # equal; 0.5 nats under-sampled; e^2.5 = 12.2 capped; padding
    assert weights[0].tolist() == pytest.approx([1.0, math.exp(0.5), 3.0, 1.0], abs=1e-12)
    # over-sampled 2x; no usable sampler log-prob (NaN, -inf): no correction; padding
    assert weights[1].tolist() == pytest.approx([0.5, 1.0, 1.0, 1.0], abs=1e-12)
    assert weights[0, 2].item() == 3.0  # exactly the cap, not 3.0000000000000004
    assert weights.dtype == torch.float64 and not weights.requires_grad


def test_the_weights_carry_no_gradient_and_survive_huge_gaps():
    trainer = torch.tensor([[0.0, -1.0]], requires_grad=True)
    sampler = torch.tensor([[-900.0, -1.0]])
    weights = truncated_importance_weights(trainer, sampler, torch.ones(1, 2), cap=2.0)
    assert weights.tolist() == [[2.0, 1.0]] and weights.grad_fn is None


def test_a_cap_below_one_is_refused():
    with pytest.raises(ConfigError, match="must be >= 1"):
        truncated_importance_weights(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), 0.5)


def test_the_loss_weights_the_surrogate_of_each_token_but_not_its_kl():
    # one sequence of 2 tokens, on-policy (ratio 1), A = 2, seq_mean over 2 tokens
    old = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    logp = old.clone().requires_grad_(True)
    ref = old + LN2  # log r = ref - logp = ln 2: k3 = (2 - 1) - ln 2 = 0.3068528 per token
    out = grpo_loss(logp, old, torch.tensor([2.0]), torch.ones(1, 2), normalizer=1.0,
                    ref_logp=ref, beta=0.5, importance_weights=torch.tensor([[1.0, 3.0]]))
    k3 = 1.0 - LN2
    # (-(2 * 1) + 0.5 k3 - (2 * 3) + 0.5 k3) / 2: the KL term is not multiplied
    assert out.loss.item() == pytest.approx((-2.0 - 6.0 + 2 * 0.5 * k3) / 2, abs=1e-12)
    plain = grpo_loss(old.clone().requires_grad_(True), old, torch.tensor([2.0]),
                      torch.ones(1, 2), normalizer=1.0)
    weighted = grpo_loss(logp.detach().clone().requires_grad_(True), old, torch.tensor([2.0]),
                         torch.ones(1, 2), normalizer=1.0,
                         importance_weights=torch.tensor([[1.0, 3.0]]))
    assert plain.loss.item() == pytest.approx(-2.0) and weighted.loss.item() == pytest.approx(-4.0)
