"""mogrpo's loss against TRL 1.16's own `GRPOTrainer._compute_loss`, on the same tensors.

TRL's loss is a method that starts with a model forward. The test runs its real code: a
GRPOTrainer made without `__init__`, given the attributes `_compute_loss` reads, whose
`_get_per_token_logps_and_entropies` returns the test's log-prob tensor instead of running a
model. Both sides then see identical log-probs, so position ids play no part here. (They do
in a real run: TRL's forward passes no position ids, so a left-padded prompt's tokens sit at
shifted positions; mogrpo scores with `cumsum(attention_mask) - 1`, the positions `generate`
used, so training scores the distribution that sampled — a deliberate difference of ~1e-6 in
the loss of padded rows.)

For every loss type × importance-sampling level × KL (off, plain, bias-corrected) × on/off
policy × truncation masking × gradient accumulation (1 or 2 micro-batches), the summed loss
and the gradient with respect to the log-probs agree to 1e-6.
"""

from __future__ import annotations

import itertools
import zlib
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from mogrpo.algo.loss import grpo_loss, loss_normalizer
from mogrpo.algo.surrogates import DEFAULT_AGGREGATION, LOSS_TYPES, LossVariant, mask_truncated

trl = pytest.importorskip("trl")
from trl import GRPOTrainer  # noqa: E402

B, T, MAX_LEN = 6, 7, 8
EPS_LOW, EPS_HIGH = 0.2, 0.28
KL_MODES = {"none": (0.0, "off"), "k3": (0.04, "off"), "bias_corrected": (0.04, "differentiable")}
TRL_PARAMS = dict(delta=None, sapo_temperature_pos=0.9, sapo_temperature_neg=1.1,
                  vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0)


def make_tensors(seed: int, off_policy: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 3, 5, 1, 6, 4])
    mask = (torch.arange(T)[None] < lengths[:, None]).long()  # [B, T] right-padded
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3  # real values at pads too
    shift = 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    return {
        "logp": logp,
        "old_logp": logp + shift if off_policy else None,
        "ref_logp": logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64),
        "advantages": torch.tensor([1.2, -0.7, 0.0, 0.9, -1.5, 0.4], dtype=torch.float64),
        "mask": mask,
        "truncated": torch.tensor([True, False, False, False, True, False]),
    }


def trl_trainer(loss_type: str, level: str, beta: float, bias_kl: bool, micro: int,
                delta: float | None) -> GRPOTrainer:
    """A GRPOTrainer with only what `_compute_loss` reads (no model, no accelerator state)."""
    trainer = object.__new__(GRPOTrainer)
    trainer.args = SimpleNamespace(**{**TRL_PARAMS, "delta": delta},
                                   use_bias_correction_kl=bias_kl, steps_per_generation=micro)
    trainer.loss_type, trainer.importance_sampling_level, trainer.beta = loss_type, level, beta
    trainer.epsilon_low = EPS_LOW
    # TRL's cispo reads epsilon_high as its ratio cap ε_max (mogrpo: cispo_max_ratio)
    trainer.epsilon_high = 1.5 if loss_type == "cispo" else EPS_HIGH
    trainer.top_entropy_quantile, trainer.off_policy_mask_threshold = 1.0, None
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = False
    trainer.aux_loss_enabled = trainer._entropy_bonus_enabled = False
    trainer.current_gradient_accumulation_steps = micro
    trainer.max_completion_length = MAX_LEN
    trainer.model = SimpleNamespace(training=True)
    trainer.accelerator = SimpleNamespace(
        num_processes=1, gather=lambda x: x, gather_for_metrics=lambda x: x,
        reduce=lambda x, reduction: x)
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    return trainer


def trl_loss(trainer: GRPOTrainer, data: dict, mask: torch.Tensor, logp: torch.Tensor,
             splits: list[list[int]]) -> torch.Tensor:
    total = 0.0
    for rows in splits:
        idx = torch.tensor(rows)
        part = logp[idx]
        trainer._get_per_token_logps_and_entropies = (
            lambda *args, _part=part, **kwargs: (_part, torch.zeros_like(_part), None))
        inputs = {
            "prompt_ids": torch.zeros(len(rows), 1, dtype=torch.long),
            "prompt_mask": torch.ones(len(rows), 1, dtype=torch.long),
            "completion_ids": torch.zeros(len(rows), T, dtype=torch.long),
            "completion_mask": mask[idx],
            "advantages": data["advantages"][idx],
            "ref_per_token_logps": data["ref_logp"][idx],
            "num_items_in_batch": mask.sum(),  # the whole generation batch's tokens
        }
        if data["old_logp"] is not None:
            inputs["old_per_token_logps"] = data["old_logp"][idx]
        total = total + trainer._compute_loss(None, inputs)
    return total


