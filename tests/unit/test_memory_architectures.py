"""The planner on every decoder family: shapes read from the module tree built on meta."""

from __future__ import annotations

import pytest

from architectures import FAMILIES, family_config
from mogrpo.config import RunConfig
from mogrpo.errors import ConfigError
from mogrpo.memory import estimate, main
from mogrpo.memory.estimate import layer_activation_bytes, lora_modules
from mogrpo.modeling.architecture import Architecture

# Published sizes (config.json fields as the checkpoints ship them).
GPT2 = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257,
        "n_positions": 1024}
PYTHIA_160M = {"model_type": "gpt_neox", "hidden_size": 768, "num_hidden_layers": 12,
               "num_attention_heads": 12, "intermediate_size": 3072, "vocab_size": 50304,
               "rotary_pct": 0.25, "tie_word_embeddings": False}
PHI3_MINI = {"model_type": "phi3", "hidden_size": 3072, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 8192,
             "vocab_size": 32064, "tie_word_embeddings": False, "pad_token_id": 32000}
FALCON_7B = {"model_type": "falcon", "hidden_size": 4544, "num_hidden_layers": 32,
             "num_attention_heads": 71, "multi_query": True, "vocab_size": 65024,
             "parallel_attn": True, "new_decoder_architecture": False, "bias": False}
OPT_125M = {"model_type": "opt", "hidden_size": 768, "num_hidden_layers": 12,
            "num_attention_heads": 12, "ffn_dim": 3072, "vocab_size": 50272,
            "max_position_embeddings": 2048, "word_embed_proj_dim": 768, "pad_token_id": 1}
GEMMA_2B = {"model_type": "gemma", "hidden_size": 2048, "num_hidden_layers": 18,
            "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256,
            "intermediate_size": 16384, "vocab_size": 256000}


def make_run(data: dict, changes: dict) -> RunConfig:
    """A run with one task; `data` holds the sections that matter for the test."""
    return RunConfig.model_validate(
        {"tasks": {"t": {"data": "x.jsonl", "rewards": ["mc_correct"]}}, **data, **changes})


@pytest.mark.parametrize(("config", "params", "kv_heads", "gated", "tied", "modules"), [
    (GPT2, 124_439_808, 12, False, True, ["c_attn", "c_fc", "c_proj"]),
    (OPT_125M, 125_239_296, 12, False, True, ["fc1", "fc2", "k_proj", "out_proj", "q_proj",
                                              "v_proj"]),
    (PYTHIA_160M, 162_322_944, 12, False, False, ["dense", "dense_4h_to_h", "dense_h_to_4h",
                                                  "query_key_value"]),
    (FALCON_7B, 6_921_720_704, 1, False, True, ["dense", "dense_4h_to_h", "dense_h_to_4h",
                                                "query_key_value"]),
    (PHI3_MINI, 3_821_079_552, 32, True, False, ["down_proj", "gate_up_proj", "o_proj",
                                                 "qkv_proj"]),
    (GEMMA_2B, 2_506_172_416, 1, True, True, ["down_proj", "gate_proj", "k_proj", "o_proj",
                                              "q_proj", "up_proj", "v_proj"]),
], ids=["gpt2-124M", "opt-125m", "pythia-160m", "falcon-7b", "phi-3-mini", "gemma-2b"])
def test_published_sizes(config, params, kv_heads, gated, tied, modules):
    arch = Architecture.from_config(config)
    assert arch.params == params  # the sizes their model cards give
    assert (arch.kv_heads, arch.gated_mlp, arch.tied) == (kv_heads, gated, tied)
    assert arch.modules.linear_names() == modules


def test_fused_layers_are_costed_as_the_modules_lora_wraps():
    # Phi-3-mini, LoRA r 16 on all-linear: 4 modules per layer, not Llama's 7:
    # qkv_proj 16·(3072 + 9216) + o_proj 16·(3072 + 3072) + gate_up_proj 16·(3072 + 16384)
    # + down_proj 16·(8192 + 3072) = 786,432 per layer, × 32 = 25,165,824
    run = make_run({"model": {"name_or_path": "phi3", "dtype": "bfloat16"},
                    "lora": {"enabled": True, "r": 16, "alpha": 32}}, {})
    est = estimate(PHI3_MINI, run)
    assert est["lora"] == 25_165_824 * 4
    assert len(lora_modules(Architecture.from_config(PHI3_MINI), "all-linear")) == 4 * 32
    # GPT-NeoX (Pythia-160m), r 8: query_key_value 8·(768 + 2304) + dense 8·1536
    # + dense_h_to_4h and dense_4h_to_h 8·3840 each = 98,304 per layer, × 12
    run = make_run({"model": {"name_or_path": "neox"}, "lora": {"enabled": True, "r": 8}}, {})
    assert estimate(PYTHIA_160M, run)["lora"] == 1_179_648 * 4
    # Phi-3's own names are accepted (the Llama-only planner told users to use q_proj)
    run = make_run({"model": {"name_or_path": "phi3"},
                    "lora": {"enabled": True, "r": 16, "target_modules": ["qkv_proj", "o_proj"]}},
                   {})
    assert estimate(PHI3_MINI, run)["lora"] == 32 * (196_608 + 98_304) * 4


