"""Every loss variant's policy term, the new aggregations and the KL weighting, against
hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from mogrpo.algo.loss import grpo_loss, loss_normalizer
from mogrpo.algo.surrogates import (
    LossVariant,
    cispo_surrogate,
    clipped_surrogate,
    gamma_weights,
    importance_weights,
    mask_truncated,
    sapo_surrogate,
)
from mogrpo.errors import ConfigError

F64 = torch.float64
# As in test_loss.py: seq 0 has 2 tokens (A = +1), seq 1 has 3 (A = -0.5); ε = 0.2.
# Clipped per-token losses: seq 0: -1.1, -1.2; seq 1: 0.4, 0.75, 0.5.
RATIOS = [[1.1, 1.5, 1.0], [0.5, 1.5, 1.0]]
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])
ADV = torch.tensor([1.0, -0.5], dtype=F64)


def _inputs():
    old_logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.5, -2.5]], dtype=F64)
    return old_logp + torch.tensor(RATIOS, dtype=F64).log(), old_logp


def t(*rows):
    return torch.tensor(rows, dtype=F64)


def test_sequence_level_weight_is_the_geometric_mean_ratio():
    logp, old_logp = _inputs()
    log_w, w = importance_weights(logp, old_logp, MASK, "sequence")
    assert w.shape == (2, 1)
    torch.testing.assert_close(w[:, 0], t(math.sqrt(1.1 * 1.5), (0.5 * 1.5 * 1.0) ** (1 / 3)))
    _, w_tok = importance_weights(logp, old_logp, MASK, "token")
    torch.testing.assert_close(w_tok, t(*RATIOS))


def test_two_sided_clipping_caps_the_unclipped_ratio():
    w, adv = t([2.0], [2.0]), t([1.0], [-1.0])
    plain, clipped = clipped_surrogate(w, adv, 0.2, 0.28)
    # A > 0: -min(2, 1.28) = -1.28 (clipped); A < 0: -min(-2, -1.28) = 2 (pessimistic)
    torch.testing.assert_close(plain, t([-1.28], [2.0]))
    assert clipped.tolist() == [[True], [False]]
    two_sided, _ = clipped_surrogate(w, adv, 0.2, 0.28, delta=1.5)
    torch.testing.assert_close(two_sided, t([-1.28], [1.5]))  # INTELLECT-2: 2 → δ = 1.5


def test_cispo_clips_and_detaches_the_weight():
    logp = t([-1.0, -2.0, -3.0]).requires_grad_(True)
    loss, clipped = cispo_surrogate(t([0.5, 3.0, 6.0]), t([1.0]), logp, max_ratio=5.0)
    torch.testing.assert_close(loss, t([0.5, 6.0, 15.0]))  # -min(w, 5) * A * logp
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, t([-0.5, -3.0, -5.0]))
    assert clipped.tolist() == [[False, False, True]]


def test_sapo_soft_gate():
    w = t([1.0], [1.5]).requires_grad_(True)
    loss = sapo_surrogate(w, t([1.0], [-1.0]), temperature_pos=1.0, temperature_neg=1.05)
    gate = 1 / (1 + math.exp(-1.05 * 0.5))
    torch.testing.assert_close(loss, t([-2.0], [gate * 4 / 1.05]))
    loss.sum().backward()
    # at w = 1 the gate's slope is that of the plain ratio: d/dw (-w A) = -A = -1
    assert w.grad[0, 0].item() == pytest.approx(-1.0, rel=1e-12)


def test_vespo_gamma_weights():
    # log w = ln 2 for both: A ≥ 0 → e^3 · 2^2 · e^-6 = 4 e^-3; A < 0 → e^2 · 2^3 · e^-4 = 8 e^-2
    log_ratio = t([math.log(2.0), 0.0], [math.log(2.0), 0.0])
    phi = gamma_weights(t([0.5], [-0.5]), log_ratio, torch.ones(2, 2), k_pos=2.0,
                        lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0)
    torch.testing.assert_close(phi, t([4 * math.exp(-3)], [8 * math.exp(-2)]))
    at_one = gamma_weights(t([1.0]), t([0.0]), torch.ones(1, 1), k_pos=2.0, lambda_pos=3.0,
                           k_neg=3.0, lambda_neg=2.0)
    assert at_one.item() == pytest.approx(1.0, rel=1e-12)  # φ(1) = 1


def test_mask_truncated_zeroes_whole_rows():
    got = mask_truncated(MASK, torch.tensor([True, False]))
    assert got.tolist() == [[0, 0, 0], [1, 1, 1]]


def test_seq_sum_and_micro_token_mean_hand_values():
    logp, old_logp = _inputs()
    # LUSPO: token sums -2.3 and 1.65, mean over B = 2 → -0.325
    out = grpo_loss(logp, old_logp, ADV, MASK, aggregation="seq_sum",
                    normalizer=loss_normalizer(MASK, "seq_sum", 4))
    assert out.loss.item() == pytest.approx(-0.325, rel=1e-12)
    # BNPO, one micro-batch per sequence: (-2.3 / 2 + 1.65 / 3) / 2 micro-batches = -0.3
    norm = loss_normalizer(MASK, "micro_token_mean", 4, micro_batches=2)
    total = sum(grpo_loss(logp[i:i + 1], old_logp[i:i + 1], ADV[i:i + 1], MASK[i:i + 1],
                          aggregation="micro_token_mean", normalizer=norm).loss.item()
                for i in range(2))
    assert norm == 2.0 and total == pytest.approx(-0.3, rel=1e-12)
    # ... and one micro-batch of both: -0.65 / 5 tokens
    one = grpo_loss(logp, old_logp, ADV, MASK, aggregation="micro_token_mean", normalizer=1.0)
    assert one.loss.item() == pytest.approx(-0.13, rel=1e-12)


def test_gspo_loss_hand_value():
    # sequence-level ratios 1.2845 (A = +1 → clipped to 1.2) and 0.9086 (A = -0.5, inside)
    logp, old_logp = _inputs()
    out = grpo_loss(logp, old_logp, ADV, MASK, aggregation="seq_mean", normalizer=2.0,
                    variant=LossVariant(importance_sampling_level="sequence"))
    w1 = (0.5 * 1.5) ** (1 / 3)
    assert out.loss.item() == pytest.approx((-1.2 + 0.5 * w1) / 2, rel=1e-12)
    assert out.clip_frac_tokens.item() == 2  # both tokens of sequence 0


def _kl_gradients(kl_weight: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact expectation over a 4-token vocabulary: Σ_x π_old(x) · [w(x) k3(x)] with the
    samples x weighted by π_old through β, and the two exact KL gradients to compare with."""
    theta = torch.tensor([0.3, -0.2, 1.0, 0.1], dtype=F64, requires_grad=True)
    ref = torch.tensor([0.1, 0.4, 0.3, 0.2], dtype=F64).log()
    old = torch.tensor([0.25, 0.25, 0.3, 0.2], dtype=F64).log()  # off-policy samples
    logp = torch.log_softmax(theta, -1)[:, None]  # [V, 1]: one 1-token sequence per x
    out = grpo_loss(logp, old[:, None], torch.zeros(4, dtype=F64), torch.ones(4, 1),
                    aggregation="token_mean", normalizer=1.0, ref_logp=ref[:, None],
                    beta=old.exp(), kl_importance_weight=kl_weight)
    (grad,) = torch.autograd.grad(out.loss, theta)
    p = torch.log_softmax(theta, -1)
    forward = torch.autograd.grad((p.exp() * (p - ref)).sum(), theta)[0]  # ∇ KL(π‖π_ref)
    p = torch.log_softmax(theta, -1)
    reverse = torch.autograd.grad((ref.exp() * (ref - p)).sum(), theta)[0]  # ∇ KL(π_ref‖π)
    return grad, forward, reverse


def test_differentiable_kl_weight_gives_the_exact_kl_gradient():
    grad, forward, reverse = _kl_gradients("differentiable")
    torch.testing.assert_close(grad, forward)
    assert (forward - reverse).abs().max() > 1e-2  # the two targets do differ here


def test_detached_kl_weight_gives_the_reverse_kl_gradient():
    grad, _, reverse = _kl_gradients("detached")
    torch.testing.assert_close(grad, reverse)


def test_unknown_variant_values():
    with pytest.raises(ConfigError, match="loss_type='ppo' is not supported"):
        LossVariant(loss_type="ppo")
    with pytest.raises(ConfigError, match="importance_sampling_level='batch'"):
        LossVariant(importance_sampling_level="batch")
    logp, old_logp = _inputs()
    with pytest.raises(ConfigError, match="kl_importance_weight='yes'"):
        grpo_loss(logp, old_logp, ADV, MASK, normalizer=1.0, kl_importance_weight="yes")