def mogrpo_loss(variant: LossVariant, data: dict, mask: torch.Tensor, logp: torch.Tensor,
                splits: list[list[int]], beta: float, kl_weight: str) -> torch.Tensor:
    aggregation = DEFAULT_AGGREGATION[variant.loss_type]
    normalizer = loss_normalizer(mask, aggregation, MAX_LEN, micro_batches=len(splits))
    total = 0.0
    for rows in splits:
        idx = torch.tensor(rows)
        old = data["old_logp"][idx] if data["old_logp"] is not None else logp[idx].detach()
        out = grpo_loss(logp[idx], old, data["advantages"][idx], mask[idx],
                        normalizer=normalizer, aggregation=aggregation, epsilon_low=EPS_LOW,
                        epsilon_high=EPS_HIGH, ref_logp=data["ref_logp"][idx], beta=beta,
                        kl_importance_weight=kl_weight, variant=variant)
        total = total + out.loss
    return total


CASES = list(itertools.product(LOSS_TYPES, ("token", "sequence"), KL_MODES,
                               ("on_policy", "off_policy"), (False, True), (1, 2)))


@pytest.mark.parametrize("loss_type,level,kl,policy,mask_trunc,micro", CASES)
def test_loss_and_gradient_match_trl(loss_type, level, kl, policy, mask_trunc, micro):
    seed = zlib.crc32(f"{loss_type}/{level}".encode()) % 1000  # the same tensors every run
    data = make_tensors(seed=seed, off_policy=policy == "off_policy")
    beta, kl_weight = KL_MODES[kl]
    mask = mask_truncated(data["mask"], data["truncated"]) if mask_trunc else data["mask"]
    splits = [list(range(B))] if micro == 1 else [[0, 1, 2], [3, 4, 5]]
    variant = LossVariant(loss_type=loss_type, importance_sampling_level=level,
                          cispo_max_ratio=1.5, sapo_temperature_pos=0.9,
                          sapo_temperature_neg=1.1)

    ours_logp = data["logp"].clone().requires_grad_(True)
    ours = mogrpo_loss(variant, data, mask, ours_logp, splits, beta, kl_weight)
    ours.backward()
    theirs_logp = data["logp"].clone().requires_grad_(True)
    trainer = trl_trainer(loss_type, level, beta, kl_weight == "differentiable", micro, None)
    theirs = trl_loss(trainer, data, mask, theirs_logp, splits)
    theirs.backward()

    assert theirs_logp.grad.abs().max() > 1e-3  # a gradient that is not trivially zero
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-6, rel=1e-6)
    torch.testing.assert_close(ours_logp.grad, theirs_logp.grad, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_two_sided_clipping_matches_trl(loss_type):
    data = make_tensors(seed=7, off_policy=True)
    variant = LossVariant(loss_type=loss_type, delta=1.1)
    ours_logp = data["logp"].clone().requires_grad_(True)
    ours = mogrpo_loss(variant, data, data["mask"], ours_logp, [list(range(B))], 0.0, "off")
    ours.backward()
    theirs_logp = data["logp"].clone().requires_grad_(True)
    trainer = trl_trainer(loss_type, "token", 0.0, False, 1, delta=1.1)
    theirs = trl_loss(trainer, data, data["mask"], theirs_logp, [list(range(B))])
    theirs.backward()
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-6, rel=1e-6)
    torch.testing.assert_close(ours_logp.grad, theirs_logp.grad, atol=1e-6, rtol=1e-6)


def test_clip_fraction_matches_trl_region_mean():
    data = make_tensors(seed=3, off_policy=True)
    logp = data["logp"].clone().requires_grad_(True)
    out = grpo_loss(logp, data["old_logp"], data["advantages"], data["mask"], normalizer=1.0,
                    aggregation="token_mean", epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH)
    trainer = trl_trainer("dapo", "token", 0.0, False, 1, None)
    trl_loss(trainer, data, data["mask"], logp, [list(range(B))])
    ours = out.clip_frac_tokens.item() / out.num_tokens
    assert ours > 0
    assert ours == pytest.approx(trainer._metrics["train"]["clip_ratio/region_mean"][0], abs=1e-7)  # TRL counts in float32
