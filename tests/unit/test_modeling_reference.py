"""KL reference: adapters disabled under LoRA, a frozen copy otherwise, nothing when beta is 0."""

from __future__ import annotations

import torch

from mogrpo.modeling.load import LoraSettings, load_policy
from mogrpo.modeling.reference import make_reference


def _batch(tok):
    return tok(["the cat sat on", "答案 因为 the"], return_tensors="pt", padding=True)


def _logits(module, batch):
    with torch.no_grad():
        return module(**batch).logits


def test_not_needed_gives_none(tiny_model_dir):
    model, _ = load_policy(str(tiny_model_dir))
    assert make_reference(model, needed=False) is None


def test_lora_reference_is_the_base_with_no_extra_parameters(tiny_model_dir):
    policy, tok = load_policy(str(tiny_model_dir), lora=LoraSettings(r=4, dropout=0.0))
    base, _ = load_policy(str(tiny_model_dir))
    batch = _batch(tok)
    params_before = sum(p.numel() for p in policy.parameters())
    ref = make_reference(policy, needed=True)
    assert ref.kind == "adapter_disabled"
    assert sum(p.numel() for p in policy.parameters()) == params_before
    with ref.model() as ref_model:
        assert ref_model is policy  # the same weights, no copy

    # Fresh LoRA (B = 0): reference and policy agree exactly.
    with ref.model() as m:
        fresh_ref = m(**batch).logits
    assert torch.equal(fresh_ref, _logits(policy, batch))

    with torch.no_grad():
        next(p for n, p in policy.named_parameters() if "lora_B" in n).fill_(0.3)
    policy.train()
    with ref.model() as m:
        assert not torch.is_grad_enabled() and not m.training
        ref_logits = m(**batch).logits
    assert policy.training  # restored after the reference forward
    assert torch.allclose(ref_logits, _logits(base, batch), atol=1e-6)
    policy.eval()
    assert not torch.allclose(_logits(policy, batch), ref_logits, atol=1e-4)


def test_frozen_copy_does_not_follow_the_policy(tiny_model_dir):
    policy, tok = load_policy(str(tiny_model_dir))
    batch = _batch(tok)
    ref = make_reference(policy, needed=True)
    assert ref.kind == "frozen_copy"
    with ref.model() as m:
        before = m(**batch).logits
        assert not m.training and not any(p.requires_grad for p in m.parameters())
        assert m is not policy

    optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
    policy.train()
    loss = policy(**batch, labels=batch["input_ids"]).loss
    loss.backward()
    optimizer.step()
    policy.eval()
    assert not torch.allclose(_logits(policy, batch), before, atol=1e-4)
    with ref.model() as m:
        assert torch.equal(m(**batch).logits, before)
