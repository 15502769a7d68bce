"""DAPO dynamic sampling: which groups carry signal, and the refill budget's counts."""

from __future__ import annotations

import math

import pytest
import torch

from mogrpo.algo.advantages import group_advantages
from mogrpo.algo.dynamic_sampling import RefillBudget, informative_groups
from mogrpo.errors import ConfigError
from mogrpo.tracking import names

NAN = math.nan

# N = 7 groups, K = 3 completions, J = 2 objectives (A, B); weights [1, 0.5].
REWARDS = torch.tensor([
    [[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]],  # 0: A and B constant                -> drop
    [[1.0, 0.0], [0.0, 0.0], [1.0, 0.0]],  # 1: A varies                        -> keep
    [[0.0, 2.0], [1.0, 0.0], [0.0, 2.0]],  # 2: A + 0.5 B = [1, 1, 1] cancels   -> drop
    [[1.0, NAN], [NAN, NAN], [NAN, NAN]],  # 3: one scored completion           -> drop
    [[1.0, NAN], [NAN, NAN], [0.0, NAN]],  # 4: two scored, A = [1, -, 0]      -> keep
    [[NAN, NAN], [NAN, NAN], [NAN, NAN]],  # 5: nothing scored                  -> drop
    [[1.0, NAN], [1.0, 4.0], [NAN, 4.0]],  # 6: NaN takes its objective's mean -> drop
])
WEIGHTS = [1.0, 0.5]
EXPECTED = [False, True, False, False, True, False, False]


def test_hand_made_groups():
    mask = informative_groups(REWARDS, WEIGHTS)
    assert mask.dtype == torch.bool
    assert mask.tolist() == EXPECTED


def test_uninformative_groups_get_zero_advantage():
    # The filter's promise: what it drops is exactly what the advantages give nothing to.
    adv = group_advantages(REWARDS, WEIGHTS, scale="none")  # [N, K]
    zero = (adv.abs() < 1e-6).all(dim=1)
    assert (~zero).tolist() == EXPECTED


def test_weights_decide():
    # Group 2 cancels at w = [1, 0.5] but not at [1, 1]; a zero weight silences an objective.
    assert informative_groups(REWARDS[2:3], [1.0, 1.0]).tolist() == [True]
    assert informative_groups(REWARDS[1:2], [0.0, 1.0]).tolist() == [False]


def test_equal_within_tolerance():
    # 0.1 + 0.2 != 0.3 in floating point; the difference (5.6e-17) is not a signal,
    # a real difference of 1e-6 is.
    r = torch.tensor([[[0.1 + 0.2], [0.3], [0.3]], [[0.3], [0.3 + 1e-6], [0.3]]],
                     dtype=torch.float64)
    assert informative_groups(r, [1.0]).tolist() == [False, True]


def test_constant_reward_for_some_prompts_is_dropped_and_counted():
    # 4 prompts, K = 4, one rule reward that is always 1 for prompts 0 and 2.
    r = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.0, 0.0],
                      [1.0, 1.0, 1.0, 1.0], [0.5, 0.0, 1.0, 0.5]]).unsqueeze(-1)
    budget = RefillBudget(max_extra_rounds=0)
    budget.reset(target=4)
    keep = budget.observe(informative_groups(r, [1.0]))
    assert keep.tolist() == [False, True, False, True]
    assert (budget.dropped, budget.kept, budget.missing, budget.needs_refill()) == (2, 2, 2, False)


def test_errors():
    with pytest.raises(ConfigError, match="got 1 objective weights for 2 objectives"):
        informative_groups(REWARDS, [1.0])
    with pytest.raises(ValueError, match=r"rewards must be \[N, K, J\]"):
        informative_groups(torch.zeros(2, 3), [1.0])
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="max_extra_rounds=.* must be an integer >= 0"):
            RefillBudget(bad)


def test_budget_refills_until_full():
    budget = RefillBudget(max_extra_rounds=2)
    budget.reset(target=4)
    # regular rollout: 2 of 4 informative
    assert budget.observe(torch.tensor([True, False, True, False])).tolist() == [
        True, False, True, False]
    assert (budget.missing, budget.rounds, budget.needs_refill()) == (2, 0, True)
    # extra round 1: nothing useful
    assert budget.observe(torch.tensor([False, False])).tolist() == [False, False]
    assert (budget.missing, budget.rounds, budget.dropped, budget.needs_refill()) == (2, 1, 4, True)
    # extra round 2: 3 informative, only 2 needed; the third is surplus
    assert budget.observe(torch.tensor([True, True, False, True])).tolist() == [
        True, True, False, False]
    assert budget.metrics(names.DYNAMIC_SAMPLING) == {
        "rollout/dynamic_sampling/dropped": 5.0,
        "rollout/dynamic_sampling/refilled": 2.0,
        "rollout/dynamic_sampling/rounds": 2.0,
        "rollout/dynamic_sampling/surplus": 1.0,
        "rollout/dynamic_sampling/missing": 0.0,
    }
    assert budget.needs_refill() is False
    with pytest.raises(RuntimeError, match="refill budget exhausted"):
        budget.observe(torch.tensor([True]))


def test_budget_cap_leaves_the_batch_short_and_reset_clears():
    budget = RefillBudget(max_extra_rounds=1)
    budget.reset(target=3)
    budget.observe(torch.tensor([False, False, True]))
    assert budget.needs_refill()
    budget.observe(torch.tensor([False, False, False]))
    assert (budget.needs_refill(), budget.missing, budget.rounds, budget.dropped) == (False, 2, 1, 5)
    budget.reset(target=2)  # next step
    assert (budget.dropped, budget.refilled, budget.rounds, budget.kept, budget.missing) == (
        0, 0, 0, 0, 2)
    assert budget.observe(torch.tensor([True, True])).tolist() == [True, True]
    assert budget.refilled == 0  # the regular rollout is not a refill
