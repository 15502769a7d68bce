"""Console lines and per-objective metrics of a step."""

from __future__ import annotations

import math

import pytest
import torch

from mogrpo.eval.quick_eval import format_quick_eval
from mogrpo.trainer.metrics import reward_metrics


def test_quick_eval_table_has_the_documented_shape():
    evals = {
        "fairness": {"score": 0.452, "truncated_frac": 0.0, "mean_length": 64.5},
        "hallucination": {"score": 0.497, "truncated_frac": 0.0, "mean_length": 51.4},
    }
    table = format_quick_eval(20, evals, {"fairness": 0.035, "hallucination": 0.095},
                              {"fairness": 0.1, "hallucination": 0.3})
    assert table == (
        "[QuickEval@20] greedy   fairness 0.452  hallucination 0.497\n"
        "  truncated  F 0.0% H 0.0% | length  F 64.5 H 51.4\n"
        "  KL         F 0.035 H 0.095 | beta    F 0.1000 H 0.3000"
    )


def test_quick_eval_labels_stay_unique_and_missing_kl_shows_a_dash():
    evals = {name: {"score": 1.0, "truncated_frac": 0.5, "mean_length": 3.0}
             for name in ("format", "fairness")}
    table = format_quick_eval("start", evals, {"format": float("nan")}, {"format": 0.1})
    assert "FO 50.0% FA 50.0%" in table
    assert "KL         FO - FA -" in table


def test_reward_metrics_per_objective_with_missing_scores():
    nan = float("nan")
    # 2 groups x K=2 x J=2: objective 0 varies in group 0 only; objective 1 has a None.
    grouped = torch.tensor([[[1.0, 0.0], [0.0, 0.0]], [[1.0, nan], [1.0, 1.0]]])
    adv = torch.tensor([[0.7, -0.7], [0.0, 0.0]])
    m = reward_metrics("t", ["correct", "format"], [1.0, 0.5], grouped, adv)
    assert m["task/t/reward/correct/mean"] == 0.75
    assert m["task/t/reward/format/missing_frac"] == 0.25
    assert m["task/t/reward/format/mean"] == pytest.approx(1 / 3)
    assert m["task/t/reward/correct/zero_var_frac"] == 0.5
    assert m["task/t/reward/mean"] == pytest.approx(0.75 + 0.5 / 3)
    assert m["task/t/zero_var_frac"] == 0.5
    assert m["task/t/reward/format/weight"] == 0.5


def test_task_reward_mean_is_unknown_when_an_objective_scored_nothing():
    nan = float("nan")
    # the judge (objective 1) failed on every completion: its 0.5 weight is not a 0 score
    grouped = torch.tensor([[[1.0, nan], [0.0, nan]], [[1.0, nan], [1.0, nan]]])
    adv = torch.tensor([[0.7, -0.7], [0.0, 0.0]])
    m = reward_metrics("t", ["correct", "judge"], [1.0, 0.5], grouped, adv)
    assert m["task/t/reward/correct/mean"] == 0.75
    assert m["task/t/reward/judge/missing_frac"] == 1.0
    assert math.isnan(m["task/t/reward/judge/mean"]) and math.isnan(m["task/t/reward/mean"])
    # an objective weighted 0 (a schedule not started yet) does not count
    m = reward_metrics("t", ["correct", "judge"], [1.0, 0.0], grouped, adv)
    assert m["task/t/reward/mean"] == 0.75
