"""Log-probs from the last hidden states, a chunk of tokens at a time (`head_logprobs`): the
values and gradients of the full-logit path on every family of the architecture matrix, and
none of its [N, V] tensors kept for the backward."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

import mogrpo.algo.head_logprobs as chunked
import mogrpo.algo.logprobs as logprobs
from grpo_batch import shared_prompt_batch
from mogrpo.algo.head_logprobs import OutputHead, head_logprobs
from mogrpo.algo.logprobs import completion_logprobs, output_head, token_logprobs_and_entropy
from mogrpo.algo.products import Products
from mogrpo.modeling.dropout import disable_dropout

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: architectures
from architectures import FAMILIES, family_config  # noqa: E402

V = 300
IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def _reference(hidden, weight, bias, targets, temperature, softcap=None):
    """The full-logit path: the model's logits, its cap, then `token_logprobs_and_entropy`."""
    logits = F.linear(hidden, weight, bias)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logp, entropy = token_logprobs_and_entropy(logits[None], targets[None], temperature, True)
    return logp[0], entropy[0]


@pytest.mark.parametrize("one_chunk", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("temperature", "softcap", "bias"),
                         [(1.0, None, False), (0.7, None, True), (1.3, 2.0, True)])
def test_chunks_give_the_full_logits_values_and_gradients(dtype, temperature, softcap, bias,
                                                          one_chunk, monkeypatch):
    """Several chunks (the backward computes them again) or one (its softmax kept)."""
    torch.manual_seed(0)
    N, H, vocab = 23, 16, 97
    monkeypatch.setattr(chunked, "CHUNK_BYTES", N * vocab * 8 if one_chunk
                        else 5 * vocab * 8)  # 5 or 10 tokens a chunk
    hidden = (torch.randn(N, H) * 2).to(dtype)
    weight, b = torch.randn(vocab, H).to(dtype), torch.randn(vocab).to(dtype) if bias else None
    targets = torch.randint(0, vocab, (N,))
    upstream = torch.randn(N).to(torch.promote_types(dtype, torch.float32))
    results = []
    for ours in (True, False):
        h, w, b = (torch.nn.Parameter(t.clone()) if t is not None else None
                   for t in (hidden, weight, b))
        logp, entropy = head_logprobs(h, _head(w, b, softcap), targets, temperature, True) \
            if ours else _reference(h, w, b, targets, temperature, softcap)
        (logp * upstream).sum().backward()
        results.append((logp.detach(), entropy, *(t.grad for t in (h, w, b) if t is not None)))
    ours, theirs = results
    assert ours[0].dtype == torch.promote_types(dtype, torch.float32)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _head(weight, bias=None, softcap=None) -> OutputHead:
    """An `OutputHead` over an nn.Linear holding these parameters."""
    layer = torch.nn.Linear(1, 1, bias=bias is not None)
    layer.weight, layer.bias = weight, bias
    return OutputHead(layer, softcap)


def test_only_hidden_states_targets_and_logsumexp_are_kept_for_the_backward(monkeypatch):
    torch.manual_seed(0)
    N, H, vocab = 40, 8, 5000
    monkeypatch.setattr(chunked, "CHUNK_BYTES", 16 * vocab * 4)  # 16 tokens a chunk: 3 chunks
    layer = torch.nn.Linear(H, vocab, bias=False)
    hidden = torch.randn(N, H, requires_grad=True)
    targets = torch.randint(0, vocab, (N,))
    saved = _saved_storages(lambda: head_logprobs(hidden, OutputHead(layer), targets, 0.8)[0])
    # (the weight, a parameter, is kept by either path)
    assert sorted(saved.values()) == [N * 4, N * 8, N * H * 4]  # logsumexp, targets, hidden
    full = _saved_storages(lambda: _reference(hidden, layer.weight, None, targets, 0.8)[0])
    assert max(full.values()) == N * vocab * 4  # the float32 logits / T


def test_tokens_that_fit_one_chunk_keep_its_softmax_and_no_more(monkeypatch):
    """Within CHUNK_BYTES the backward reuses the forward's softmax (no second product):
    the kept tensor is that one chunk, N x V float32."""
    torch.manual_seed(0)
    N, H, vocab = 40, 8, 5000
    monkeypatch.setattr(chunked, "CHUNK_BYTES", N * vocab * 4)
    layer = torch.nn.Linear(H, vocab, bias=False)
    hidden = torch.randn(N, H, requires_grad=True)
    targets = torch.randint(0, vocab, (N,))
    saved = _saved_storages(lambda: head_logprobs(hidden, OutputHead(layer), targets, 0.8)[0])
    assert sorted(saved.values()) == [N * 4, N * 8, N * H * 4, N * vocab * 4]
    products = []

    def counted(*args):
        products.append(1)
        return F.linear(*args)

    logp, _ = head_logprobs(hidden, OutputHead(layer, products=Products(linear=counted)),
                            targets, 0.8)
    logp.sum().backward()
    assert len(products) == 1  # the forward's only


