"""Group advantages, zero-variance fraction and reward stats against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from mogrpo.algo.advantages import group_advantages, reward_stats, zero_variance_fraction
from mogrpo.errors import ConfigError

NAN = math.nan

# N = 2 groups, K = 3 completions, J = 2 objectives (A, B); weights w = [1, 0.5].
#   group 0: A = [0, 1, 2]  (mean 1, sample std 1)   B = [4, 0, 2]  (mean 2, std 2)
#   group 1: A = [5, 1, 3]  (mean 3, std 2)          B = [0, 6, 12] (mean 6, std 6)
REWARDS = torch.tensor([
    [[0.0, 4.0], [1.0, 0.0], [2.0, 2.0]],
    [[5.0, 0.0], [1.0, 6.0], [3.0, 12.0]],
])
WEIGHTS = [1.0, 0.5]
S7, S2, S32 = math.sqrt(7.0), math.sqrt(2.0), math.sqrt(3.2)

# sum_then_normalize: r = A + 0.5 B -> g0 [2, 1, 3] (mean 2), g1 [5, 4, 9] (mean 6)
#   centred: g0 [0, -1, 1] (std 1), g1 [-1, -2, 3] (std sqrt((1 + 4 + 9) / 2) = sqrt 7)
#   batch std of all centred values: sqrt((0+1+1+1+4+9) / 5) = sqrt 3.2
# normalize_then_sum:
#   centred A: g0 [-1, 0, 1], g1 [2, -2, 0];  centred B: g0 [2, -2, 0], g1 [-6, 0, 6]
#   group: A/std -> g0 [-1, 0, 1], g1 [1, -1, 0];  B/std -> g0 [1, -1, 0], g1 [-1, 0, 1]
#          sum  -> g0 [-1 + .5, 0 - .5, 1 + 0] = [-.5, -.5, 1],  g1 [1 - .5, -1, .5]
#   batch: std(centred A) = sqrt((1+0+1+4+4+0) / 5) = sqrt 2
#          std(centred B) = sqrt((4+4+0+36+0+36) / 5) = 4
#          g0: [-1/S2 + .5 * 2/4, 0 + .5 * -2/4, 1/S2 + 0],  g1: [2/S2 - .5 * 6/4, -2/S2, .5 * 6/4]
#   none: centring commutes with the weighted sum, so it equals sum_then_normalize/none.
EXPECTED = {
    ("sum_then_normalize", "group"): [[0.0, -1.0, 1.0], [-1 / S7, -2 / S7, 3 / S7]],
    ("sum_then_normalize", "batch"): [[0.0, -1 / S32, 1 / S32], [-1 / S32, -2 / S32, 3 / S32]],
    ("sum_then_normalize", "none"): [[0.0, -1.0, 1.0], [-1.0, -2.0, 3.0]],
    ("normalize_then_sum", "group"): [[-0.5, -0.5, 1.0], [0.5, -1.0, 0.5]],
    ("normalize_then_sum", "batch"): [[-1 / S2 + 0.25, -0.25, 1 / S2],
                                      [2 / S2 - 0.75, -2 / S2, 0.75]],
    ("normalize_then_sum", "none"): [[0.0, -1.0, 1.0], [-1.0, -2.0, 3.0]],
}


@pytest.mark.parametrize("combine,scale", sorted(EXPECTED))
def test_every_mode_hand_values(combine, scale):
    adv = group_advantages(REWARDS, WEIGHTS, combine=combine, scale=scale, eps=0.0)
    assert adv.shape == (2, 3) and adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor(EXPECTED[(combine, scale)]), atol=1e-6, rtol=1e-6)


def test_different_scales_make_the_modes_differ():
    # A: correctness in [0, 1]; B: a 0-100 score. One group, weights [1, 1].
    rewards = torch.tensor([[[1.0, 0.0], [0.5, 50.0], [0.0, 100.0]]])
    # sum: r = [1, 50.5, 100] -> centred [-49.5, 0, 49.5], std 49.5 -> [-1, 0, 1]:
    # B alone decides and the only correct answer gets the worst advantage.
    summed = group_advantages(rewards, [1.0, 1.0], combine="sum_then_normalize", eps=0.0)
    torch.testing.assert_close(summed, torch.tensor([[-1.0, 0.0, 1.0]]))
    # per objective: A -> [1, 0, -1], B -> [-1, 0, 1]; sum [0, 0, 0]: both count equally.
    per_obj = group_advantages(rewards, [1.0, 1.0], combine="normalize_then_sum", eps=0.0)
    torch.testing.assert_close(per_obj, torch.zeros(1, 3))


def test_missing_value_excluded_per_objective():
    # Completion 1 could not be scored on A. A's scored mean is (1 + 0) / 2 = 0.5, so
    # A = [1, 0.5, 0] -> centred [0.5, 0, -0.5]; B = [0, 4, 2] -> centred [-2, 2, 0].
    rewards = torch.tensor([[[1.0, 0.0], [NAN, 4.0], [0.0, 2.0]]])
    none = group_advantages(rewards, [1.0, 1.0], scale="none")
    # sum: [-1.5, 2, -0.5]: completion 1 keeps exactly its B advantage, 2.
    # (Reading NaN as 0 would give A centred [2/3, -1/3, -1/3] and [-4/3, 5/3, -1/3].)
    torch.testing.assert_close(none, torch.tensor([[-1.5, 2.0, -0.5]]))
    # per objective, group std on the imputed columns: A std 0.5 -> [1, 0, -1];
    # B std 2 -> [-1, 1, 0]; sum [0, 1, -1]: completion 1 again gets its B advantage.
    per_obj = group_advantages(rewards, [1.0, 1.0], combine="normalize_then_sum", eps=0.0)
    torch.testing.assert_close(per_obj, torch.tensor([[0.0, 1.0, -1.0]]))


@pytest.mark.parametrize("combine", ["sum_then_normalize", "normalize_then_sum"])
def test_objective_missing_for_whole_group_contributes_zero(combine):
    # group 0: A unscored everywhere, B = [0, 4, 2] (mean 2, std 2) -> [-1, 1, 0] from B alone.
    # group 1: both scored, A = [1, 0, 0.5] -> [1, -1, 0], B = [2, 2, 2] -> 0 (std 0, eps).
    rewards = torch.tensor([
        [[NAN, 0.0], [NAN, 4.0], [NAN, 2.0]],
        [[1.0, 2.0], [0.0, 2.0], [0.5, 2.0]],
    ])
    adv = group_advantages(rewards, [3.0, 1.0], combine=combine)
    # with weights [3, 1]: sum mode group 0: [-2, 2, 0] / 2; group 1: 3 * [0.5, -0.5, 0] / 1.5
    # normalize mode group 0: 1 * [-1, 1, 0]; group 1: 3 * [1, -1, 0]
    expected = [[-1.0, 1.0, 0.0], [1.0, -1.0, 0.0]] if combine == "sum_then_normalize" else (
        [[-1.0, 1.0, 0.0], [3.0, -3.0, 0.0]])
    torch.testing.assert_close(adv, torch.tensor(expected), atol=1e-3, rtol=1e-3)
    assert torch.isfinite(adv).all()


def test_zero_variance_group_gets_zero_advantage_not_nan():
    rewards = torch.tensor([[[1.0], [1.0], [1.0]], [[0.0], [1.0], [0.0]]])
    for combine in ("sum_then_normalize", "normalize_then_sum"):
        for scale in ("group", "batch", "none"):
            adv = group_advantages(rewards, [1.0], combine=combine, scale=scale)
            assert (adv[0] == 0).all() and torch.isfinite(adv).all()


def test_eps_default_is_in_the_denominator():
    # [0, 1]: centred [-0.5, 0.5], sample std sqrt(0.5) = 0.7071068; eps 1e-4
    adv = group_advantages(torch.tensor([[[0.0], [1.0]]]), [1.0])
    d = 0.7071068 + 1e-4
    torch.testing.assert_close(adv, torch.tensor([[-0.5 / d, 0.5 / d]]))


def test_k1_is_an_error():
    with pytest.raises(ConfigError, match="at least 2 completions per prompt"):
        group_advantages(torch.ones(4, 1, 2), [1.0, 1.0])


@pytest.mark.parametrize("kwargs,text", [
    ({"combine": "mean"}, "sum_then_normalize"),
    ({"scale": "std"}, "'group', 'batch', 'none'"),
])
def test_unknown_mode_lists_choices(kwargs, text):
    with pytest.raises(ConfigError, match=text):
        group_advantages(REWARDS, WEIGHTS, **kwargs)


def test_weight_count_must_match_objectives():
    with pytest.raises(ConfigError, match="3 objective weights for 2 objectives"):
        group_advantages(REWARDS, [1.0, 1.0, 1.0])


def test_weights_as_tensor():
    adv = group_advantages(REWARDS, torch.tensor(WEIGHTS), scale="none")
    torch.testing.assert_close(adv, torch.tensor(EXPECTED[("sum_then_normalize", "none")]))


def test_zero_variance_fraction():
    values = torch.tensor([
        [1.0, 1.0, 1.0],  # all equal -> flat
        [0.0, 1.0, 0.0],  # varies
        [NAN, 2.0, 2.0],  # scored values equal -> flat
        [NAN, NAN, 3.0],  # < 2 scored -> flat
        [NAN, 1.0, 2.0],  # varies
    ])
    assert zero_variance_fraction(values) == pytest.approx(3 / 5)
    assert zero_variance_fraction(torch.zeros(0, 4)) == 0.0


def test_reward_stats():
    # objective 0: scored [1, 3, 5, 7] -> mean 4, sample std sqrt((9+1+1+9)/3) = 2.5819889;
    #   groups [1, 3] and [5, 7] both vary -> zero_var 0; missing 0
    # objective 1: scored [2, 2, 4] -> mean 8/3, std sqrt((4/9 + 4/9 + 16/9) / 2) = 1.1547005;
    #   group 0 [2, 2] flat, group 1 [4, NaN] < 2 scored -> zero_var 1; missing 1/4
    rewards = torch.tensor([[[1.0, 2.0], [3.0, 2.0]], [[5.0, 4.0], [7.0, NAN]]])
    stats = reward_stats(rewards)
    assert set(stats) == {"mean", "std", "missing_frac", "zero_var_frac"}
    assert stats["mean"] == pytest.approx([4.0, 8 / 3])
    assert stats["std"] == pytest.approx([2.5819889, 1.1547005])
    assert stats["missing_frac"] == pytest.approx([0.0, 0.25])
    assert stats["zero_var_frac"] == pytest.approx([0.0, 1.0])


def test_reward_stats_all_missing_objective():
    stats = reward_stats(torch.tensor([[[1.0, NAN], [2.0, NAN]]]))
    assert math.isnan(stats["mean"][1]) and math.isnan(stats["std"][1])
    assert stats["missing_frac"] == [0.0, 1.0] and stats["zero_var_frac"] == [0.0, 1.0]


class TwoProcesses:
    """Process `rank` of 2 whose `gather` returns both processes' rows (given up front)."""

    def __init__(self, rank: int, rows: list) -> None:
        self.rank, self.world_size, self.rows = rank, 2, rows

    def gather(self, value):
        sent = torch.tensor(value).reshape(-1) if value else torch.empty(0)
        mine = torch.tensor(self.rows[self.rank]).reshape(-1) if value else torch.empty(0)
        assert torch.equal(sent.nan_to_num(-1.0), mine.nan_to_num(-1.0))  # its own rows
        return self.rows


