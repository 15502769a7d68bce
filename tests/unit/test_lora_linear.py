"""peft's LoRA layers with a fused CPU forward and backward: the values, gradients and dropout
masks of peft's own forward; the base layer's output to the bit while B = 0; peft's forward
wherever the fused one would compute something else. Every test runs on both training kernels
(oneDNN and MKL: `cpu_linear.training_on_onednn`), whatever this machine's CPU."""

from __future__ import annotations

import pytest
import torch
import transformers
from peft.tuners.lora import Linear as PeftLinear

from mogrpo import kernels
from mogrpo.algo.logprobs import completion_logprobs
from mogrpo.kernels.cpu import linear as cpu_linear
from mogrpo.kernels.cpu import lora_linear
from mogrpo.modeling.load import LoraSettings, apply_lora


@pytest.fixture(autouse=True, params=["onednn", "mkl"])
def kernel(request, monkeypatch):
    if request.param == "onednn" and not cpu_linear.available():
        pytest.skip("this torch has no oneDNN")
    monkeypatch.setattr(cpu_linear, "training_on_onednn", lambda: request.param == "onednn")
    return request.param


def _model(dropout: float, seed: int = 0) -> torch.nn.Module:
    config = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    model = apply_lora(transformers.Qwen2ForCausalLM(config),
                       LoraSettings(r=4, alpha=8, dropout=dropout, target_modules="all-linear"))
    with torch.no_grad():  # trained adapters: B away from its zero start
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.2)
    return model.train()


def _lora_layers(model):
    return [m for m in model.modules() if isinstance(m, PeftLinear)]


def _run(model, fused: bool, ids, seed=7):
    """Log-probs and every trainable gradient, through the fused layers or peft's forward."""
    layers = _lora_layers(model)
    for layer in layers:
        layer.__class__ = lora_linear._fused_class() if fused else PeftLinear
    model.zero_grad()
    torch.manual_seed(seed)  # the same dropout masks for both
    with cpu_linear.cpu_linears(model):
        logits = model(input_ids=ids).logits
    logits.float().log_softmax(-1).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    for layer in layers:
        layer.__class__ = lora_linear._fused_class()
    return logits.detach(), grads


@pytest.mark.parametrize("dropout", [0.0, 0.1, 0.4])
def test_values_gradients_and_masks_equal_peft(dropout, monkeypatch):
    model = _model(dropout)
    ids = torch.randint(1, 64, (3, 9))
    calls = []
    apply = lora_linear._LoraLinear.apply
    monkeypatch.setattr(lora_linear._LoraLinear, "apply",
                        lambda *a: calls.append(1) or apply(*a))
    fused, fused_grads = _run(model, True, ids)
    assert len(calls) == 14  # every adapted projection of both layers took the fused path
    peft, peft_grads = _run(model, False, ids)
    assert len(calls) == 14
    torch.testing.assert_close(fused, peft, atol=1e-5, rtol=1e-5)
    assert fused_grads.keys() == peft_grads.keys() and len(fused_grads) == 28
    for name, grad in fused_grads.items():
        torch.testing.assert_close(grad, peft_grads[name], atol=1e-6, rtol=1e-4, msg=name)
    if dropout > 0:  # another seed: other masks, so the dropout really acted
        other, _ = _run(model, True, ids, seed=8)
        assert not torch.allclose(other, fused, atol=1e-4)


def test_fresh_adapters_leave_the_base_output_bit_for_bit():
    config = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    base = transformers.Qwen2ForCausalLM(config).eval()
    ids = torch.randint(1, 64, (3, 9))
    with torch.no_grad(), cpu_linear.cpu_linears(base):
        expected = base(input_ids=ids).logits
    model = apply_lora(base, LoraSettings(r=4, alpha=8, dropout=0.1)).train()
    assert all(type(m).__name__ == "FusedLoraLinear" for m in _lora_layers(model))
    with torch.no_grad(), cpu_linear.cpu_linears(model):
        assert torch.equal(model(input_ids=ids).logits, expected)  # B = 0: KL 0 at step 1


