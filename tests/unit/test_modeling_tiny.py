"""The tiny-model factory: deterministic, loadable with plain transformers, chat-shaped."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from mogrpo.errors import ConfigError
from mogrpo.modeling.tiny import build_tiny_model


def weights_hash(model_dir: Path) -> str:
    tensors = load_file(model_dir / "model.safetensors")
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].contiguous().numpy().tobytes())
    return digest.hexdigest()


def test_same_seed_same_weights_and_tokenizer(tiny_model_dir, tiny_texts, tmp_path):
    again = build_tiny_model(tmp_path / "again", tiny_texts, seed=0)
    assert weights_hash(again) == weights_hash(tiny_model_dir)
    assert (again / "tokenizer.json").read_bytes() == (
        tiny_model_dir / "tokenizer.json"
    ).read_bytes()


def test_different_seed_different_weights_same_tokenizer(tiny_model_dir, tiny_texts, tmp_path):
    other = build_tiny_model(tmp_path / "other", tiny_texts, seed=1)
    assert weights_hash(other) != weights_hash(tiny_model_dir)
    assert (other / "tokenizer.json").read_bytes() == (
        tiny_model_dir / "tokenizer.json"
    ).read_bytes()


def test_qwen2_arch_and_sizes(tiny_texts, tmp_path):
    out = build_tiny_model(
        tmp_path / "q",
        tiny_texts,
        arch="qwen2",
        hidden_size=32,
        num_heads=2,
        num_layers=1,
        intermediate_size=48,
        max_position_embeddings=128,
    )
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]) == (
        32,
        1,
        48,
    )
    assert config["tie_word_embeddings"] is True
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.max_position_embeddings == 128


def test_qwen3_arch_has_per_head_norms_of_the_head_size(tiny_texts, tmp_path):
    out = build_tiny_model(tmp_path / "q3", tiny_texts, arch="qwen3", hidden_size=32,
                           num_heads=2, num_layers=1, intermediate_size=48)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["head_dim"] == 16  # hidden / heads, not Qwen3's default of 128
    model = AutoModelForCausalLM.from_pretrained(out)
    assert tuple(model.model.layers[0].self_attn.q_norm.weight.shape) == (16,)


def test_unknown_arch_lists_choices(tiny_texts, tmp_path):
    with pytest.raises(ConfigError, match=r"'gpt9'.*\['gemma', 'llama', 'qwen2', 'qwen3'\]"):
        build_tiny_model(tmp_path / "x", tiny_texts, arch="gpt9")


def test_build_takes_thousands_of_texts_and_their_characters(tmp_path):
    texts = [f"question {i} has answer {i % 7} because 理由 {i % 13}" for i in range(3000)]
    build_tiny_model(tmp_path / "many", texts)
    tok = AutoTokenizer.from_pretrained(tmp_path / "many")
    ids = tok("理由 2999", add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in ids and tok.decode(ids) == "理由 2999"


def test_model_config_and_generation_config(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    eos, eot, pad = tok.convert_tokens_to_ids(["<|end_of_text|>", "<|eot|>", "<|pad|>"])
    assert model.config.vocab_size == len(tok)
    assert str(model.dtype) == "torch.float32"
    gen = json.loads((tiny_model_dir / "generation_config.json").read_text())
    # Only stop/pad ids: no sampling defaults for generate() to merge or warn about.
    assert {k: v for k, v in gen.items() if k != "transformers_version"} == {
        "eos_token_id": [eos, eot],
        "pad_token_id": pad,
    }


def test_tokenizer_special_tokens_and_padding(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    eos, eot = tok.convert_tokens_to_ids(["<|end_of_text|>", "<|eot|>"])
    assert eos != eot
    assert {eos, eot} <= set(tok.all_special_ids)
    assert tok.eos_token == "<|end_of_text|>" and tok.pad_token == "<|pad|>"
    assert tok.padding_side == "left"
    # Each special token is one id, never split by BPE.
    for token in ["<|eot|>", "<|user|>", "<|assistant|>", "<|system|>"]:
        assert tok(token, add_special_tokens=False)["input_ids"] == [
            tok.convert_tokens_to_ids(token)
        ]
    text = "答案：B 因为 the context says 未知"
    assert tok.decode(tok(text)["input_ids"]) == text
    assert tok.unk_token_id is None or tok.unk_token_id not in tok(text)["input_ids"]


def test_chat_template_renders_as_specified(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [
        {"role": "system", "content": "Be fair."},
        {"role": "user", "content": "Who is the doctor?"},
        {"role": "assistant", "content": "Cannot be determined."},
        {"role": "user", "content": "Why?"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|system|>\nBe fair.<|eot|>\n<|user|>\nWho is the doctor?<|eot|>\n"
        "<|assistant|>\nCannot be determined.<|eot|>\n<|user|>\nWhy?<|eot|>\n<|assistant|>\n"
    )
    no_prompt = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=False)
    assert no_prompt == "<|system|>\nBe fair.<|eot|>\n<|user|>\nWho is the doctor?<|eot|>\n"


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "gemma", "llama"])
def test_the_tokenizer_loads_with_the_models_vocabulary_and_saves_back_so(arch, tiny_texts,
                                                                           tmp_path):
    """transformers loads a Qwen folder's tokenizer as Qwen2Tokenizer, which added its default
    unknown token `<|endoftext|>` past the vocabulary: a model saved after training then had
    a tokenizer one id longer than its embedding, and `mogrpo train` refused it."""
    out = build_tiny_model(tmp_path / arch, tiny_texts, arch=arch, hidden_size=32, num_layers=1,
                           num_heads=2)
    vocab = json.loads((out / "config.json").read_text())["vocab_size"]
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) == vocab
    tok.save_pretrained(tmp_path / "again")
    assert len(AutoTokenizer.from_pretrained(tmp_path / "again")) == vocab
