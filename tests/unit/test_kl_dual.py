"""The `dual` KL controller (β as the multiplier of the KL constraint, PI on log β): hand
values, a simulated plant from β 10x off in both directions, no limit cycle, warm-up, state."""

from __future__ import annotations

import json
import math
import random

import pytest

from mogrpo.algo.kl_control import DualKL, make_controller
from mogrpo.config.sections import KLControlConfig
from mogrpo.errors import ConfigError

LOW, HIGH = 0.01, 0.05
CENTRE = math.sqrt(LOW * HIGH)
BOUND = 150  # steps: the bound the controller's docstring states


def test_one_update_by_hand():
    ctrl = DualKL("fairness", 0.02, low=LOW, high=HIGH, kp=0.5, ki=0.3)
    # the quiet middle: half the band's log-width around its centre, 0.01 * 5^0.25 .. 0.05 / 5^0.25
    assert (ctrl.quiet_low, ctrl.quiet_high) == (pytest.approx(LOW * 5 ** 0.25),
                                                 pytest.approx(HIGH / 5 ** 0.25))
    # first update: e = ln(0.25 / 0.03344) = 2.01 -> clipped 1.5; no earlier error, so the
    # proportional term is 0: ln beta += 0.3 * 1.5 = 0.45
    change = ctrl.update(0.25, 20)
    assert ctrl.beta == pytest.approx(0.02 * math.exp(0.45), rel=1e-12)
    assert change.format() == "[KL@20] fairness KL 0.250 > 0.050: beta 0.0200 -> 0.0314"
    # second: e = ln(0.04 / 0.03344) = 0.179; 0.3 * 0.179 + 0.5 * (0.179 - 1.5) = -0.607
    e = math.log(0.04 / ctrl.quiet_high)
    before = ctrl.beta
    change = ctrl.update(0.04, 40)
    assert ctrl.beta == pytest.approx(before * math.exp(0.3 * e + 0.5 * (e - 1.5)), rel=1e-12)
    assert change.reason == "KL 0.040 in band 0.010-0.050"
    # inside the quiet middle the error is 0: only the proportional term's memory moves beta
    before = ctrl.beta
    ctrl.update(CENTRE, 60)
    assert ctrl.beta == pytest.approx(before * math.exp(0.5 * (0 - e)), rel=1e-12)
    before = ctrl.beta
    assert ctrl.update(0.02, 80) is None and ctrl.beta == before  # quiet, and so was the last


def test_quiet_zero_steers_to_the_centre():
    ctrl = DualKL("t", 0.02, low=LOW, high=HIGH, kp=0, ki=0.3, quiet=0)
    ctrl.update(0.04, 10)
    assert ctrl.beta == pytest.approx(0.02 * math.exp(0.3 * math.log(0.04 / CENTRE)), rel=1e-12)


def test_a_step_is_capped_and_beta_clamped():
    ctrl = DualKL("t", 0.02, low=LOW, high=HIGH, kp=2.0, ki=2.0)
    ctrl.update(10.0, 1)  # 2 * 1.5 = 3 -> capped at ln 2
    assert ctrl.beta == pytest.approx(0.04, rel=1e-12)
    ctrl = DualKL("t", 9.0, low=LOW, high=HIGH, kp=0, ki=2.0)
    ctrl.update(10.0, 1)
    assert ctrl.beta == 10.0  # clamped at beta_max
    assert ctrl.update(10.0, 2) is None  # at the bound: no change, no record
    ctrl.update(0.0, 3)  # no KL at all: the largest step down (e = -1.5 -> capped ln 2)
    assert ctrl.beta == pytest.approx(5.0, rel=1e-12)


def test_nan_kl_is_no_measurement():
    ctrl = DualKL("t", 0.02, low=LOW, high=HIGH)
    assert ctrl.update(float("nan"), 1) is None and ctrl.beta == 0.02


