"""A quantised base prepared for LoRA: what is frozen and what is cast to float32 (the 1-D
weights, not the embedding and head), the bitsandbytes configs, and the guards of
`load_policy` (bitsandbytes simulated; its quantised matmuls run in test_quantize_cpu.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from mogrpo.config import hardware
from mogrpo.errors import ConfigError, ModelError
from mogrpo.modeling.load import LoraSettings, apply_lora, load_policy
from mogrpo.modeling.quantize import is_quantized, prepare_quantized, quantization_config


@pytest.fixture
def bf16_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)


def test_mixed_precision_casts_the_norms_not_the_embedding_and_head(bf16_model):
    model = bf16_model
    cast = prepare_quantized(model, upcast=True)
    norms = [n for n, p in model.named_parameters() if "norm" in n]
    assert sorted(cast) == sorted(norms) and len(norms) == 2 * model.config.num_hidden_layers + 1
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert {dtypes[n] for n in norms} == {torch.float32}
    # peft would make these float32 too: 2 B a parameter more for the same 16-bit values
    assert model.get_input_embeddings().weight.dtype == torch.bfloat16
    assert model.get_output_embeddings().weight.dtype == torch.bfloat16
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert not any(p.requires_grad for p in model.parameters())  # LoRA trains on top


def test_pure_bf16_casts_nothing(bf16_model):
    assert prepare_quantized(bf16_model, upcast=False) == []
    assert {p.dtype for p in bf16_model.parameters()} == {torch.bfloat16}


def test_lora_trains_on_the_prepared_base_under_autocast(bf16_model):
    # what a 4-bit run computes, with 16-bit linear weights in place of the quantised ones:
    # float32 norms, bfloat16 embedding and head, float32 adapters, bfloat16 autocast
    prepare_quantized(bf16_model, upcast=True)
    model = apply_lora(bf16_model, LoraSettings(r=4, alpha=8, dropout=0.0))
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    assert out.logits.dtype == torch.bfloat16  # autocast: the head in the compute dtype
    trained = [p for p in model.parameters() if p.requires_grad]
    assert trained and all(p.dtype == torch.float32 and p.grad is not None for p in trained)


class ReturnsInputDtype(torch.nn.Module):
    """What bitsandbytes' Linear4bit does with dtypes: the input cast to the compute dtype,
    the output cast back to the input's."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.to(torch.bfloat16)).to(x.dtype)


@pytest.mark.parametrize("upcast", [True, False])
def test_float32_norms_carry_the_residual_stream_through_quantised_linears(bf16_model, upcast):
    prepare_quantized(bf16_model, upcast=upcast)
    for layer in bf16_model.model.layers:
        for block in (layer.self_attn, layer.mlp):
            for name, child in list(block.named_children()):
                if isinstance(child, torch.nn.Linear):
                    setattr(block, name, ReturnsInputDtype(child))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = bf16_model(input_ids=torch.tensor([[5, 6, 7, 8]]), output_hidden_states=True)
    # the embedding's output, then every block's: float32 once an fp32 norm fed an MLP
    stream = torch.float32 if upcast else torch.bfloat16
    assert [h.dtype for h in out.hidden_states] == [torch.bfloat16] + [stream] * (
        len(out.hidden_states) - 1)
    assert out.logits.dtype == torch.bfloat16


def test_bitsandbytes_configs():
    four = quantization_config(4, torch.bfloat16)
    assert (four.load_in_4bit, four.bnb_4bit_quant_type, four.bnb_4bit_use_double_quant,
            four.bnb_4bit_compute_dtype) == (True, "nf4", True, torch.bfloat16)
    eight = quantization_config(8, torch.bfloat16)
    assert (eight.load_in_8bit, eight.load_in_4bit, eight.llm_int8_threshold) == (True, False, 6.0)


def test_load_policy_refuses_what_this_bitsandbytes_cannot_load_and_both_formats(
        tiny_model_dir, monkeypatch):
    monkeypatch.setattr(hardware, "bitsandbytes_version", lambda: None)
    with pytest.raises(ModelError, match=r"model.load_in_8bit = true needs bitsandbytes \(`pip "
                       r"install 'mogrpo\[gpu\]'`\), but bitsandbytes is not installed"):
        load_policy(str(tiny_model_dir), load_in_8bit=True)
    monkeypatch.setattr(hardware, "bitsandbytes_version", lambda: "0.45.5")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ModelError, match=r"model.load_in_4bit = true on a CPU needs bitsandbytes "
                       r">= 0.46.1 .*, but 0.45.5 is installed"):
        load_policy(str(tiny_model_dir), load_in_4bit=True)
    with pytest.raises(ConfigError, match="load_in_4bit and model.load_in_8bit are both set"):
        load_policy(str(tiny_model_dir), load_in_4bit=True, load_in_8bit=True)


def test_is_quantized_reads_what_transformers_sets(bf16_model):
    assert not is_quantized(bf16_model)
    bf16_model.is_loaded_in_8bit = True
    assert is_quantized(bf16_model)


def test_nf4_layers_are_never_repacked_for_cpu_inference():
    """On a CPU with AVX512-BF16 bitsandbytes repacks an NF4 weight in place at its first
    eval-mode forward without gradients (a rollout), and every later pass, the update's
    included, would take the inference kernel: other roundings than the reference's pass,
    and a product made for inference under the training forward."""
    bnb = pytest.importorskip("bitsandbytes")
    from mogrpo.modeling.quantize import one_kernel

    model = torch.nn.Sequential(bnb.nn.Linear4bit(16, 8), torch.nn.Linear(8, 8))
    model[0].support_avx512bf16_for_cpu = True  # as on such a CPU
    assert one_kernel(model) == 1
    assert model[0].support_avx512bf16_for_cpu is False