def test_bf16_weight_gradient_sums_chunks_in_float32(monkeypatch):
    """A bf16 weight gradient rounded once per chunk would drift from the one product of the
    full-logit path; summed in float32 it stays as close to the float64 truth."""
    torch.manual_seed(0)
    N, H, vocab = 512, 32, 1024
    monkeypatch.setattr(chunked, "CHUNK_BYTES", 8 * vocab * 4)  # 8 tokens a chunk: 64 chunks
    hidden, weight = torch.randn(N, H), torch.randn(vocab, H) * 0.3
    targets = torch.randint(0, vocab, (N,))

    def weight_grad(dtype, ours):
        w = torch.nn.Parameter(weight.to(dtype))
        h = hidden.to(dtype)
        logp = head_logprobs(h, _head(w), targets)[0] if ours else \
            _reference(h, w, None, targets, 1.0)[0]
        logp.sum().backward()
        return w.grad.double()

    truth = weight_grad(torch.float64, False)
    ours = (weight_grad(torch.bfloat16, True) - truth).abs().mean()
    theirs = (weight_grad(torch.bfloat16, False) - truth).abs().mean()
    assert ours < 1.5 * theirs


def _autocast_grads(ours: bool, head_dtype: torch.dtype, tokens_a_chunk: int, monkeypatch):
    """(logp, the hidden states' gradient, the head weight's or None) of one pass under CPU
    bf16 autocast (`model.precision: bf16-mixed`), the backward run after the autocast context
    has closed, as the trainer runs it. `ours`: head_logprobs; else the model's own head and
    the full logits. A float32 head is full fine-tuning's master weight; a bf16 one is frozen,
    under a float32 hidden state, as a quantised base's upcast norm gives it."""
    torch.manual_seed(0)
    N, H, vocab = 64, 32, 512
    monkeypatch.setattr(chunked, "CHUNK_BYTES", tokens_a_chunk * vocab * 4)
    hidden = torch.nn.Parameter(torch.randn(N, H))
    weight = torch.nn.Parameter((torch.randn(vocab, H) * 0.3).to(head_dtype),
                                requires_grad=head_dtype == torch.float32)
    targets, upstream = torch.randint(0, vocab, (N,)), torch.randn(N)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp = head_logprobs(hidden, _head(weight), targets, 0.8)[0] if ours else \
            token_logprobs_and_entropy(F.linear(hidden, weight)[None], targets[None], 0.8,
                                       False)[0][0]
    (logp * upstream).sum().backward()
    return logp.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("tokens_a_chunk", [64, 8], ids=["one chunk", "8 chunks"])
def test_under_mixed_precision_the_backward_is_autograds(tokens_a_chunk, monkeypatch):
    """The backward computes its logits, and its products, in the forward's autocast dtype:
    the hidden states' gradient is autograd's through the model's own bf16 head, to the bit
    here; the weight's differs only by summing the chunks' bf16 products in float32."""
    logp, grad_h, grad_w = _autocast_grads(True, torch.float32, tokens_a_chunk, monkeypatch)
    ref_logp, ref_h, ref_w = _autocast_grads(False, torch.float32, 64, monkeypatch)
    assert torch.equal(logp, ref_logp)
    torch.testing.assert_close(grad_h, ref_h, rtol=1e-5, atol=1e-7)
    if tokens_a_chunk == 64:
        torch.testing.assert_close(grad_w, ref_w, rtol=1e-5, atol=1e-7)
    else:  # one bf16 rounding a chunk: within bf16's precision of autograd's one product
        assert ((grad_w - ref_w).norm() / ref_w.norm()).item() < 4e-3


