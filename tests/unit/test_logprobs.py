"""Token log-probs/entropies against hand-computed values; completion log-probs on a tiny Llama."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from torch import nn

from mogrpo.algo.logprobs import (
    _accepts_logits_to_keep,
    completion_logprobs,
    token_entropy,
    token_logprobs,
)
from mogrpo.errors import ConfigError

LN2, LN3 = math.log(2.0), math.log(3.0)


def test_token_logprobs_hand_values():
    # softmax([0, ln 2, ln 3]) = [1, 2, 3] / 6
    logits = torch.tensor([[[0.0, LN2, LN3], [0.0, LN2, LN3]]])  # [1, 2, 3]
    targets = torch.tensor([[0, 2]])
    out = token_logprobs(logits, targets)
    assert out.dtype == torch.float32 and out.shape == (1, 2)
    torch.testing.assert_close(out, torch.tensor([[math.log(1 / 6), math.log(3 / 6)]]))


def test_token_logprobs_temperature():
    # T = 2: exp(z / 2) = [1, sqrt 2, sqrt 3]; sum = 1 + 1.41421356 + 1.73205081 = 4.14626437
    logits = torch.tensor([[[0.0, LN2, LN3]]])
    out = token_logprobs(logits.expand(1, 3, 3), torch.tensor([[0, 1, 2]]), temperature=2.0)
    expected = [math.log(1 / 4.14626437), math.log(1.41421356 / 4.14626437),
                math.log(1.73205081 / 4.14626437)]  # [-1.42220, -1.07563, -0.87290]
    torch.testing.assert_close(out, torch.tensor([expected]))


def test_token_logprobs_upcasts_bf16():
    logits = torch.tensor([[[0.0, LN2, LN3]]], dtype=torch.bfloat16)
    out = token_logprobs(logits, torch.tensor([[2]]))
    assert out.dtype == torch.float32
    # bf16 rounds ln 2 / ln 3 to 8 bits of mantissa, hence the loose tolerance
    assert abs(out.item() - math.log(0.5)) < 1e-2


@pytest.mark.parametrize("dtype,temperature", [(torch.float32, 1.0), (torch.float32, 0.7),
                                               (torch.float64, 1.0), (torch.bfloat16, 1.3)])
def test_token_logprobs_gradient_equals_autograds_to_the_bit(dtype, temperature):
    """The backward computed by hand (one buffer instead of autograd's three) gives the same
    log-probs and logit gradients, bit for bit, as autograd's own of gather - logsumexp."""
    torch.manual_seed(0)
    base = (torch.randn(3, 5, 11) * 4).to(dtype)
    base[0, 1, 3] = -math.inf  # a masked vocabulary entry
    targets = torch.randint(0, 11, (3, 5))
    targets[0, 1] = 4
    weights = torch.randn(3, 5)

    def autograds(logits):  # the formula the module computed before
        z = logits.to(torch.promote_types(dtype, torch.float32)) / temperature
        return z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)

    results = []
    for fn in (lambda x: token_logprobs(x, targets, temperature), autograds):
        logits = base.clone().requires_grad_(True)
        out = fn(logits)
        (out * weights).sum().backward()
        results.append((out.detach(), logits.grad))
    (ours, our_grad), (theirs, their_grad) = results
    assert torch.equal(ours, theirs)
    assert torch.equal(our_grad, their_grad)
    assert our_grad[0, 1, 3] == 0  # no gradient to a masked entry
    # the rows sum to zero: the gathered entry's +w against the softmax's -w
    torch.testing.assert_close(our_grad.float().sum(-1), torch.zeros(3, 5), atol=1e-2, rtol=0)


def test_token_entropy_hand_values():
    # uniform over V = 7 -> ln 7
    assert token_entropy(torch.zeros(1, 1, 7)).item() == pytest.approx(math.log(7), rel=1e-6)
    # p = [1/6, 1/3, 1/2]: H = (1/6) ln 6 + (1/3) ln 3 + (1/2) ln 2 = 0.298627 + 0.366204 + 0.346574
    h = token_entropy(torch.tensor([[[0.0, LN2, LN3]]]))
    assert h.dtype == torch.float32
    assert h.item() == pytest.approx(1.011404, abs=1e-5)
    # temperature -> infinity flattens towards uniform: T = 1e6 gives ~ln 3
    assert token_entropy(torch.tensor([[[0.0, LN2, LN3]]]), temperature=1e6).item() == (
        pytest.approx(math.log(3), abs=1e-5)
    )


def test_token_entropy_ignores_masked_vocab():
    # -inf logits (masked vocabulary entries) must not turn into NaN: uniform over 2 -> ln 2
    h = token_entropy(torch.tensor([[[0.0, 0.0, -math.inf]]]))
    assert h.item() == pytest.approx(LN2, rel=1e-6)


@pytest.mark.parametrize("temperature", [0.0, -1.0])
def test_bad_temperature(temperature):
    with pytest.raises(ConfigError, match="temperature"):
        token_logprobs(torch.zeros(1, 1, 3), torch.zeros(1, 1, dtype=torch.long), temperature)


# ---------------------------------------------------------------- completion_logprobs


def _build(arch: str, attn: str) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if arch == "llama":
        cfg = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32,
                          num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                          initializer_range=0.3)
        model = LlamaForCausalLM(cfg)
    else:  # learned absolute positions: sensitive to position ids, unlike RoPE
        cfg = GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=32,
                         initializer_range=0.3, bos_token_id=0, eos_token_id=0)
        model = GPT2LMHeadModel(cfg)
    model.set_attn_implementation(attn)
    return model.eval()


