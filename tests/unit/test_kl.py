"""KL estimators k1/k2/k3 against hand-computed values and at numerical extremes."""

from __future__ import annotations

import math

import pytest
import torch

from mogrpo.algo.choices import KL_ESTIMATORS
from mogrpo.algo.kl import K3_LOG_RATIO_MAX, kl_estimate
from mogrpo.errors import ConfigError

LN2 = math.log(2.0)


def _pair(log_r: float, dtype=torch.float64):
    """(logp, ref_logp) with ref_logp - logp = log_r."""
    logp = torch.tensor([[-5.0]], dtype=dtype)
    return logp, logp + log_r


@pytest.mark.parametrize("log_r,expected", [
    # log r = ln 2: k1 = -ln 2, k2 = (ln 2)^2 / 2, k3 = (2 - 1) - ln 2
    (LN2, {"k1": -LN2, "k2": LN2**2 / 2, "k3": 1 - LN2}),  # -0.693147, 0.240227, 0.306853
    # log r = -ln 2: k1 = ln 2, k2 = (ln 2)^2 / 2, k3 = (1/2 - 1) + ln 2
    (-LN2, {"k1": LN2, "k2": LN2**2 / 2, "k3": LN2 - 0.5}),  # 0.693147, 0.240227, 0.193147
])
def test_hand_values(log_r, expected):
    logp, ref_logp = _pair(log_r)
    for name, value in expected.items():
        assert kl_estimate(logp, ref_logp, name).item() == pytest.approx(value, rel=1e-12)


def test_identical_inputs_give_exactly_zero():
    logp = -torch.rand(4, 9) * 10
    for name in KL_ESTIMATORS:
        out = kl_estimate(logp, logp.clone(), name)
        assert (out == 0).all(), name


def test_k3_nonnegative_on_random_inputs():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(64, 128, generator=g) * 30
    ref_logp = -torch.rand(64, 128, generator=g) * 30
    out = kl_estimate(logp, ref_logp, "k3")
    assert out.dtype == torch.float32 and torch.isfinite(out).all() and (out >= 0).all()


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_k3_accurate_for_tiny_log_ratio(dtype, rtol, sign):
    logp = torch.zeros(1, 1, dtype=dtype)
    ref_logp = torch.full((1, 1), sign * 1e-6, dtype=dtype)
    x = (ref_logp - logp).double().item()  # the log-ratio exactly as the inputs represent it
    series = x * x / 2 + x**3 / 6  # e^x - 1 - x; next term ~4e-26
    out = kl_estimate(logp, ref_logp, "k3").item()
    assert out > 0 and abs(out - series) / series < rtol


def test_k3_finite_for_huge_log_ratio():
    # log r = 200 would overflow exp; the clamp at 20 gives expm1(20) - 200.
    logp, ref_logp = _pair(200.0, torch.float32)
    logp.requires_grad_(True)
    out = kl_estimate(logp, ref_logp, "k3")
    assert out.item() == pytest.approx(math.expm1(K3_LOG_RATIO_MAX) - 200.0, rel=1e-6)
    out.sum().backward()
    assert torch.isfinite(logp.grad).all()


def test_k3_and_k1_unbiased_k2_biased():
    # Exact expectations over pi = [0.5, 0.5] with pi_ref = [0.25, 0.75]:
    # KL(pi || pi_ref) = 0.5 ln(0.5/0.25) + 0.5 ln(0.5/0.75) = 0.5 ln(4/3) = 0.1438410
    # E[k2] = 0.5 * ((ln 0.5)^2 / 2 + (ln 1.5)^2 / 2) = 0.5 * (0.2402265 + 0.0822010) = 0.1612137
    logp = torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64))
    ref_logp = torch.log(torch.tensor([[0.25, 0.75]], dtype=torch.float64))
    p = logp.exp()
    expect = {name: (p * kl_estimate(logp, ref_logp, name)).sum().item() for name in KL_ESTIMATORS}
    assert expect["k1"] == pytest.approx(0.1438410, abs=1e-7)
    assert expect["k3"] == pytest.approx(0.1438410, abs=1e-7)
    assert expect["k2"] == pytest.approx(0.1612137, abs=1e-7)


def test_k3_gradient_matches_closed_form():
    # d k3 / d logp = -(r - 1): at log r = ln 2 it is -1
    logp, ref_logp = _pair(LN2)
    logp.requires_grad_(True)
    kl_estimate(logp, ref_logp, "k3").sum().backward()
    assert logp.grad.item() == pytest.approx(-1.0, rel=1e-12)


def test_low_precision_inputs_computed_in_float32():
    logp = torch.tensor([[-1.0]], dtype=torch.bfloat16)
    assert kl_estimate(logp, logp - 0.5, "k3").dtype == torch.float32


def test_unknown_estimator():
    with pytest.raises(ConfigError, match=r"'k4'.*'k1', 'k2', 'k3'"):
        kl_estimate(torch.zeros(1, 1), torch.zeros(1, 1), "k4")