def test_during_the_warm_up_beta_rises_but_does_not_fall():
    ctrl = DualKL("t", 0.02, low=LOW, high=HIGH, warmup_steps=30)
    assert ctrl.update(0.0, 10) is None and ctrl.beta == 0.02  # KL 0 at the start: held
    ctrl.update(1.0, 20)
    assert ctrl.beta > 0.02  # far above the band: raised even in the warm-up
    high = ctrl.beta
    ctrl.update(0.0, 40)  # after it: lowered
    assert ctrl.beta < high


def test_the_kls_rise_from_zero_in_the_warm_up_is_no_kick():
    """The proportional term starts after the warm-up: a KL that rose from 0 into the band
    during it leaves beta where it was (no jump from the -1.5 of the first measurements)."""
    ctrl = DualKL("t", 0.02, low=LOW, high=HIGH, warmup_steps=20)
    ctrl.update(0.0, 10)
    ctrl.update(CENTRE, 30)  # the first update after the warm-up: e = 0
    assert ctrl.beta == 0.02


def test_state_round_trips_and_the_run_continues_identically():
    kls = [0.3, 0.2, 0.08, 0.04, 0.01, 0.02, 0.03]
    a = DualKL("t", 0.02, low=LOW, high=HIGH)
    for step, kl in enumerate(kls[:4], 1):
        a.update(kl, step)
    state = json.loads(json.dumps(a.state_dict()))  # JSON-safe, as checkpoints store it
    b = DualKL("t", 0.02, low=LOW, high=HIGH)
    b.load_state_dict(state)
    for step, kl in enumerate(kls[4:], 5):
        a.update(kl, step)
        b.update(kl, step)
        assert a.beta == b.beta
    with pytest.raises(ConfigError, match="holds the state of a 'dual' controller"):
        make_controller("t", "band", 0.02, low=LOW, high=HIGH).load_state_dict(state)


def _plant(beta0: float, power: float, seed: int, steps: int = 400, tau: float = 20,
           every: int = 10, delay: int = 3, noise: float = 0.6) -> tuple[list[float], list[float]]:
    """KL of a policy under a KL penalty: it relaxes toward its equilibrium c / beta^power
    (the optimum of E[A] - beta KL moves less the larger beta) with a `tau`-step time
    constant, answers beta `delay` steps late, and is measured with log-normal noise (a step's
    KL from a few hundred sampled tokens); the controller sees the mean of each `every` steps,
    as the trainer feeds it. c puts the band's centre at beta 0.05. Returns the true KL and
    beta per step."""
    rng = random.Random(seed)
    c = CENTRE * 0.05 ** power
    ctrl = DualKL("t", beta0, low=LOW, high=HIGH)
    kl, betas, kls, window = 0.0, [], [], []  # the policy starts at the reference: KL 0
    for step in range(1, steps + 1):
        betas.append(ctrl.beta)
        seen = betas[max(0, len(betas) - 1 - delay)]
        kl += (c / seen ** power - kl) / tau
        kls.append(kl)
        window.append(kl * math.exp(noise * rng.gauss(0, 1) - noise ** 2 / 2))
        if step % every == 0:
            ctrl.update(sum(window) / len(window), step)
            window = []
    return kls, betas


@pytest.mark.parametrize("tau", [10, 20])
@pytest.mark.parametrize("power", [1.0, 2.0])
@pytest.mark.parametrize("factor", [0.1, 10.0])
def test_from_beta_10x_off_it_settles_in_the_band_within_the_bound(tau, power, factor):
    """Settled: the true KL inside the band at every step from then on (400 steps)."""
    for seed in range(5):
        kls, _ = _plant(0.05 * factor, power, seed, tau=tau)
        outside = [i for i, kl in enumerate(kls) if not LOW <= kl <= HIGH]
        settled = outside[-1] + 1 if outside else 0
        assert settled <= BOUND, (seed, settled)