def test_gradient_of_the_shared_prompt_forward_matches_peft():
    """The training forward (distinct prompts once, completions on their cache)."""
    model = _model(0.1)
    prompts = torch.randint(1, 64, (2, 5)).repeat_interleave(3, 0)
    completions = torch.randint(1, 64, (6, 7))
    mask = torch.ones(6, 7, dtype=torch.long)
    mask[2, 5:] = 0
    results = []
    for fused in (True, False):
        for layer in _lora_layers(model):
            layer.__class__ = lora_linear._fused_class() if fused else PeftLinear
        model.zero_grad()
        torch.manual_seed(3)
        logp, _ = completion_logprobs(model, prompts, torch.ones_like(prompts), completions, mask,
                                      products=kernels.products())  # as the trainer calls it
        logp.sum().backward()
        results.append((logp.detach(), [p.grad.clone() for p in model.parameters()
                                        if p.requires_grad]))
    (a, a_grads), (b, b_grads) = results
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for x, y in zip(a_grads, b_grads, strict=True):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-4)


def _fused_calls(model, monkeypatch, ids) -> int:
    calls = []
    apply = lora_linear._LoraLinear.apply
    monkeypatch.setattr(lora_linear._LoraLinear, "apply",
                        lambda *a: calls.append(1) or apply(*a))
    with torch.no_grad(), cpu_linear.cpu_linears(model):
        model(input_ids=ids)
    monkeypatch.setattr(lora_linear._LoraLinear, "apply", apply)
    return len(calls)


def test_peft_forward_where_the_fused_one_does_not_apply(monkeypatch):
    model = _model(0.1)
    ids = torch.randint(1, 64, (2, 6))
    assert _fused_calls(model, monkeypatch, ids) == 14
    model.base_model.disable_adapter_layers()  # the KL reference: base layers only
    assert _fused_calls(model, monkeypatch, ids) == 0
    model.base_model.enable_adapter_layers()
    model.add_adapter("second", model.peft_config["default"])
    model.base_model.set_adapter(["default", "second"])  # two active adapters
    assert _fused_calls(model, monkeypatch, ids) == 0
    model.base_model.set_adapter("default")
    assert _fused_calls(model, monkeypatch, ids) == 14
    calls = []
    apply = lora_linear._LoraLinear.apply
    monkeypatch.setattr(lora_linear._LoraLinear, "apply", lambda *a: calls.append(1) or apply(*a))
    with torch.no_grad():  # outside cpu_linears: every linear on PyTorch's own kernel
        model(input_ids=ids)
    assert calls == []
    model.double()  # float64: not the fused float32 kernels
    assert _fused_calls(model, monkeypatch, ids) == 0


def test_backward_keeps_dropped_positions_not_a_mask():
    model = _model(0.05)
    layer = _lora_layers(model)[0]
    x = torch.randn(4, 16, 32, requires_grad=True)
    torch.manual_seed(0)
    with cpu_linear.cpu_linears(model):
        y = layer(x)
    saved = y.grad_fn.saved_tensors
    dropped = saved[-1]
    assert dropped.dtype == torch.int64 and 0 < len(dropped) < x.numel() // 5
    assert sum(t.numel() for t in saved if t.shape == x.shape) == 2 * x.numel()  # x, dropout(x)


def test_gradient_checkpointing_recomputes_what_the_forward_computed():
    """With activations recomputed in the backward, the recomputation runs after the products'
    context has closed: the context stays off for such a model, so the forward and its
    recomputation take the same layers (fused ones would save other tensors, which
    torch.utils.checkpoint refuses) and the gradients are peft's own."""
    results = []
    for products in (kernels.products(), None):
        model = _model(0.0)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        ids = torch.randint(1, 64, (3, 5))
        completions = torch.randint(1, 64, (3, 6))
        kwargs = {} if products is None else {"products": products}
        logp, _ = completion_logprobs(model, ids, torch.ones_like(ids), completions,
                                      torch.ones_like(completions), **kwargs)
        logp.sum().backward()  # raised CheckpointError with the fused layers
        results.append([p.grad.clone() for p in model.parameters() if p.requires_grad])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
