"""KL controllers: hand-computed beta sequences, bounds, NaN, log lines, state round-trip."""

from __future__ import annotations

import json
import math

import pytest

from mogrpo.algo.kl_control import (
    BandKL,
    BetaChange,
    FixedKL,
    ProportionalKL,
    make_controller,
)
from mogrpo.errors import ConfigError


def _run(ctrl, kls, n=1):
    """beta after each update, starting at step 1."""
    out = []
    for step, kl in enumerate(kls, start=1):
        ctrl.update(kl, step, n=n)
        out.append(ctrl.beta)
    return out


def test_band_hand_sequence():
    # USERS.md: fairness band 0.02-0.06, beta 0.1, rate 0.15.
    ctrl = BandKL("fairness", 0.1, low=0.02, high=0.06)
    kls = [0.018, 0.04, 0.071, 0.071, 0.02, 0.06, 0.010]
    # 0.1*0.85; in band; *1.15; *1.15; == low: in band; == high: in band; *0.85
    expected = [0.085, 0.085, 0.09775, 0.1124125, 0.1124125, 0.1124125, 0.095550625]
    assert _run(ctrl, kls) == pytest.approx(expected, rel=1e-12)


def test_band_returns_a_record_only_on_change():
    ctrl = BandKL("fairness", 0.1, low=0.02, high=0.06)
    assert ctrl.update(0.04, 10) is None
    change = ctrl.update(0.018, 20)
    assert change == BetaChange("fairness", 20, 0.018, 0.1, pytest.approx(0.085), "KL 0.018 < 0.020")
    assert change.format() == "[KL@20] fairness KL 0.018 < 0.020: beta 0.1000 -> 0.0850"


def test_band_above_line():
    ctrl = BandKL("hallucination", 0.3, low=0.08, high=0.15, rate=0.1)
    line = ctrl.update(0.171, 40).format()
    assert line == "[KL@40] hallucination KL 0.171 > 0.150: beta 0.3000 -> 0.3300"


def test_tiny_kl_is_not_printed_as_zero():
    ctrl = BandKL("fairness", 0.1, low=0.02, high=0.06)
    line = ctrl.update(0.0004, 5).format()
    assert line == "[KL@5] fairness KL 4.0e-04 < 0.020: beta 0.1000 -> 0.0850"


def test_band_clamps_at_both_bounds():
    up = BandKL("t", 9.0, low=0.02, high=0.06, beta_max=10.0)
    # 9 * 1.15 = 10.35 -> 10.0; then at the bound: no change, no record.
    assert up.update(1.0, 1).new == 10.0
    assert up.update(1.0, 2) is None and up.beta == 10.0
    down = BandKL("t", 0.00011, low=0.02, high=0.06, beta_min=1e-4)
    # 0.00011 * 0.85 = 0.0000935 -> 1e-4
    assert down.update(0.0, 1).new == 1e-4
    assert down.update(0.0, 2) is None and down.beta == 1e-4


def test_proportional_hand_sequence():
    ctrl = ProportionalKL("fairness", 0.1, target=0.05, horizon=100)
    betas = []
    for kl, n in [(0.03, 10), (0.06, 10), (0.055, 20), (0.2, 100), (0.05, 50)]:
        ctrl.update(kl, 1, n=n)
        betas.append(ctrl.beta)
    # e = clip(0.03/0.05 - 1 = -0.4) = -0.2 -> *(1 - 0.2*10/100) = *0.98 -> 0.098
    # e = 0.2 -> *1.02 -> 0.09996;  e = 0.1, n/h = 0.2 -> *1.02 -> 0.1019592
    # e = clip(3) = 0.2, n/h = 1 -> *1.2 -> 0.12235104;  e = 0 -> unchanged
    assert betas == pytest.approx([0.098, 0.09996, 0.1019592, 0.12235104, 0.12235104], rel=1e-12)


def test_proportional_line_and_default_n():
    ctrl = ProportionalKL("fairness", 0.1, target=0.05, horizon=10)
    change = ctrl.update(0.03, 7)  # n = 1: *(1 - 0.2/10) = *0.98
    assert change.format() == "[KL@7] fairness KL 0.030 vs target 0.050: beta 0.1000 -> 0.0980"
    assert ctrl.update(0.05, 8) is None  # on target: no change, no record
    assert ctrl.update(0.2, 9, n=0) is None  # no samples: no change


def test_proportional_clamps_at_both_bounds():
    up = ProportionalKL("t", 9.5, target=0.05, horizon=1, beta_max=10.0)
    assert up.update(1.0, 1).new == 10.0  # 9.5 * 1.2 = 11.4 -> 10
    assert up.update(1.0, 2) is None
    down = ProportionalKL("t", 0.001, target=0.05, horizon=1, beta_min=0.0009)
    assert down.update(0.0, 1).new == 0.0009  # 0.001 * 0.8 = 0.0008 -> 0.0009
    assert down.update(0.0, 2) is None


