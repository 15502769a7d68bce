"""LoRA's adapter dropout with fast CPU masks: the same distribution as nn.Dropout, fixed by
PyTorch's generator (so seeds and resumes reproduce it), and in place of peft's own."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from mogrpo.kernels.cpu.lora_dropout import FastDropout, keep_mask, use_fast_dropout


@pytest.mark.parametrize("p", [0.05, 0.3])
def test_mask_is_bernoulli_with_the_inverted_scale(p):
    torch.manual_seed(0)
    n = 2_000_000
    mask = keep_mask(torch.Size([n]), p)
    assert mask.dtype == torch.float32 and mask.shape == (n,)
    scale = torch.tensor(1 / (1 - p), dtype=torch.float32)
    assert set(torch.unique(mask).tolist()) == {0.0, scale.item()}
    dropped = (mask == 0).double().mean().item()
    assert abs(dropped - p) < 5 * math.sqrt(p * (1 - p) / n)  # 5 standard errors
    # neighbours independent: both dropped with probability p^2
    both = ((mask[:-1] == 0) & (mask[1:] == 0)).double().mean().item()
    assert abs(both - p * p) < 5 * math.sqrt(p * p * (1 - p * p) / n)
    assert abs(mask.double().mean().item() - 1.0) < 5 * math.sqrt(p / (1 - p) / n)  # E = 1


def test_masks_follow_pytorchs_generator():
    torch.manual_seed(3)
    first = keep_mask(torch.Size([4, 50]), 0.2)
    second = keep_mask(torch.Size([4, 50]), 0.2)
    assert not torch.equal(first, second)  # a new mask per call
    torch.manual_seed(3)
    assert torch.equal(keep_mask(torch.Size([4, 50]), 0.2), first)
    state = torch.get_rng_state()  # what a checkpoint keeps and a resume puts back
    third = keep_mask(torch.Size([4, 50]), 0.2)
    torch.set_rng_state(state)
    assert torch.equal(keep_mask(torch.Size([4, 50]), 0.2), third)


def test_forward_and_gradient_apply_the_mask():
    dropout = FastDropout(0.25).train()
    x = torch.randn(3, 7, 16, requires_grad=True)
    torch.manual_seed(5)
    out = dropout(x)
    torch.manual_seed(5)
    mask = keep_mask(x.shape, 0.25)
    assert torch.equal(out, x * mask)
    out.sum().backward()
    assert torch.equal(x.grad, mask)


def test_nn_dropout_itself_elsewhere():
    x = torch.randn(8, 16)
    assert torch.equal(FastDropout(0.25).eval()(x), x)  # eval: identity
    assert torch.equal(FastDropout(0.0).train()(x), x)
    doubles = x.double()
    torch.manual_seed(1)
    expected = nn.functional.dropout(doubles, 0.25, training=True)
    torch.manual_seed(1)
    assert torch.equal(FastDropout(0.25).train()(doubles), expected)  # float64: F.dropout


@pytest.mark.filterwarnings("ignore::FutureWarning")  # raised inside peft on transformers 5
@pytest.mark.parametrize("rate", [0.05, 0.0])
def test_lora_adapters_get_fast_dropout(rate):
    from transformers import LlamaConfig, LlamaForCausalLM

    from mogrpo.modeling.load import LoraSettings, apply_lora

    model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2))
    model = apply_lora(model, LoraSettings(r=2, alpha=4, dropout=rate,
                                           target_modules="all-linear"))
    dropouts = [d for m in model.modules() if isinstance(getattr(m, "lora_dropout", None),
                                                         nn.ModuleDict)
                for d in m.lora_dropout.values()]
    assert len(dropouts) == 7  # q, k, v, o, gate, up, down
    if rate:
        assert all(type(d) is FastDropout and d.p == rate for d in dropouts)
    else:  # peft uses nn.Identity: nothing to replace
        assert all(type(d) is nn.Identity for d in dropouts)
        assert use_fast_dropout(model) == 0


def test_sparse_draw_continues_the_gaps_past_a_shortfall():
    from mogrpo.kernels.cpu.lora_dropout import _dropped

    class EveryEntry:  # gaps of 1: far fewer gaps than entries, so the draw must continue
        def geometric(self, p, size):
            return np.ones(size, dtype=np.int64)

    assert np.array_equal(_dropped(EveryEntry(), 1000, 0.01), np.arange(1000))
