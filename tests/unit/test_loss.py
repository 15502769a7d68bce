"""grpo_loss and loss_normalizer against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from mogrpo.algo.loss import ALL_AGGREGATIONS, grpo_loss, loss_normalizer
from mogrpo.errors import ConfigError

LN2 = math.log(2.0)
K3_LN2 = 1.0 - LN2  # k3 at log r = ln 2: (2 - 1) - ln 2 = 0.3068528

# Two sequences, T = 3. Sequence 0 has 2 tokens (A = +1), sequence 1 has 3 (A = -0.5).
# Importance ratios exp(logp - old_logp), eps = 0.2 (band [0.8, 1.2]):
#   seq 0: 1.1 -> -min(1.1, 1.1) = -1.1;  1.5 -> -min(1.5, 1.2) = -1.2 (clipped)
#   seq 1: 0.5 -> -min(-0.25, -0.4) = 0.4 (clipped);  1.5 -> -min(-0.75, -0.6) = 0.75
#          (pessimistic bound keeps the unclipped value, not clipped); 1.0 -> 0.5
RATIOS = [[1.1, 1.5, 1.0], [0.5, 1.5, 1.0]]
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])
ADV = torch.tensor([1.0, -0.5])
MAX_LEN = 4


def _inputs(requires_grad: bool = False):
    old_logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.5, -2.5]], dtype=torch.float64)
    logp = (old_logp + torch.tensor(RATIOS, dtype=torch.float64).log()).requires_grad_(requires_grad)
    return logp, old_logp


def test_loss_normalizer_values():
    assert loss_normalizer(MASK, "seq_mean", MAX_LEN) == 2.0  # B
    assert loss_normalizer(MASK, "token_mean", MAX_LEN) == 5.0  # 2 + 3 tokens
    assert loss_normalizer(MASK, "fixed_length", MAX_LEN) == 8.0  # B * 4
    assert loss_normalizer(torch.zeros(2, 3), "token_mean", MAX_LEN) == 1.0  # never 0


def test_loss_normalizer_errors():
    with pytest.raises(ConfigError, match="'mean'.*'seq_mean', 'token_mean', 'fixed_length', 'seq_sum', 'micro_token_mean'"):
        loss_normalizer(MASK, "mean", MAX_LEN)
    with pytest.raises(ConfigError, match="max_completion_length=0"):
        loss_normalizer(MASK, "fixed_length", 0)
    with pytest.raises(ValueError, match="3 tokens, more than max_completion_length=2"):
        loss_normalizer(MASK, "fixed_length", 2)


@pytest.mark.parametrize("aggregation,expected", [
    # seq means: (-1.1 - 1.2) / 2 = -1.15 and (0.4 + 0.75 + 0.5) / 3 = 0.55; sum -0.6; / B = 2
    ("seq_mean", -0.3),
    # token sum: -2.3 + 1.65 = -0.65; / 5 tokens
    ("token_mean", -0.13),
    # token sum -0.65 / (B * MAX_LEN = 8)
    ("fixed_length", -0.08125),
])
def test_surrogate_hand_values(aggregation, expected):
    logp, old_logp = _inputs()
    out = grpo_loss(logp, old_logp, ADV, MASK, aggregation=aggregation,
                    normalizer=loss_normalizer(MASK, aggregation, MAX_LEN))
    assert out.loss.item() == pytest.approx(expected, rel=1e-12)
    assert out.clip_frac_tokens.item() == 2  # seq 0 token 1 and seq 1 token 0
    assert out.num_tokens == 5
    assert out.ratio_mean.item() == pytest.approx((1.1 + 1.5 + 0.5 + 1.5 + 1.0) / 5)  # 1.12
    assert (out.kl == 0).all() and out.kl.shape == (2,)


def test_clipped_tokens_have_no_gradient():
    # token_mean, normalizer 5. d/dlogp of -ratio * A is -ratio * A; 0 where the clip is active.
    logp, old_logp = _inputs(requires_grad=True)
    grpo_loss(logp, old_logp, ADV, MASK, aggregation="token_mean", normalizer=5.0).loss.backward()
    expected = torch.tensor([[-1.1 / 5, 0.0, 0.0],  # -1.1 * 1 / 5; clipped; padding
                             [0.0, 0.75 / 5, 0.5 / 5]],  # clipped; -1.5 * -0.5 / 5; -1 * -0.5 / 5
                            dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expected)


def test_clip_higher():
    # epsilon_high = 0.6: seq 0 token 1 (ratio 1.5) is inside [0.8, 1.6] -> -1.5 instead of -1.2
    # token sum: -1.1 - 1.5 + 1.65 = -0.95; / 5
    logp, old_logp = _inputs()
    out = grpo_loss(logp, old_logp, ADV, MASK, aggregation="token_mean", normalizer=5.0,
                    epsilon_high=0.6)
    assert out.loss.item() == pytest.approx(-0.19, rel=1e-12)
    assert out.clip_frac_tokens.item() == 1


def test_kl_term_with_per_sequence_beta():
    # ref_logp = logp + ln 2 everywhere -> k3 = 1 - ln 2 on every token.
    # beta = [0.1, 0.0]: only seq 0's 2 tokens pay: 0.1 * 0.3068528 * 2 / 5 = 0.01227411
    logp, old_logp = _inputs()
    out = grpo_loss(logp, old_logp, ADV, MASK, aggregation="token_mean", normalizer=5.0,
                    ref_logp=logp + LN2, beta=torch.tensor([0.1, 0.0], dtype=torch.float64))
    assert out.loss.item() == pytest.approx(-0.13 + 0.1 * K3_LN2 * 2 / 5, rel=1e-12)
    torch.testing.assert_close(out.kl, torch.tensor([K3_LN2, K3_LN2], dtype=torch.float64))
    # scalar beta 0.1 on both: 0.1 * 0.3068528 * 5 tokens / 5
    out = grpo_loss(logp, old_logp, ADV, MASK, aggregation="token_mean", normalizer=5.0,
                    ref_logp=logp + LN2, beta=0.1)
    assert out.loss.item() == pytest.approx(-0.13 + 0.1 * K3_LN2, rel=1e-12)
    # seq_mean: each sequence's mean KL is 0.3068528; beta-weighted sum 0.1 * 0.3068528 / B
    out = grpo_loss(logp, old_logp, ADV, MASK, aggregation="seq_mean", normalizer=2.0,
                    ref_logp=logp + LN2, beta=torch.tensor([0.1, 0.0], dtype=torch.float64))
    assert out.loss.item() == pytest.approx(-0.3 + 0.1 * K3_LN2 / 2, rel=1e-12)


def test_kl_importance_weight():
    # KL term weighted by the detached ratio: seq 0 ratios 1.1, 1.5 (beta 0.1), seq 1 beta 0:
    # 0.1 * 0.3068528 * (1.1 + 1.5) / 5 = 0.01595635
    logp, old_logp = _inputs(requires_grad=True)
    zero_adv = torch.zeros(2, dtype=torch.float64)
    out = grpo_loss(logp, old_logp, zero_adv, MASK, aggregation="token_mean", normalizer=5.0,
                    ref_logp=(logp + LN2).detach(), beta=torch.tensor([0.1, 0.0], dtype=torch.float64),
                    kl_importance_weight=True)
    assert out.loss.item() == pytest.approx(0.1 * K3_LN2 * 2.6 / 5, rel=1e-12)
    # Gradient: beta * ratio * dk3/dlogp / 5 with dk3/dlogp = -(r - 1) = -1; the ratio is
    # detached, so no extra beta * k3 * ratio term appears.
    out.loss.backward()
    expected = torch.tensor([[-0.1 * 1.1 / 5, -0.1 * 1.5 / 5, 0.0], [0.0, 0.0, 0.0]],
                            dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expected)


def test_padding_garbage_does_not_leak():
    logp, old_logp = _inputs(requires_grad=False)
    logp = logp.clone()
    logp[0, 2], old_logp[0, 2] = math.nan, -math.inf  # padded position of seq 0
    ref_logp = logp.detach().clone()
    ref_logp[0, 2] = math.inf
    logp.requires_grad_(True)
    out = grpo_loss(logp, old_logp, ADV, MASK, aggregation="token_mean", normalizer=5.0,
                    ref_logp=ref_logp, beta=0.1)
    assert out.loss.item() == pytest.approx(-0.13, rel=1e-12)  # KL 0 on real tokens
    out.loss.backward()
    assert torch.isfinite(logp.grad).all() and logp.grad[0, 2] == 0


def test_beta_without_ref_is_an_error():
    logp, old_logp = _inputs()
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(logp, old_logp, ADV, MASK, normalizer=2.0, beta=0.04)
    out = grpo_loss(logp, old_logp, ADV, MASK, normalizer=2.0, beta=torch.zeros(2))
    assert (out.kl == 0).all()


def test_config_errors():
    logp, old_logp = _inputs()
    with pytest.raises(ConfigError, match=str(list(ALL_AGGREGATIONS)).replace("[", r"\[")):
        grpo_loss(logp, old_logp, ADV, MASK, normalizer=2.0, aggregation="sum")
    with pytest.raises(ConfigError, match="kl_estimator='k5'"):
        grpo_loss(logp, old_logp, ADV, MASK, normalizer=2.0, kl_estimator="k5")
    with pytest.raises(ConfigError, match="epsilon_low"):
        grpo_loss(logp, old_logp, ADV, MASK, normalizer=2.0, epsilon_low=1.0)