@pytest.mark.parametrize("ctrl", [
    BandKL("t", 0.1, low=0.02, high=0.06),
    ProportionalKL("t", 0.1, target=0.05, horizon=10),
])
@pytest.mark.parametrize("kl", [math.nan, math.inf, -math.inf])
def test_non_finite_kl_leaves_beta_alone(ctrl, kl):
    assert ctrl.update(kl, 3, n=10) is None
    assert ctrl.beta == 0.1


def test_fixed_never_changes():
    ctrl = FixedKL("t", 0.04)
    assert all(ctrl.update(kl, i) is None for i, kl in enumerate([0.0, 5.0, math.nan]))
    assert ctrl.beta == 0.04
    assert FixedKL("t", 0.0).beta == 0.0  # beta 0 = no KL term is allowed for fixed


@pytest.mark.parametrize("kind,options", [
    ("band", {"low": 0.02, "high": 0.06}),
    ("proportional", {"target": 0.05, "horizon": 50}),
    ("fixed", {}),
])
def test_state_round_trip_through_json(kind, options):
    kls = [0.018, 0.09, 0.07, 0.01, 0.03, 0.2, 0.0]
    a = make_controller("fairness", kind, 0.1, **options)
    _run(a, kls[:3], n=8)
    b = make_controller("fairness", kind, 0.5, **options)  # a different starting beta
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b.beta == a.beta
    assert _run(b, kls[3:], n=8) == _run(a, kls[3:], n=8)


def test_state_of_another_kind_is_refused():
    band = make_controller("fairness", "band", 0.1, low=0.02, high=0.06)
    prop = make_controller("fairness", "proportional", 0.1, target=0.05)
    with pytest.raises(ConfigError, match=r"tasks\.fairness\.kl\.kind='proportional'.*'band'"):
        prop.load_state_dict(band.state_dict())


def test_factory_builds_each_kind():
    assert isinstance(make_controller("f", "fixed", 0.1), FixedKL)
    band = make_controller("f", "band", 0.1, low=0.02, high=0.06, rate=0.2)
    assert isinstance(band, BandKL) and band.rate == 0.2 and band.task == "f"
    prop = make_controller("f", "proportional", 0.1, target=0.05)
    assert isinstance(prop, ProportionalKL) and prop.horizon == 10000


@pytest.mark.parametrize("kind,beta,options,message", [
    ("adaptive", 0.1, {}, r"tasks\.fairness\.kl\.kind='adaptive' is not supported; "
                          r"choose one of \['fixed', 'band', 'proportional', 'dual'\]"),
    ("band", 0.1, {"low": 0.06, "high": 0.02},
     r"tasks\.fairness\.kl\.low=0\.06 must be below tasks\.fairness\.kl\.high=0\.02"),
    ("band", 0.1, {"low": 0.02, "high": 0.02}, r"kl\.low=0\.02 must be below"),
    ("band", 0.1, {"low": 0.02, "high": 0.06, "rate": 1.0}, r"kl\.rate=1\.0 must be in \(0, 1\)"),
    ("band", 0.1, {"low": 0.02, "high": 0.06, "rate": 0}, r"kl\.rate=0 must be in \(0, 1\)"),
    ("band", 0.1, {"high": 0.06}, r"kl\.low is required for kind 'band'; e\.g\. low: 0\.02"),
    ("band", 0.1, {"low": 0.02, "high": 0.06, "target": 0.05},
     r"kl\.target=0\.05 does not apply to kind 'band'"),
    ("proportional", 0.1, {"target": 0.0}, r"kl\.target=0\.0 must be > 0"),
    ("proportional", 0.1, {"target": -1}, r"kl\.target=-1 must be > 0"),
    ("proportional", 0.1, {}, r"kl\.target is required for kind 'proportional'"),
    ("proportional", 0.1, {"target": 0.05, "horizon": 0}, r"kl\.horizon=0 must be > 0"),
    ("band", 20.0, {"low": 0.02, "high": 0.06},
     r"kl\.beta=20\.0 is outside \[beta_min, beta_max\] = \[0\.0001, 10\.0\]"),
    ("band", 0.0, {"low": 0.02, "high": 0.06}, r"kl\.beta=0\.0 is outside.*kind 'fixed'"),
    ("band", 0.1, {"low": 0.02, "high": 0.06, "beta_min": 1.0, "beta_max": 0.5},
     r"kl\.beta_min=1\.0 and tasks\.fairness\.kl\.beta_max=0\.5 are not a valid range"),
    ("band", 0.1, {"low": "0.02", "high": 0.06}, r"kl\.low='0\.02' must be a finite number"),
    ("fixed", -0.1, {}, r"kl\.beta=-0\.1 must be >= 0 \(0 = no KL term\)"),
    ("fixed", 0.1, {"rate": 0.1}, r"kl\.rate=0\.1 does not apply to kind 'fixed'.*no options"),
])
def test_factory_errors_name_field_value_and_fix(kind, beta, options, message):
    with pytest.raises(ConfigError, match=message):
        make_controller("fairness", kind, beta, **options)
