"""RMSNorm's closed-form backward in the training forward (algo/rms_norm.py): the same forward
bit for bit, the same gradients as autograd through Hugging Face's operations, only where the
layer's forward is exactly Llama's, and the model's own classes again after the block."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import transformers
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from mogrpo.algo.logprobs import completion_logprobs
from mogrpo.algo.rms_norm import _RMSNorm, is_llama_rms_norm


@pytest.mark.parametrize("shape", [(16, 30, 128), (3, 5, 64), (7, 48)])
def test_forward_is_bit_for_bit_and_gradients_equal_autograds(shape):
    torch.manual_seed(0)
    norm = Qwen2RMSNorm(shape[-1], eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(*shape, requires_grad=True)
    grad = torch.randn(*shape)
    expected = norm(x)
    want_x, want_w = torch.autograd.grad(expected, (x, norm.weight), grad)
    got = _RMSNorm.apply(x, norm.weight, norm.variance_epsilon)
    got_x, got_w = torch.autograd.grad(got, (x, norm.weight), grad)
    assert torch.equal(got, expected)
    torch.testing.assert_close(got_x, want_x, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_w, want_w, atol=1e-5, rtol=1e-5)


def test_only_llamas_norm_is_recognised():
    assert is_llama_rms_norm(Qwen2RMSNorm(8))
    assert not is_llama_rms_norm(GemmaRMSNorm(8))  # scales by 1 + weight: its own forward
    assert not is_llama_rms_norm(torch.nn.LayerNorm(8))


def _model(family: str) -> torch.nn.Module:
    config = getattr(transformers, f"{family}Config")(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=0, **({"head_dim": 8} if family == "Gemma" else {}))
    torch.manual_seed(0)
    return getattr(transformers, f"{family}ForCausalLM")(config)


@pytest.mark.parametrize("family", ["Qwen2", "Llama", "Gemma"])
def test_training_forward_gives_the_same_log_probs_and_gradients(family, monkeypatch):
    model = _model(family)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 64, (2, 5), generator=g).repeat_interleave(2, 0)
    completion = torch.randint(3, 64, (4, 6), generator=g)
    mask = torch.ones(4, 6, dtype=torch.long)
    calls = []
    apply = _RMSNorm.apply
    monkeypatch.setattr(_RMSNorm, "apply", lambda *a: calls.append(1) or apply(*a))

    def run(fused: bool):
        model.zero_grad(set_to_none=True)
        if not fused:
            monkeypatch.setattr("mogrpo.algo.logprobs.fused_rms_norms",
                                lambda model: nullcontext())
        logp, _ = completion_logprobs(model, prompt, torch.ones_like(prompt), completion, mask)
        logp.sum().backward()
        return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    fused_logp, fused_grads = run(fused=True)
    used = len(calls)
    plain_logp, plain_grads = run(fused=False)
    assert torch.equal(fused_logp, plain_logp)  # the forward is the same arithmetic
    for name, grad in plain_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    # Llama-style norms run the closed form (5 per forward: 2 per layer and the final one,
    # in each of the shared-prompt forward's two passes); Gemma's keep their own forward
    assert used == (0 if family == "Gemma" else 10)
    assert all(type(m).__name__.startswith(family) for m in model.modules()
               if type(m).__name__.endswith("RMSNorm"))  # the classes restored

