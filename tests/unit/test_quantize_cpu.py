"""4-bit NF4 and 8-bit bases loaded on the CPU by `load_policy` with the bitsandbytes installed
here (skipped without one of 0.46.1 or newer: CI installs none): the linear weights stored
quantised, LoRA adapters trained on top; with `embeddings_in_4bit` the embedding and head too."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from packaging.version import Version
from transformers import AutoModelForCausalLM, LlamaConfig

import mogrpo.algo.logprobs as logprobs
from grpo_batch import shared_prompt_batch
from mogrpo.algo.logprobs import completion_logprobs, output_head
from mogrpo.config.hardware import BNB_CPU_MIN, bitsandbytes_version
from mogrpo.modeling.embeddings4bit import NF4Embedding, nf4, quantize_embeddings
from mogrpo.modeling.load import LoraSettings, load_policy, trainable_parameters
from mogrpo.modeling.quantize import frozen_weight_bytes
from mogrpo.modeling.tiny import build_tiny_model

bnb = pytest.importorskip("bitsandbytes")
if Version(bitsandbytes_version() or "0") < Version(BNB_CPU_MIN):
    pytest.skip(f"bitsandbytes {bitsandbytes_version()} has no CPU kernels",
                allow_module_level=True)

LORA = LoraSettings(r=4, alpha=8, dropout=0.0)


def _quantised(bits: int) -> dict[str, bool]:
    return {f"load_in_{bits}bit": True}


@pytest.mark.parametrize("bits", [4, 8])
def test_lora_trains_on_a_quantised_base_on_the_cpu(tiny_model_dir, bits):
    model, _ = load_policy(str(tiny_model_dir), lora=LORA, **_quantised(bits))
    base = model.get_base_model()
    q_proj = base.model.layers[0].self_attn.q_proj.base_layer
    n = q_proj.in_features * q_proj.out_features
    if bits == 4:  # two 4-bit codes a byte
        assert type(q_proj) is bnb.nn.Linear4bit
        assert (q_proj.weight.dtype, q_proj.weight.numel()) == (torch.uint8, n // 2)
    else:
        assert type(q_proj) is bnb.nn.Linear8bitLt
        assert (q_proj.weight.dtype, q_proj.weight.numel()) == (torch.int8, n)
    assert q_proj.weight.device.type == "cpu"
    # transformers leaves the head (tied to the embedding here) unquantised
    assert type(base.lm_head) is torch.nn.Linear and base.lm_head.weight.dtype == torch.float32

    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    trained = {name: p for name, p in model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in name for name in trained)  # the base is frozen
    # B starts at 0, so A's gradient is 0 at first; B's is not, in every adapted layer
    lora_b = [p for name, p in trained.items() if "lora_B" in name]
    assert len(lora_b) == 7 * base.config.num_hidden_layers
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora_b)
    torch.optim.AdamW(trained.values(), lr=1e-2).step()
    with torch.no_grad():
        assert model(input_ids=ids, labels=ids).loss < loss  # one step down its own gradient


@pytest.fixture(scope="module")
def wide_vocab_dir(tmp_path_factory) -> Path:
    """A one-layer Llama whose tied embedding is half its parameters (vocabulary 2,048 ×
    hidden 128), as the vocabulary is 28 % of Qwen2.5-0.5B."""
    rng = random.Random(0)
    syllables = [a + b for a in "bcdfghjklmnprstvwz" for b in "aeiou"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3)))
             for _ in range(3000)]
    texts = [" ".join(rng.choice(words) for _ in range(50)) for _ in range(300)]
    return build_tiny_model(tmp_path_factory.mktemp("wide_vocab"), texts, vocab_size=2048,
                            hidden_size=128, num_layers=1, num_heads=4)


@pytest.mark.parametrize(("hidden", "dtype"), [(128, torch.float32), (128, torch.bfloat16),
                                               (96, torch.float32)])
def test_nf4_embedding_rows_are_the_dequantised_tables(hidden, dtype):
    torch.manual_seed(0)
    weight = nf4(torch.randn(300, hidden, dtype=dtype) * 0.02)
    table = bnb.functional.dequantize_4bit(weight.data, weight.quant_state)  # [300, H]
    ids = torch.randint(0, 300, (3, 7))
    # rows of whole blocks looked up alone (96: the whole table dequantised), bit for bit
    assert torch.equal(NF4Embedding(weight, None, dtype)(ids), table[ids].to(dtype))


def test_an_untied_head_gets_its_own_nf4_table():
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=4, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    head = model.lm_head.weight.detach().clone()
    assert quantize_embeddings(model, torch.float32) == ["embedding", "head"]
    weight = model.lm_head.weight
    assert weight is not model.model.embed_tokens.weight
    table = bnb.functional.dequantize_4bit(weight.data, weight.quant_state)
    assert ((table - head).norm() / head.norm()).item() < 0.12  # NF4 of a normal: ~0.09
    hidden = torch.randn(5, 64)
    torch.testing.assert_close(model.lm_head(hidden), hidden @ table.t())


def test_embeddings_in_4bit_store_the_base_in_0_6_bytes_a_parameter(wide_vocab_dir):
    ids = torch.randint(10, 2000, (2, 16), generator=torch.Generator().manual_seed(0))
    logits, stored = {}, {}
    for embeddings in (False, True):
        model, _ = load_policy(str(wide_vocab_dir), lora=LORA, load_in_4bit=True,
                               embeddings_in_4bit=embeddings)
        nbytes, params = frozen_weight_bytes(model)
        stored[embeddings] = nbytes / params
        with torch.no_grad():
            logits[embeddings] = model(input_ids=ids).logits
    base = model.get_base_model()
    assert type(base.model.embed_tokens) is NF4Embedding
    assert type(base.lm_head) is bnb.nn.Linear4bit
    assert base.lm_head.weight is base.model.embed_tokens.weight  # tied: one 4-bit table
    # the base's parameters counted as values, not packed bytes; r 4 adapters on q, k, v, o
    # (128 → 128) and gate, up, down (128 ↔ 512)
    assert trainable_parameters(model) == (lora := 4 * (4 * 256 + 3 * 640), params + lora)
    # measured 2.27 B (a float32 embedding on the CPU) and 0.535 B, with norms, buffers, every
    # tensor's code tables and absmax: 4.127 bits a weight and ~1 KiB a table besides
    assert stored[False] > 2 and stored[True] <= 0.6
    # NF4's rounding of the head and embedding, on random weights of std 0.02: measured 0.135
    # of the logits' norm (the linear layers' NF4 moved them by 0.117 from float32)
    error = (logits[True] - logits[False]).norm() / logits[False].norm()
    assert 0.02 < error < 0.2
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    lora_b = [p for name, p in model.named_parameters() if "lora_B" in name]
    assert len(lora_b) == 7 and all(p.grad.abs().sum() > 0 for p in lora_b)


def test_the_nf4_head_gives_the_chunked_log_probs_the_models_logits_give(wide_vocab_dir,
                                                                          monkeypatch):
    model, _ = load_policy(str(wide_vocab_dir), lora=LORA, load_in_4bit=True,
                           embeddings_in_4bit=True)
    assert output_head(model) is not None  # projected dequantised, a chunk of tokens at a time
    batch = shared_prompt_batch(2000)
    results = []
    for full in (False, True):
        with monkeypatch.context() as m:
            if full:  # the model's own [B, C, V] logits, through Linear4bit's forward
                m.setattr(logprobs, "output_head", lambda model, products=None: None)
            logp, _ = completion_logprobs(model, *batch)
        logp.sum().backward()
        results.append((logp.detach(), [p.grad.clone() for name, p in model.named_parameters()
                                        if "lora_B" in name]))
        model.zero_grad(set_to_none=True)
    (chunked, chunked_grads), (whole, whole_grads) = results
    torch.testing.assert_close(chunked, whole)
    for a, b in zip(chunked_grads, whole_grads, strict=True):
        torch.testing.assert_close(a, b)