@pytest.fixture(scope="module", params=[("llama", "eager"), ("llama", "sdpa"), ("gpt2", "sdpa")],
                ids=lambda p: "-".join(p))
def tiny_lm(request):
    return _build(*request.param)


PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]  # lengths 3, 5, 2 -> P = 5
COMPLETIONS = [[20, 21, 22, 23], [24], [25, 26, 27]]  # lengths 4, 1, 3 -> C = 4
PAD = 1


def _padded_batch():
    P, C = max(map(len, PROMPTS)), max(map(len, COMPLETIONS))
    prompt_ids = torch.tensor([[PAD] * (P - len(p)) + p for p in PROMPTS])  # left-padded
    prompt_mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in PROMPTS])
    completion_ids = torch.tensor([c + [PAD] * (C - len(c)) for c in COMPLETIONS])  # right-padded
    completion_mask = torch.tensor([[1] * len(c) + [0] * (C - len(c)) for c in COMPLETIONS])
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def _naive_logprobs(model, temperature=1.0):
    """One unpadded row at a time: no masks or position ids can go wrong."""
    rows = []
    for p, c in zip(PROMPTS, COMPLETIONS, strict=True):
        ids = torch.tensor([p + c])
        logits = model(input_ids=ids).logits[:, len(p) - 1 : len(p) + len(c) - 1]
        rows.append(token_logprobs(logits, torch.tensor([c]), temperature)[0])
    return rows


def test_completion_logprobs_matches_unpadded_rows(tiny_lm):
    batch = _padded_batch()
    with torch.no_grad():
        logp, entropy = completion_logprobs(tiny_lm, *batch, temperature=0.7, with_entropy=True)
        naive = _naive_logprobs(tiny_lm, temperature=0.7)
    assert logp.shape == (3, 4) and logp.dtype == torch.float32 and entropy.shape == (3, 4)
    for i, row in enumerate(naive):
        torch.testing.assert_close(logp[i, : len(row)], row, rtol=1e-5, atol=1e-5)
    mask = batch[3].bool()
    assert torch.isfinite(logp).all() and (logp[~mask] == 0).all() and (entropy[~mask] == 0).all()
    assert (entropy[mask] > 0).all()


def test_position_ids_matter_so_the_test_above_can_fail():
    # Negative control: the padded forward with default positions (0..L-1) shifts every token
    # of a left-padded row. RoPE (Llama) is invariant to such a shift, so use GPT-2's learned
    # absolute positions, where it visibly changes the log-probs.
    model = _build("gpt2", "sdpa")
    prompt_ids, prompt_mask, completion_ids, completion_mask = _padded_batch()
    C = completion_ids.shape[1]
    with torch.no_grad():
        logits = model(input_ids=torch.cat([prompt_ids, completion_ids], 1),
                       attention_mask=torch.cat([prompt_mask, completion_mask], 1)).logits
        wrong = token_logprobs(logits[:, -(C + 1) : -1], completion_ids)
        naive = _naive_logprobs(model)
    assert (wrong[0, :4] - naive[0]).abs().max() > 1e-2  # row 0 has 2 pads before its prompt


def test_the_kv_cache_goes_by_the_name_the_model_declares():
    """transformers 5.24 renamed `past_key_values` to `cache`; remote code written before it
    declares the old name and would drop a `cache=` into its **kwargs unread."""
    from peft import LoraConfig, get_peft_model

    from mogrpo.algo.logprobs import _cache_argument

    model = _build("llama", "sdpa")
    parameters = inspect.signature(type(model).forward).parameters
    declared = "cache" if "cache" in parameters else "past_key_values"
    assert _cache_argument(model) == declared
    peft = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    assert _cache_argument(peft) == declared  # peft's **kwargs pass it through to the model

    class OldRemoteCode(nn.Module):
        def forward(self, input_ids, past_key_values=None, use_cache=None, **kwargs):
            return input_ids

    assert _cache_argument(OldRemoteCode()) == "past_key_values"


class _NoLogitsToKeep(nn.Module):
    """A causal LM whose forward has no ``logits_to_keep``: the full-logits path is taken."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids, use_cache):
        return self.model(input_ids=input_ids, attention_mask=attention_mask,
                          position_ids=position_ids, use_cache=use_cache)


def test_same_with_and_without_logits_to_keep(tiny_lm):
    assert _accepts_logits_to_keep(tiny_lm)
    wrapped = _NoLogitsToKeep(tiny_lm)
    assert not _accepts_logits_to_keep(wrapped)
    batch = _padded_batch()
    with torch.no_grad():
        kept, _ = completion_logprobs(tiny_lm, *batch)
        full, _ = completion_logprobs(wrapped, *batch)
    torch.testing.assert_close(kept, full, rtol=1e-6, atol=1e-6)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # raised inside peft on transformers 5
def test_logits_to_keep_seen_through_peft_wrapper():
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(_build("llama", "sdpa"),
                                LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    assert "logits_to_keep" not in inspect.signature(peft_model.forward).parameters
    assert _accepts_logits_to_keep(peft_model)


def test_completion_logprobs_carries_gradient(tiny_lm):
    logp, entropy = completion_logprobs(tiny_lm, *_padded_batch())
    assert entropy is None and logp.requires_grad
    logp.sum().backward()
    grad = tiny_lm.get_output_embeddings().weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
    tiny_lm.zero_grad(set_to_none=True)