@pytest.mark.parametrize("combine", ["sum_then_normalize", "normalize_then_sum"])
def test_batch_scaling_over_processes_uses_the_std_of_every_processes_groups(combine):
    from mogrpo.trainer.grpo import all_process_advantages

    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(5, 4, 2, generator=g) * torch.tensor([1.0, 10.0])  # [N, K, J]
    rewards[3, 1, 0] = float("nan")  # a missing score travels too
    weights = [1.0, 0.5]
    whole = group_advantages(rewards, weights, combine=combine, scale="batch")
    shares = {0: [0, 2, 4], 1: [1, 3]}  # interleaved, as Dist.shard splits the groups
    rows = [rewards[shares[r]].tolist() for r in (0, 1)]
    for rank, mine in shares.items():
        got = all_process_advantages(rewards[mine], weights, combine=combine, scale="batch",
                                     dist=TwoProcesses(rank, rows))
        assert torch.allclose(got, whole[mine], atol=1e-6)
        # what each process alone would compute: a std over its own groups only
        alone = group_advantages(rewards[mine], weights, combine=combine, scale="batch")
        assert not torch.allclose(got, alone, atol=1e-3)


def test_a_process_without_groups_of_the_task_still_joins_and_gets_none():
    from mogrpo.trainer.grpo import all_process_advantages

    rewards = torch.tensor([[[1.0], [0.0]], [[0.5], [0.0]]])  # [2, K=2, J=1]
    rows = [rewards.tolist(), []]
    got = all_process_advantages(torch.empty(0, 2, 1), [1.0], combine="sum_then_normalize",
                                 scale="batch", dist=TwoProcesses(1, rows))
    assert got.shape == (0, 2)
