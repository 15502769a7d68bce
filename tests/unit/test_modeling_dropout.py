"""Model dropout off at load: GPT-2 / OPT (dropout 0.1) score identically in every GRPO pass."""

from __future__ import annotations

import json

import pytest
import torch

from architectures import build_family
from mogrpo import kernels
from mogrpo.algo.logprobs import completion_logprobs
from mogrpo.algo.loss import grpo_loss
from mogrpo.modeling import active_dropout, make_reference
from mogrpo.modeling.load import LoraSettings, load_policy, save_model

# Dropout 0.1 everywhere each family can have it: GPT-2's resid/embd/attn_pdrop (modules),
# OPT's dropout / attention_dropout / activation_dropout (float rates on modules, handed to
# SDPA), Falcon's hidden/attention dropout (read from the config at every forward).
DROPOUT = {
    "gpt2": {},
    "opt": {"attention_dropout": 0.1, "activation_dropout": 0.1},
    "falcon": {"hidden_dropout": 0.1, "attention_dropout": 0.1},
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, tiny_texts):
    root = tmp_path_factory.mktemp("dropout")
    return {f: build_family(root / f, f, tiny_texts, **changes) for f, changes in DROPOUT.items()}


def batch(tok, seed: int = 0):
    """Left-padded prompts and right-padded completions, as a rollout hands them over."""
    enc = tok(["the cat sat on the mat because", "答案 因为", "yes no A B C D option"],
              return_tensors="pt", padding=True)
    g = torch.Generator().manual_seed(seed)
    completion_ids = torch.randint(10, len(tok), (3, 6), generator=g)  # [B, C]
    completion_mask = (torch.arange(6) < torch.tensor([6, 3, 5])[:, None]).long()  # [B, C]
    return enc["input_ids"], enc["attention_mask"], completion_ids, completion_mask


@pytest.mark.parametrize("family", list(DROPOUT))
def test_two_train_mode_passes_agree_bit_for_bit(model_dirs, family):
    policy, tok = load_policy(str(model_dirs[family]))
    assert active_dropout(policy) == {}
    policy.train()
    args = batch(tok)
    with torch.no_grad():
        first, _ = completion_logprobs(policy, *args)
        second, _ = completion_logprobs(policy, *args)
    assert torch.equal(first, second)

    # the same model with its dropout kept: train-mode passes differ (what the switch removes)
    noisy, _ = load_policy(str(model_dirs[family]), disable_dropout=False)
    assert active_dropout(noisy)
    noisy.train()
    with torch.no_grad():
        a, _ = completion_logprobs(noisy, *args)
        b, _ = completion_logprobs(noisy, *args)
    assert (a - b).abs().max() > 1e-3


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("family", ["gpt2", "opt"])
def test_step_one_kl_is_zero_and_ratios_are_one(model_dirs, family, lora):
    """The GRPO passes of step 1: old log-probs (no grad), reference, then the update in
    train mode. Policy = reference, so KL must be exactly 0 and every ratio exactly 1."""
    settings = LoraSettings(r=4, dropout=0.1) if lora else None
    policy, tok = load_policy(str(model_dirs[family]), lora=settings)
    reference = make_reference(policy, needed=True)
    policy.train()
    args = batch(tok, seed=1)
    with torch.no_grad():
        old, _ = completion_logprobs(policy, *args, products=kernels.products())
        with reference.model() as ref_model:
            ref, _ = completion_logprobs(ref_model, *args, products=kernels.products())
    logp, _ = completion_logprobs(policy, *args, products=kernels.products())
    mask = args[3]
    out = grpo_loss(logp, old, torch.tensor([1.0, -0.5, 0.3]), mask, normalizer=3.0,
                    ref_logp=ref, beta=0.04)
    ratio = torch.exp(logp.detach() - old)[mask.bool()]
    assert torch.equal(ratio, torch.ones_like(ratio))
    assert torch.equal(out.kl, torch.zeros(3)) and out.clip_frac_tokens == 0


def test_lora_dropout_stays_as_configured(model_dirs):
    policy, tok = load_policy(str(model_dirs["gpt2"]), lora=LoraSettings(r=4, dropout=0.1))
    rates = [m.p for n, m in policy.named_modules()
             if n.endswith("lora_dropout.default")]
    assert rates == [0.1] * 8  # c_attn, c_proj, c_fc, c_proj in each of 2 blocks
    assert active_dropout(policy) == {}  # the model's own dropout is off
    with torch.no_grad():  # a trained adapter: its dropout now changes the output
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)
    policy.train()
    args = batch(tok)
    with torch.no_grad():
        a, _ = completion_logprobs(policy, *args, products=kernels.products())
        b, _ = completion_logprobs(policy, *args, products=kernels.products())
    assert not torch.equal(a, b)


def test_saved_config_keeps_the_checkpoint_dropout(model_dirs, tmp_path):
    policy, tok = load_policy(str(model_dirs["opt"]))
    paths = save_model(policy, tok, tmp_path)
    saved = json.loads((paths["model"] / "config.json").read_text())
    assert (saved["dropout"], saved["attention_dropout"], saved["activation_dropout"]) == (
        0.1, 0.1, 0.1)
    assert policy.config.dropout == 0.0  # training goes on without it
