"""One source for the algorithm's option names: what the config accepts is what algo/ computes."""

from __future__ import annotations

from typing import get_args

import pytest
import torch

from mogrpo.algo.advantages import group_advantages
from mogrpo.algo.choices import (
    ALL_AGGREGATIONS,
    COMBINE_MODES,
    IMPORTANCE_SAMPLING_LEVELS,
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    KL_IMPORTANCE_WEIGHTS,
    LOSS_TYPES,
    SCALE_MODES,
)
from mogrpo.algo.kl import kl_estimate
from mogrpo.algo.kl_control import make_controller
from mogrpo.algo.loss import loss_normalizer
from mogrpo.config import AlgorithmConfig, KLControlConfig


@pytest.mark.parametrize(("model", "field", "names"), [
    (AlgorithmConfig, "advantage_combine", COMBINE_MODES),
    (AlgorithmConfig, "advantage_scaling", SCALE_MODES),
    (AlgorithmConfig, "kl_estimator", KL_ESTIMATORS),
    (AlgorithmConfig, "loss_type", LOSS_TYPES),
    (AlgorithmConfig, "kl_importance_weight", KL_IMPORTANCE_WEIGHTS),
    (AlgorithmConfig, "importance_sampling_level", IMPORTANCE_SAMPLING_LEVELS),
    (KLControlConfig, "kind", KL_CONTROLLERS),
])
def test_the_config_accepts_exactly_the_names_algo_dispatches_on(model, field, names):
    assert get_args(model.model_fields[field].annotation) == names


def test_the_config_accepts_every_loss_aggregation_or_none():
    literal, none = get_args(AlgorithmConfig.model_fields["loss_aggregation"].annotation)
    assert get_args(literal) == ALL_AGGREGATIONS and none is type(None)


@pytest.mark.parametrize("name", ALL_AGGREGATIONS)
def test_every_loss_aggregation_has_its_normaliser(name):
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])  # 2 sequences, 3 tokens, budget 4
    expected = {"seq_mean": 2.0, "token_mean": 3.0, "fixed_length": 8.0, "seq_sum": 2.0,
                "micro_token_mean": 3.0}  # BNPO: the number of micro-batches
    assert loss_normalizer(mask, AlgorithmConfig(loss_aggregation=name).loss_aggregation, 4,
                           micro_batches=3) == expected[name]


@pytest.mark.parametrize("name", KL_ESTIMATORS)
def test_every_kl_estimator_is_zero_at_the_reference(name):
    logp = torch.tensor([[-1.0, -2.0]])
    assert torch.equal(kl_estimate(logp, logp.clone(), AlgorithmConfig(kl_estimator=name)
                                   .kl_estimator), torch.zeros(1, 2))


@pytest.mark.parametrize("combine", COMBINE_MODES)
@pytest.mark.parametrize("scale", SCALE_MODES)
def test_every_advantage_mode_centres_each_group(combine, scale):
    config = AlgorithmConfig(advantage_combine=combine, advantage_scaling=scale)
    rewards = torch.tensor([[[0.0, 1.0], [1.0, 1.0], [2.0, 0.0], [3.0, 0.0]]])  # [1, K=4, J=2]
    adv = group_advantages(rewards, [1.0, 1.0], combine=config.advantage_combine,
                           scale=config.advantage_scaling)
    assert adv.shape == (1, 4)
    assert float(adv.sum()) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("kind", KL_CONTROLLERS)
def test_every_kl_controller_kind_builds(kind):
    options = {"fixed": {}, "band": {"low": 0.02, "high": 0.06}, "proportional": {"target": 0.05},
               "dual": {"low": 0.02, "high": 0.06}}
    config = KLControlConfig(kind=kind, **options[kind])
    assert make_controller("fairness", config.kind, 0.1, **config.options()).kind == kind