def test_a_float32_hidden_state_meets_a_bf16_head_under_autocast(monkeypatch):
    """QLoRA and 8-bit LoRA under bf16-mixed: the norms are float32, the frozen head bf16.
    The forward's autocast multiplied them; the backward, run after it, once failed on the
    dtypes when the tokens took more than one chunk (any real vocabulary)."""
    logp, grad_h, grad_w = _autocast_grads(True, torch.bfloat16, 8, monkeypatch)
    ref_logp, ref_h, _ = _autocast_grads(False, torch.bfloat16, 64, monkeypatch)
    assert grad_w is None and grad_h.dtype == torch.float32
    assert torch.equal(logp, ref_logp)
    torch.testing.assert_close(grad_h, ref_h, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- on the families' models


def _model(family: str, scale: float = 8.0, **changes) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "qwen3":  # not among the architecture matrix's families
        config = AutoConfig.for_model("qwen3", vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=64, head_dim=8, **IDS)
    else:
        config = family_config(family, vocab_size=V, **changes)
    model = AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for module in model.modules():  # norms' weights drawn, so that they count
            if type(module).__name__.endswith(("RMSNorm", "LayerNorm")):
                module.weight.uniform_(0.5, 1.5)
        # logits of a few units, not ~0.1: a softmax far from uniform, a cap far from linear
        model.get_output_embeddings().weight.mul_(scale)
    disable_dropout(model)  # as mogrpo loads models: every pass deterministic
    return model.train()


def _batch(K: int = 3):
    return shared_prompt_batch(V, K)


def _logprobs_and_grads(model, batch, monkeypatch, *, full: bool, shared: bool):
    """(logp, entropy, every parameter's gradient) of one forward and backward."""
    with monkeypatch.context() as m:
        if full:  # today's path: the model's own [B, C, V] logits
            m.setattr(logprobs, "output_head", lambda model, products=None: None)
        if not shared:
            m.setattr(logprobs, "shares_prompts", lambda model: False)
        logp, entropy = completion_logprobs(model, *batch, temperature=0.8, with_entropy=True)
        with torch.no_grad():  # the reference's pass: the update's log-probs to the bit
            scored, _ = completion_logprobs(model, *batch, temperature=0.8)
    assert torch.equal(scored, logp.detach())
    (logp * torch.linspace(-1, 2, logp.numel()).view(logp.shape)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return logp.detach(), entropy, grads


CASES = [(f, {}) for f in FAMILIES] + [("qwen3", {}), ("gemma2", {"final_logit_softcapping": 0.5})]


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "one-pass"])
@pytest.mark.parametrize(("family", "changes"), CASES,
                         ids=[f + ("-cap0.5" if c else "") for f, c in CASES])
def test_each_family_gets_the_full_logits_values_and_gradients(family, changes, shared,
                                                               monkeypatch):
    model = _model(family, **changes)
    head = output_head(model)
    assert head is not None
    assert head.softcap == (model.config.final_logit_softcapping if family == "gemma2" else None)
    batch = _batch()
    chunks = []
    logits = chunked._logits
    monkeypatch.setattr(chunked, "_logits", lambda h, *a: chunks.append(len(h)) or logits(h, *a))
    monkeypatch.setattr(chunked, "CHUNK_BYTES", 4 * V * 4)  # 4 tokens a chunk
    ours = _logprobs_and_grads(model, batch, monkeypatch, full=False, shared=shared)
    tokens = int(batch[3].sum())
    # the forward with gradients, the one without, the backward; no padding
    assert sum(chunks) == 3 * tokens and max(chunks) == 4
    theirs = _logprobs_and_grads(model, batch, monkeypatch, full=True, shared=shared)
    assert sum(chunks) == 3 * tokens  # the full path projects with the model's head
    for a, b in zip(ours[:2], theirs[:2], strict=True):  # log-probs, entropies
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert len(ours[2]) == len(theirs[2]) == len(list(model.parameters()))
    for a, b in zip(ours[2], theirs[2], strict=True):  # tied embeddings included
        _assert_close_to_scale(a, b)


def _assert_close_to_scale(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> None:
    """|a - b| <= tol, or tol times b's largest entry where that exceeds 1: float32 rounding
    scales with the gradient (Gemma 2's embedding gradients reach ~300 here, and the
    full-logit path's own two forwards, shared prompts or not, differ by ~1e-4 there)."""
    assert (a - b).abs().max() <= tol * max(1.0, b.abs().max().item())


def test_the_cap_is_applied_so_the_test_above_can_fail(monkeypatch):
    model = _model("gemma2", final_logit_softcapping=0.5)
    batch = _batch()
    capped = _logprobs_and_grads(model, batch, monkeypatch, full=False, shared=True)[0]
    monkeypatch.setattr(logprobs, "output_head",
                        lambda model, products=None: OutputHead(model.get_output_embeddings()))
    uncapped = _logprobs_and_grads(model, batch, monkeypatch, full=False, shared=True)[0]
    assert (capped - uncapped).abs().max() > 0.1


class _NoLogitsToKeep(LlamaForCausalLM):
    """A Llama whose forward takes no ``logits_to_keep`` (remote code written before it):
    its head sees every position."""

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None):
        return super().forward(input_ids=input_ids, attention_mask=attention_mask,
                               position_ids=position_ids, use_cache=use_cache)