def test_activations_of_fused_layers_plain_mlps_and_layernorms():
    neox = Architecture.from_config(PYTHIA_160M)
    # bf16, full fine-tuning, per token and layer: 2 LayerNorm inputs 2·2·768 = 3,072
    # + attention q, k, v, out 2·4·768 = 6,144, + the rest of the fused q|k|v output that v
    # (a view of it) keeps alive 2·(768 + 768) = 3,072 + GELU input 2·3072 = 6,144
    # + trainable-weight inputs 2·(2·768 + 3072) = 9,216
    assert neox.fused_qkv_view and neox.activation == "input"
    assert layer_activation_bytes(neox, 2, full_ft=True, lora=[], rank=0, dropout=0.0,
                                  mask_bytes=1) == 27_648
    gpt2 = Architecture.from_config(GPT2)
    # bf16, LoRA r 8 with dropout on CUDA: 3,072 (LayerNorms) + 6,144 (q, k, v, out: views of
    # c_attn's output, no rotation) + gelu_new's x, tanh, 0.5·x and 1 + tanh 4·2·3072 = 24,576;
    # per adapted module (4 + 1)·d_in: c_attn, c_proj, c_fc 768 each, the MLP's c_proj 3072
    # → 5·5,376 = 26,880; lora_A outputs 4 modules × 4 B × 8 = 128
    assert (gpt2.activation, gpt2.fused_qkv_view) == ("gelu_new", False)
    assert layer_activation_bytes(gpt2, 2, full_ft=False, lora=gpt2.block(0), rank=8,
                                  dropout=0.05, mask_bytes=1) == 9_216 + 24_576 + 26_880 + 128
    opt = Architecture.from_config(OPT_125M)
    # OPT's ReLU keeps its output, which is fc2's input: full fine-tuning adds no copy of it
    # 3,072 + 6,144 + 2·3072 + 2·(2·768) = 18,432
    assert opt.activation == "output"
    assert layer_activation_bytes(opt, 2, full_ft=True, lora=[], rank=0, dropout=0.0,
                                  mask_bytes=1) == 18_432


def test_gemma2_defaults_to_eager_attention_with_soft_capping():
    gemma2 = {"model_type": "gemma2", "hidden_size": 2304, "num_hidden_layers": 26,
              "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
              "intermediate_size": 9216, "vocab_size": 256000}
    arch = Architecture.from_config(gemma2)
    assert (arch.attention, arch.softcap) == ("eager", True)
    run = make_run({"model": {"name_or_path": "g", "dtype": "bfloat16"},
                    "rollout": {"num_generations": 4, "max_seq_length": 512},
                    "train": {"micro_batch_size": 4, "prompt_sharing": "on"}}, {})
    sdpa = make_run({"model": {"name_or_path": "g", "dtype": "bfloat16",
                               "attn_implementation": "sdpa"},
                     "rollout": {"num_generations": 4, "max_seq_length": 512},
                     "train": {"micro_batch_size": 4, "prompt_sharing": "on"}}, {})
    # 8 heads × 512 keys × (fp32 softmax 4 + its bf16 cast 2 + the tanh of the capping 2 B)
    # per token and layer, over 26 layers and the 1280 tokens the layers see: the 4 rows are
    # one prompt's group, so its 256 prompt tokens run once, then 4 × 256 completion tokens
    assert estimate(gemma2, run)["activations"] - estimate(gemma2, sdpa)["activations"] == (
        8 * 512 * 8 * (256 + 4 * 256) * 26)
    assert "eager attention keeps s×s scores (gemma2's default)" in estimate(gemma2, run).table()


def test_multi_query_kv_cache():
    run = make_run({"model": {"name_or_path": "falcon", "dtype": "bfloat16"},
                    "rollout": {"num_generations": 4, "max_seq_length": 512},
                    "train": {"micro_batch_size": 8}}, {})
    # Falcon-7B keeps one KV head of 64: 2 · 32 layers · 64 · 2 B = 8 KiB per token
    assert estimate(FALCON_7B, run)["kv_cache"] == 8192 * 512 * 8


def test_wrong_target_names_list_the_models_own():
    run = make_run({"model": {"name_or_path": "gpt2"},
                    "lora": {"enabled": True, "target_modules": ["q_proj", "v_proj"]}}, {})
    with pytest.raises(ConfigError, match=r"^lora.target_modules = \['q_proj', 'v_proj'\]: no "
                       r"module of this gpt2 model is named q_proj, v_proj; its linear layers "
                       r"are c_attn, c_fc, c_proj \(or use all-linear"):
        estimate(GPT2, run)
    arch = Architecture.from_config(GPT2)
    with pytest.raises(ConfigError, match=r"transformer.h.0.mlp is not a linear layer"):
        lora_modules(arch, ["mlp"])
    # peft's rules: a suffix with dots, and a regular expression on the full name
    assert [m.name for m in lora_modules(arch, ["mlp.c_fc"])][:1] == ["transformer.h.0.mlp.c_fc"]
    assert len(lora_modules(arch, r".*\.attn\.c_(attn|proj)")) == 24


@pytest.mark.parametrize("family", list(FAMILIES))
def test_memory_command_on_every_family(family, tmp_path, capsys):
    model_dir = tmp_path / family
    family_config(family).save_pretrained(model_dir)  # config.json only, no weights
    run = tmp_path / "run.yaml"
    run.write_text(f"model: {{name_or_path: {model_dir}}}\nlora: {{enabled: true, r: 4}}\n"
                   "tasks: {t: {data: x.jsonl, rewards: [mc_correct]}}\n", encoding="utf-8")
    assert main([str(run), "--gpu-memory", "2GiB"]) == 0
    out = capsys.readouterr().out
    model_type = FAMILIES[family][0]
    assert f"memory estimate: {model_type}, 0.00 B params" in out
    arch = Architecture.from_config(family_config(family))
    assert f"{len(arch.block(0)) * 2} modules ({', '.join(arch.modules.linear_names())})" in out