@pytest.mark.parametrize("factor", [0.1, 10.0])
def test_without_noise_beta_settles_no_limit_cycle(factor):
    kls, betas = _plant(0.05 * factor, 2.0, seed=0, noise=0.0, steps=600)
    tail = betas[-200:]
    assert max(tail) / min(tail) < 1.01  # settled, not cycling
    ctrl = DualKL("t", 0.05, low=LOW, high=HIGH)
    assert ctrl.quiet_low * 0.97 <= kls[-1] <= ctrl.quiet_high * 1.03  # in the quiet middle


def test_the_band_controllers_cannot_do_the_same():
    """Why `dual` exists: the `band` rule (±10 % per update) from beta 10x too small does not
    reach the band in 250 steps on the same plant."""
    rng = random.Random(0)
    c = CENTRE * 0.05 ** 2
    ctrl = make_controller("t", "band", 0.005, low=LOW, high=HIGH, rate=0.1)
    kl, window, kls = 0.0, [], []
    for step in range(1, 251):
        kl += (c / ctrl.beta ** 2 - kl) / 20
        kls.append(kl)
        window.append(kl * math.exp(0.4 * rng.gauss(0, 1) - 0.08))
        if step % 20 == 0:
            ctrl.update(sum(window) / len(window), step)
            window = []
    assert not any(LOW <= k <= HIGH for k in kls)


def test_a_band_without_a_kind_is_held_by_dual():
    assert KLControlConfig(low=0.01, high=0.05).kind == "dual"
    assert KLControlConfig(kind="band", low=0.01, high=0.05).kind == "band"
    assert KLControlConfig().kind == "fixed"
    cfg = KLControlConfig(low=0.01, high=0.05, warmup_steps=20, kp=0.4)
    ctrl = make_controller("t", cfg.kind, 0.02, **cfg.options())
    assert (ctrl.kind, ctrl.warmup_steps, ctrl.kp, ctrl.ki) == ("dual", 20, 0.4, 0.2)
    assert DualKL("t", 0.02, low=LOW, high=HIGH).kp == 0.3  # the default
    assert cfg.band() == (0.01, 0.05) and cfg.kl_budget() == 0.05


@pytest.mark.parametrize("options, message", [
    ({"low": 0.05, "high": 0.01}, r"tasks.t.kl.low=0.05 and tasks.t.kl.high=0.01 must satisfy"),
    ({"low": 0.0, "high": 0.01}, "0 < low < high"),
    ({"low": 0.01, "high": 0.05, "ki": 0}, "need kp >= 0 and ki > 0"),
    ({"low": 0.01, "high": 0.05, "max_step": 3}, r"tasks.t.kl.max_step=3 must be in \(0, 2\]"),
    ({"low": 0.01, "high": 0.05, "quiet": 1}, r"tasks.t.kl.quiet=1 must be in \[0, 1\)"),
    ({"low": 0.01}, "tasks.t.kl.high is required for kind 'dual'"),
    ({"low": 0.01, "high": 0.05, "rate": 0.1}, "rate=0.1 does not apply to kind 'dual'"),
])
def test_mistakes_name_the_field(options, message):
    with pytest.raises(ConfigError, match=message):
        make_controller("t", "dual", 0.02, **options)


def test_beta_zero_is_refused():
    with pytest.raises(ConfigError, match="must be > 0 for kind 'dual'"):
        make_controller("t", "dual", 0.0, low=0.01, high=0.05, beta_min=0.0)


def test_small_moves_are_logged_once_they_add_up_to_ten_percent():
    ctrl = DualKL("t", 0.02, low=LOW, high=HIGH, kp=0, ki=0.2)
    kl = ctrl.quiet_high * math.exp(0.2)  # e = 0.2: ln beta += 0.04 a time (4 %)
    records = [ctrl.update(kl, step) for step in (10, 20, 30)]
    assert records[:2] == [None, None] and ctrl.beta == pytest.approx(0.02 * math.exp(0.12))
    # the third brings it to +12.7 %: one line from the last logged beta
    assert records[2].format() == "[KL@30] t KL 0.041 in band 0.010-0.050: beta 0.0200 -> 0.0225"