def test_a_forward_without_logits_to_keep(monkeypatch):
    torch.manual_seed(0)
    model = _NoLogitsToKeep(family_config("llama", vocab_size=V)).train()
    assert not logprobs._accepts_logits_to_keep(model) and output_head(model) is not None
    batch = _batch()
    seen = []
    model.get_output_embeddings().register_forward_hook(
        lambda m, args, out: seen.append((args[0].shape, out.shape)))
    monkeypatch.setattr(logprobs, "output_head",  # (the hook above would turn the path off)
                        lambda model, products=None: OutputHead(model.get_output_embeddings()))
    ours = _logprobs_and_grads(model, batch, monkeypatch, full=False, shared=False)
    # every position of every row reaches the head, which projects none of them
    assert seen == [((9, 7 + 6, 32), (9, 7 + 6, 0))] * 2  # with gradients, then without
    theirs = _logprobs_and_grads(model, batch, monkeypatch, full=True, shared=False)
    assert seen[2] == ((9, 7 + 6, 32), (9, 7 + 6, V))
    for a, b in zip([*ours[:2], *ours[2]], [*theirs[:2], *theirs[2]], strict=True):
        _assert_close_to_scale(a, b)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # raised inside peft on transformers 5
def test_lora_gets_the_chunked_path_unless_it_adapts_the_head(monkeypatch):
    from peft import LoraConfig, get_peft_model

    def lora(targets):
        return get_peft_model(_model("qwen2"), LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, init_lora_weights=False))

    model = lora("all-linear")  # every linear but the head
    assert output_head(model) is not None
    batch = _batch()
    ours = _logprobs_and_grads(model, batch, monkeypatch, full=False, shared=True)
    theirs = _logprobs_and_grads(model, batch, monkeypatch, full=True, shared=True)
    assert len(ours[2]) == 2 * 7 * 2  # the adapters' A and B only
    for a, b in zip([*ours[:2], *ours[2]], [*theirs[:2], *theirs[2]], strict=True):
        _assert_close_to_scale(a, b)
    assert output_head(lora(["q_proj", "lm_head"])) is None  # LoRA on the head: full logits


def test_models_whose_logits_are_not_the_heads_product_keep_the_full_logits():
    model = _model("llama")
    assert output_head(model) is not None
    model.config.logit_scale = 2.0  # an output scale this path does not apply
    assert output_head(model) is None
    model.config.logit_scale = None
    handle = model.get_output_embeddings().register_forward_hook(lambda m, a, out: out * 2)
    assert output_head(model) is None  # something else wraps the head (accelerate's hooks)
    handle.remove()
    assert output_head(torch.compile(model)) is None  # the compiled graph has the head inside
    starcoder = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "starcoder2", vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, **IDS))
    assert output_head(starcoder) is None  # a family not checked here


# ---------------------------------------------------------------- memory kept for the backward


def _saved_storages(fn) -> dict[int, int]:
    """{storage: bytes} of every tensor `fn` saves for the backward, parameters left out."""
    saved: dict[int, int] = {}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            storage = t.untyped_storage()
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return saved


def test_a_forward_keeps_far_less_for_the_backward_than_the_full_logits(monkeypatch):
    vocab = 16384
    # more tokens than a chunk holds (one chunk's softmax would be kept: within CHUNK_BYTES)
    monkeypatch.setattr(chunked, "CHUNK_BYTES", 16 * vocab * 4)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config("llama", vocab_size=vocab)).train()
    batch = _batch()

    def saved(full: bool) -> int:
        with monkeypatch.context() as m:
            if full:
                m.setattr(logprobs, "output_head", lambda model, products=None: None)
            return sum(_saved_storages(lambda: completion_logprobs(
                model, *batch, temperature=0.8, with_entropy=True)).values())

    ours, theirs = saved(False), saved(True)
    assert theirs - ours >= 9 * 6 * vocab * 4  # the float32 logits / T of every position
    assert ours * 4 <= theirs
