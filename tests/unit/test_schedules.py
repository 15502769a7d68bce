"""Reward-weight schedules: values at hand-picked steps, config parsing and its errors."""

from __future__ import annotations

import re

import pytest

from mogrpo.algo.schedules import WeightSchedule, from_config
from mogrpo.errors import ConfigError


def test_constant():
    s = WeightSchedule()
    assert [s.at(step) for step in (0, 10, 10**6)] == [1.0, 1.0, 1.0]
    assert from_config(2).at(5) == 2.0 and isinstance(from_config(2).at(5), float)
    assert from_config(-0.5) == WeightSchedule(kind="constant", value=-0.5)
    assert from_config({"value": 0.3}).at(100) == 0.3


def test_linear_ramp_hand_values():
    s = from_config({"kind": "linear", "start": 0.0, "end": 1.0, "start_step": 10, "end_step": 20})
    # before start_step: start; at 15: halfway; from end_step on: end
    assert [s.at(step) for step in (0, 10, 12, 15, 20, 30)] == [0.0, 0.0, 0.2, 0.5, 1.0, 1.0]


def test_linear_decreasing_from_step_zero():
    s = WeightSchedule(kind="linear", start=1.0, end=0.2, end_step=200)
    # 1.0 + (0.2 - 1.0) * 50 / 200 = 0.8
    assert s.at(0) == 1.0
    assert s.at(50) == pytest.approx(0.8)
    assert s.at(200) == pytest.approx(0.2) and s.at(1000) == pytest.approx(0.2)


W = "tasks.fairness.rewards[0].weight"
WR = re.escape(W)


@pytest.mark.parametrize("obj,message", [
    ({"kind": "cosine"}, rf"{WR}\.kind='cosine' is not supported; choose one of "
                         r"\['constant', 'linear'\]"),
    ({"kind": "linear", "end": 1.0, "end_step": 10}, rf"{WR}\.start is required for kind 'linear'"),
    ({"kind": "linear", "start": 1.0, "end_step": 10}, rf"{WR}\.end is required"),
    ({"kind": "linear", "start": 0.0, "end": 1.0},
     rf"{WR}\.end_step=0 must be after start_step=0; set end_step"),
    ({"kind": "linear", "start": 0.0, "end": 1.0, "start_step": 5, "end_step": 5},
     r"end_step=5 must be after start_step=5"),
    ({"kind": "linear", "start": 0.0, "end": 1.0, "start_step": -1, "end_step": 5},
     rf"{WR}\.start_step=-1 must be an integer step >= 0"),
    ({"kind": "linear", "start": 0.0, "end": 1.0, "end_step": 2.5}, r"end_step=2\.5 must be an"),
    ({"kind": "linear", "start": 0.0, "end": float("nan"), "end_step": 5},
     rf"{WR}\.end=nan must be a finite number"),
    ({"kind": "linear", "value": 1.0, "start": 0.0, "end": 1.0, "end_step": 5},
     rf"{WR}\.value does not apply to kind 'linear'"),
    ({"start": 0.0, "end": 1.0, "end_step": 5},
     rf"{WR}: start/end are set but kind is 'constant'; set kind: linear"),
    ({"value": "high"}, rf"{WR}\.value='high' must be a finite number"),
    ({"stop": 3}, rf"{WR}\.stop is not a schedule field; use one of \['kind', 'value'"),
    (True, rf"{WR}=True must be a number or a mapping"),
    ("1.0", rf"{WR}='1\.0' must be a number or a mapping"),
])
def test_errors_name_field_value_and_fix(obj, message):
    with pytest.raises(ConfigError, match=message):
        from_config(obj, where=W)


def test_direct_construction_is_validated_too():
    with pytest.raises(ConfigError, match=r"^weight\.end_step=0 must be after start_step=0"):
        WeightSchedule(kind="linear", start=0.0, end=1.0)
