"""The memory planner: every term against hand-computed values, the ladder, sizes, the command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from mogrpo.config import RunConfig
from mogrpo.config.load import validate
from mogrpo.errors import ConfigError, ModelError
from mogrpo.memory import (
    GIB,
    estimate,
    ladder,
    load_model_config,
    main,
    parse_size,
    peak_bytes,
    reset_peak,
)
from mogrpo.memory.estimate import with_changes
from mogrpo.memory.weights import weight_bytes
from mogrpo.modeling.architecture import Architecture

CONFIGS = Path(__file__).parents[2] / "benchmarks" / "model_configs"  # the published configs

# Llama-3-8B's shape: hidden 4096, 32 layers, 32 heads of 128, 8 KV heads, SwiGLU 14336,
# vocabulary 128256, separate input and output embeddings.
LLAMA_8B = {
    "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
    "vocab_size": 128256, "tie_word_embeddings": False,
}
# Qwen2.5-1.5B's shape: hidden 1536, 28 layers, 12 heads of 128, 2 KV heads, SwiGLU 8960,
# vocabulary 151936, tied embeddings, q/k/v biases.
QWEN_1_5B = {
    "model_type": "qwen2", "hidden_size": 1536, "num_hidden_layers": 28,
    "num_attention_heads": 12, "num_key_value_heads": 2, "intermediate_size": 8960,
    "vocab_size": 151936, "tie_word_embeddings": True,
}


def users_run(**changes) -> RunConfig:
    """USERS.md case 4: 8B, LoRA r 16, 4 prompts × K 4 per micro-batch, 128 new tokens, bf16.
    The prompt budget (512) is an assumption: USERS.md gives only the SFT length (~900)."""
    data = {
        "model": {"name_or_path": "llama", "dtype": "bfloat16"},
        "lora": {"enabled": True, "r": 16, "alpha": 32},
        "tasks": {"fairness": {"data": "x.jsonl", "rewards": ["mc_correct"], "beta": 0.1}},
        "rollout": {"num_generations": 4, "max_seq_length": 640, "max_prompt_length": 512,
                    "max_completion_length": 128},
        "train": {"micro_batch_size": 16, "gradient_accumulation_steps": 1},
    }
    return make_run(data, changes)


def qwen_full_run(**changes) -> RunConfig:
    """Full fine-tuning in pure bf16 (weights and AdamW states), the figures below count; the
    default on GPUs, bf16-mixed, is `test_bf16_mixed_full_fine_tuning_terms`."""
    data = {
        "model": {"name_or_path": "qwen", "dtype": "bfloat16", "precision": "bf16"},
        "tasks": {"t": {"data": "x.jsonl", "rewards": ["mc_correct"], "beta": 0.04}},
        "rollout": {"num_generations": 4, "max_seq_length": 512, "max_prompt_length": 256,
                    "max_completion_length": 256},
        # each distinct prompt once (the figures below count it; `auto` would not share these
        # 256-token prompts on a GPU: test_prompt_sharing_follows_the_device_and_the_lengths)
        "train": {"micro_batch_size": 8, "gradient_accumulation_steps": 1,
                  "prompt_sharing": "on"},
    }
    return make_run(data, changes)


def make_run(data: dict, changes: dict) -> RunConfig:
    """`model__dtype="auto"` sets one field; `tasks={...}` replaces a section."""
    for dotted, value in changes.items():
        section, _, key = dotted.partition("__")
        if key:
            data.setdefault(section, {})[key] = value
        else:
            data[section] = value
    return RunConfig.model_validate(data)


def test_parameter_counts_match_the_published_sizes():
    llama = Architecture.from_config(LLAMA_8B)
    # per layer: q 4096² + k, v 4096·1024 each + o 4096² + gate, up, down 4096·14336 each
    #          = 16,777,216·2 + 4,194,304·2 + 58,720,256·3 = 218,103,808; × 32 = 6,979,321,856
    assert llama.linear_params() == 6_979_321_856
    # + embeddings and head 128256·4096 = 525,336,576 each + norms 2·4096·32 + 4096
    assert llama.params == 6_979_321_856 + 2 * 525_336_576 + 262_144 + 4096 == 8_030_261_248
    qwen = Architecture.from_config(QWEN_1_5B)
    # per layer: q, o 1536² + k, v 1536·256 + gate, up, down 1536·8960 = 46,792,704; biases
    # 1536 + 2·256; norms 2·1536. Tied: the embedding 151936·1536 = 233,373,696 counts once.
    assert qwen.params == 28 * (46_792_704 + 2048 + 3072) + 1536 + 233_373_696 == 1_543_714_304
    assert (qwen.kv_dim, qwen.head_dim, qwen.tied, llama.tied) == (256, 128, True, False)


def test_llama_8b_lora_terms():
    est = estimate(LLAMA_8B, users_run())
    assert est["weights"] == 8_030_261_248 * 2  # bf16
    # LoRA r 16 on all 7 projections: 16·(q 8192 + k 5120 + v 5120 + o 8192 + gate 18432 +
    # up 18432 + down 18432) = 1,310,720 per layer, × 32 = 41,943,040 params, fp32 (peft)
    assert est["lora"] == 41_943_040 * 4
    assert est["gradients"] == 41_943_040 * 4
    assert est["optimizer"] == 41_943_040 * 8  # AdamW m and v, fp32 like the adapters
    assert est["reference"] == 0  # LoRA: the reference is the base with adapters disabled
    assert est["overhead"] == GIB
    # generation: 4 prompts × K 4 = 16 sequences of 512 + 128 tokens; per token
    # 2 (k, v) · 32 layers · 8 KV heads · 128 · 2 B = 131,072 B (GQA: a quarter of MHA's)
    assert est["kv_cache"] == 131_072 * 640 * 16 == 1_342_177_280
    # per token and layer: RMSNorm inputs 8·4096 = 32,768 + attention 2·(2·4096 + 2·1024) =
    # 20,480 + SwiGLU 3·2·14336 = 86,016 + LoRA (4 + 1)·(6·4096 + 14336) = 194,560 (fp32
    # dropout output + bool mask per module) + 7·4·16 = 448 (lora_A outputs) = 334,272 B;
    # × 4 distinct prompts · 512 + 16 · 128 = 4096 tokens (the forward runs each prompt
    # once) × 32 layers + final norm input 4096·4·4096 + each row's copy of its prompt's keys
    # and values 16·512 · 2·1024 · 2 B · 32 layers
    acts = 334_272 * 4096 * 32 + 4096 * 4 * 4096 + 16 * 512 * 2 * 1024 * 2 * 32
    assert est["activations"] == acts == 44_954_550_272
    # with checkpointing: each layer's input 2·4096 B, plus one layer recomputed
    assert est.activations_by_checkpointing[True] == 10_240 * (32 * 8192 + 334_272) + 167_772_160
    # the chunked head: 64 MiB // (128256 · 4 B) = 130 tokens a chunk; logits, softmax and
    # their product in the forward (entropy); 16 B per token of logsumexp, target, log-prob
    assert est["logits"] == 3 * 130 * 128_256 * 4 + 16 * 2048 == 200_112_128
    always = 16_060_522_496 + 167_772_160 + 335_544_320 + GIB
    assert est.total == always + acts + 200_112_128  # training is the peak phase
    table = est.table()
    assert "KV cache (generation)" in table and "(with: 5.84)" in table
    assert f"{est.total / GIB:7.2f}" in table


def test_llama_8b_4bit_weights_include_quantisation_constants():
    est = estimate(LLAMA_8B, users_run(model__load_in_4bit=True))
    # NF4 with double quantisation per 64-weight block: 32 B of 4-bit codes + 1 B absmax, and
    # 4 B per 256 blocks: 6,979,321,856 / 64 = 109,051,904 blocks →
    # 3,489,660,928 + 109,051,904 + 425,984·4 = 3,600,416,768 B. Of the other 1,050,939,392
    # parameters the 65 norms (65·4096 = 266,240) are cast to fp32; the embedding and the head
    # (2 · 128256 · 4096 = 1,050,673,152) stay bf16, unlike peft's cast (4.2 GB instead of 2.1).
    assert est["weights"] == 3_600_416_768 + 266_240 * 4 + 1_050_673_152 * 2 == 5_702_828_032
    # fp32 norms make the residual stream fp32: 4 B per KV element
    assert est["kv_cache"] == 2 * 32 * 1024 * 4 * 640 * 16
    assert "(4-bit base)" in est.title


def test_embeddings_in_4bit_bring_the_base_to_0_516_bytes_a_parameter():
    plain = estimate(LLAMA_8B, users_run(model__load_in_4bit=True))
    est = estimate(LLAMA_8B, users_run(model__load_in_4bit=True, model__embeddings_in_4bit=True))
    # the embedding and the untied head (2 · 128256 · 4096 = 1,050,673,152) in NF4 as the
    # linear layers: 525,336,576 B of codes + 16,416,768 absmax + 64,128 · 4 B
    assert est["weights"] == 3_600_416_768 + 266_240 * 4 + 542_009_856 == 4_143_491_584
    assert est["weights"] / 8_030_261_248 < 0.516
    # what it costs: the head (128256 × 4096) dequantised in bf16 while it runs, in prefill
    # and in the log-prob head (still chunked: the same 200,112,128 B)
    head = 128_256 * 4096 * 2
    assert est["logits"] == plain["logits"] + head == 200_112_128 + head
    assert est["prefill"] == plain["prefill"] + head
    assert est.total == plain.total - (5_702_828_032 - 4_143_491_584) + head


@pytest.mark.parametrize(("name", "without", "with_"), [
    ("qwen2.5-0.5b", 0.925, 0.516), ("qwen2.5-1.5b", 0.741, 0.516),
    ("llama-3.1-8b", 0.710, 0.516), ("qwen2.5-14b", 0.673, 0.516)])
def test_the_4bit_target_of_0_6_bytes_a_parameter_needs_4bit_embeddings(name, without, with_):
    shape = Architecture.from_config(json.loads((CONFIGS / f"{name}.json").read_text()))
    for embeddings, expected in ((False, without), (True, with_)):
        run = users_run(model__load_in_4bit=True, model__embeddings_in_4bit=embeddings)
        weights, _ = weight_bytes(shape, run, "bf16-mixed")
        assert round(weights / shape.params, 3) == expected


def test_llama_8b_8bit_weights_are_a_byte_and_a_row_scale():
    est = estimate(LLAMA_8B, users_run(model__load_in_8bit=True))
    # int8 codes, 1 B per linear weight, and an fp32 scale per output row: per layer
    # q 4096 + k 1024 + v 1024 + o 4096 + gate, up 14336 each + down 4096 = 43,008 rows,
    # × 32 = 1,376,256 → 6,979,321,856 + 5,505,024; norms fp32, embedding and head bf16
    assert est["weights"] == 6_979_321_856 + 1_376_256 * 4 + 266_240 * 4 + 1_050_673_152 * 2
    assert est["weights"] == 9_087_238_144
    assert est["kv_cache"] == 2 * 32 * 1024 * 4 * 640 * 16 and "(8-bit base)" in est.title
    with pytest.raises(ConfigError, match="load_in_4bit and model.load_in_8bit are both set"):
        estimate(LLAMA_8B, users_run(model__load_in_8bit=True, model__load_in_4bit=True))


def test_a_quantised_base_under_pure_bf16_casts_nothing_up():
    est = estimate(LLAMA_8B, users_run(model__load_in_4bit=True, model__precision="bf16"))
    # no autocast: fp32 norms would meet the bf16 head, so every 16-bit weight stays 2 B and
    # the residual stream, and with it the KV cache, bf16
    assert est["weights"] == 3_600_416_768 + 1_050_939_392 * 2
    assert est["kv_cache"] == 2 * 32 * 1024 * 2 * 640 * 16


def test_qwen_full_fine_tuning_terms():
    run = qwen_full_run()
    est = estimate(QWEN_1_5B, run)
    n = 1_543_714_304
    assert est["weights"] == est["gradients"] == est["reference"] == n * 2
    assert est["optimizer"] == n * 4  # torch AdamW keeps m, v in the bf16 parameters' dtype
    assert estimate(QWEN_1_5B, qwen_full_run(tasks={"t": {"data": "x", "rewards": ["f"],
                                                          "beta": 0.0}}))["reference"] == 0
    # per token and layer: 8·1536 + 2·(2·1536 + 2·256) + 3·2·8960 + inputs of the trainable
    # weights 2·(4·1536 + 8960) = 12,288 + 7,168 + 53,760 + 30,208 = 103,424 B
    # head: final norm 4096·4·1536 + normed input and head input 2·1536·(4096 + 8·257)
    # over 2 distinct prompts · 256 + 8 · 256 = 2560 tokens (K 4: each prompt once), and
    # each row's copy of its prompt's keys and values 8·256 · 2·256 · 2 B · 28 layers
    head = 2560 * 4 * 1536 + 2 * 1536 * (2560 + 8 * 257)
    assert est["activations"] == 2560 * 28 * 103_424 + head + 8 * 256 * 2 * 256 * 2 * 28
    # the chunked head: 110 tokens a chunk; backward: one chunk and the head's fp32 weight
    # gradient 151936·1536·4 B (a trained head), above the forward's 3 chunks
    # (pure bf16: a bf16 head, so a 16-bit copy of the chunk's gradient too)
    assert est["logits"] == 110 * 151_936 * (4 + 2) + 151_936 * 1536 * 4 + 16 * 2048
    assert est["kv_cache"] == 2 * 28 * 256 * 2 * 512 * 8  # 2 KV heads: 28 KiB per token
    assert est["optimizer_step"] == 0  # fused AdamW: in place
    assert est["embedding_grad"] == 151_936 * 1536 * 2  # tied: dense, before it is summed


def test_bf16_mixed_full_fine_tuning_terms():
    # model.dtype bfloat16 alone means bf16-mixed: float32 master weights, gradients and AdamW
    # m, v; a bfloat16 reference copy, activations and KV cache; autocast's bfloat16 copy of
    # every matmul weight (the head's too) while training and generating
    n = 1_543_714_304
    pure = estimate(QWEN_1_5B, qwen_full_run())
    for mixed in (estimate(QWEN_1_5B, qwen_full_run(model={"name_or_path": "qwen",
                                                           "dtype": "bfloat16"})),
                  estimate(QWEN_1_5B, qwen_full_run(model={"name_or_path": "qwen"}))):
        assert mixed["weights"] == mixed["gradients"] == n * 4
        assert mixed["optimizer"] == n * 8
        assert mixed["reference"] == n * 2
        matmuls = Architecture.from_config(QWEN_1_5B).linear_params() + 151_936 * 1536
        assert mixed["autocast"] == matmuls * 2
        assert mixed.phase("generation") - pure.phase("generation") == matmuls * 2
        for key in ("activations", "kv_cache"):
            assert mixed[key] == pure[key]
        # an fp32 head: no 16-bit copy of a chunk's logits' gradient
        assert pure["logits"] - mixed["logits"] == 110 * 151_936 * 2
        assert "bf16-mixed" in mixed.title
    # pure bf16: 8 B a parameter less of weights, gradients and m, v
    assert estimate(QWEN_1_5B, qwen_full_run(model={"name_or_path": "qwen"})).phase("always") \
        - pure.phase("always") == n * (2 + 4)


def test_sft_warm_up_phase():
    # USERS.md's stage 1: SFT at ~900 tokens, batch 2 (full fine-tuning of the 1.5B here)
    est = estimate(QWEN_1_5B, qwen_full_run(sft={"enabled": True, "batch_size": 2,
                                                 "max_length": 900}))
    # the same 103,424 B per token and layer as the GRPO micro-batch, over 2 × 900 tokens; the
    # head keeps its input at every position (HF computes logits for all of them)
    head = 1800 * 4 * 1536 + 2 * 1536 * (1800 + 2 * 900)
    assert est["sft_activations"] == 1800 * 28 * 103_424 + head
    # bf16 logits (kept), the fp32 log-softmax the loss saves, and in the backward its dense
    # gradient and the fp32 logits' gradient: 2 + 4 + 4 + 4 B (the fp32 upcast is freed by then)
    assert est["sft_logits"] == 2 * 900 * 151_936 * 14
    # the warm-up's gradients too (they go before the first rollout)
    assert est.phase("SFT warm-up") == est["sft_activations"] + est["sft_logits"] + \
        est["gradients"]


def test_sft_logits_term_is_what_the_warm_up_loss_holds(tmp_path: Path):
    # run_sft's loss on CPU in fp32, under the profiler: the most bytes its logits, log-softmax
    # and their gradients hold at once (16 B a logit; the planner counted 8)
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    config = {**QWEN_1_5B, "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 4096}
    est = estimate(config, qwen_full_run(model={"name_or_path": "qwen"},
                                         sft={"enabled": True, "batch_size": 2,
                                              "max_length": 256}), device="cpu")
    torch.manual_seed(0)
    hidden = torch.randn(2, 256, 64, requires_grad=True)
    head = torch.randn(4096, 64, requires_grad=True)
    labels = torch.randint(0, 4096, (2, 256))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        logits = hidden @ head.t()  # [B, T, V]
        next_tokens = F.pad(labels, (0, 1), value=-100)[:, 1:]  # [B, T]
        F.cross_entropy(logits.float().flatten(0, 1), next_tokens.flatten(),
                        ignore_index=-100).backward()
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    peak = max(e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]")
    assert est["sft_logits"] == 2 * 256 * 4096 * 16
    # besides: the targets, the loss and whatever scratch a CPU's kernels take (a few KiB
    # here); the 8 B a logit the planner counted before is 50 % under
    assert 0 <= peak - est["sft_logits"] < est["sft_logits"] // 20


def test_no_sft_warm_up_phase_without_the_warm_up():
    # sft.enabled false (the default): the gradients and autocast copies a warm-up would hold
    # together are no phase of the run; they made "SFT warm-up" the peak of runs without one
    est = estimate(QWEN_1_5B, qwen_full_run(model__precision="bf16-mixed",
                                            train__gradient_accumulation_steps=4))
    assert est.phase("SFT warm-up") == 0
    assert est.total == est.phase("always") + max(
        est.phase(p) for p in ("generation", "training", "optimizer step"))
    assert "SFT warm-up" not in est.table()
    warm = estimate(QWEN_1_5B, qwen_full_run(model__precision="bf16-mixed",
                                             train__gradient_accumulation_steps=4,
                                             sft={"enabled": True}))
    assert warm.phase("SFT warm-up") > warm["gradients"] + warm["autocast"]


def test_ladder_shrinks_the_sft_batch_when_the_warm_up_is_the_peak():
    run = qwen_full_run(lora={"enabled": True, "r": 16}, model__gradient_checkpointing=True,
                        train={"micro_batch_size": 4},
                        sft={"enabled": True, "batch_size": 16, "max_length": 1024})
    est = estimate(QWEN_1_5B, run)
    assert est.total == est.phase("always") + est.phase("SFT warm-up")
    (step,) = ladder(lambda c, n: estimate(QWEN_1_5B, c, nproc=n), run, parse_size("16GiB"))
    # halving to 8 still needs ~22.2 GiB (the fp32 logits dominate), a quarter (13.1) fits
    assert step.overrides == ["sft.batch_size=4"] and step.total <= 16 * GIB


def test_prompt_sharing_follows_the_device_and_the_lengths():
    # train.prompt_sharing auto: a CPU shares any saving; a GPU only where the prompts saved
    # are half the tokens (kernels.prompt_sharing_min_saved), which 8 × 256-token prompts shared
    # by K = 4 (6 × 256 of 8 × 512 tokens, 37.5 %) are not
    def activations(device: str, sharing: str, **changes) -> int:
        return estimate(QWEN_1_5B, qwen_full_run(train__prompt_sharing=sharing, **changes),
                        device=device)["activations"]

    shared, whole = activations("cuda", "on"), activations("cuda", "off")
    assert shared < whole
    assert activations("cuda", "auto") == whole
    assert activations("cpu", "auto") == activations("cpu", "on") < activations("cpu", "off")
    # 448-token prompts, 64-token completions, K = 8: 7 × 448 of 8 × 512 tokens (77 %) saved
    long = {"rollout": {"num_generations": 8, "max_seq_length": 512, "max_prompt_length": 448,
                        "max_completion_length": 64}}
    assert activations("cuda", "auto", **long) == activations("cuda", "on", **long) \
        < activations("cuda", "off", **long)
    est = estimate(QWEN_1_5B, qwen_full_run(train__prompt_sharing="auto"))
    assert "each distinct prompt once" not in est.table()


def test_eager_attention_adds_the_score_matrices():
    sdpa = estimate(QWEN_1_5B, qwen_full_run())
    eager = estimate(QWEN_1_5B, qwen_full_run(model__attn_implementation="eager"))
    # 12 heads × 512 keys × (4 B fp32 softmax + 2 B bf16 copy) per token and layer
    # over 2560 tokens (2 distinct prompts of 256 + 8 completions of 256)
    assert eager["activations"] - sdpa["activations"] == 2560 * 28 * 12 * 512 * 6


def test_fp32_cpu_estimate_uses_fp32_and_no_cuda_context():
    est = estimate(QWEN_1_5B, qwen_full_run(model={"name_or_path": "qwen"}), device="cpu")
    assert est["weights"] == 1_543_714_304 * 4 and est["overhead"] == 0


def test_lora_target_modules():
    est = estimate(LLAMA_8B, users_run(lora__target_modules=["q_proj", "v_proj"]))
    assert est["lora"] == 32 * 16 * (8192 + 5120) * 4
    with pytest.raises(ConfigError, match="c_attn.*q_proj"):
        estimate(LLAMA_8B, users_run(lora__target_modules=["c_attn"]))
    with pytest.raises(ConfigError, match="load_in_4bit.*lora.enabled"):
        estimate(LLAMA_8B, users_run(model__load_in_4bit=True, lora__enabled=False))


def test_ladder_fits_the_users_40gb_case_and_keeps_the_batch_first():
    gpu = parse_size("40GB")
    run = users_run()
    assert estimate(LLAMA_8B, run).total > gpu
    steps = ladder(lambda c, n: estimate(LLAMA_8B, c, nproc=n), run, gpu)
    assert steps and steps[-1].total <= gpu
    first = steps[0].changes
    assert first["train.micro_batch_size"] * first["train.gradient_accumulation_steps"] == 16
    assert steps[0].overrides[0].startswith("train.micro_batch_size=")
    assert "still 16 completions per optimizer step" in steps[0].cost
    previous = estimate(LLAMA_8B, run).total
    for step in steps:  # cumulative: each saving is measured from the previous total
        assert step.saving == previous - step.total > 0
        previous = step.total


def test_ladder_on_a_small_gpu_climbs_further_and_keeps_valid_configs():
    gpu = parse_size("16GB")
    steps = ladder(lambda c, n: estimate(LLAMA_8B, c, nproc=n), users_run(), gpu)
    changes = [s.change.split(":")[0] for s in steps]
    assert changes[:3] == ["micro-batch down, accumulation up", "gradient checkpointing",
                           "4-bit NF4 base weights"]
    assert steps[-1].total <= gpu
    # checkpointing left room for a larger micro-batch than 1
    assert steps[0].changes["train.micro_batch_size"] > 1
    assert ladder(lambda c, n: estimate(LLAMA_8B, c, nproc=n), users_run(), parse_size("200GB")) == []


@pytest.mark.parametrize(("text", "expected"), [
    ("24GB", 24 * 10**9), ("24GiB", 24 * 2**30), ("16g", 16 * 2**30), ("40", 40 * 2**30),
    ("1.5 TB", 1_500_000_000_000), ("512MiB", 512 * 2**20), ("100b", 100),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


def test_parse_size_error_names_the_accepted_forms():
    with pytest.raises(ConfigError, match=r"'lots' is not a size; write e.g. 24GB, 24GiB"):
        parse_size("lots")


def test_load_model_config_reads_only_config_json(tiny_model_dir: Path, tmp_path: Path):
    config = load_model_config(str(tiny_model_dir))
    assert config.hidden_size == 64
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="has no config.json"):
        load_model_config(str(tmp_path / "empty"))


def test_uncached_hub_id_says_the_planner_needs_config_json(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(ModelError, match="needs only its config.json.*huggingface-cli download"):
        load_model_config("nobody-org/not-a-cached-model")


def write_run(tmp_path: Path, **sections) -> Path:
    model_dir = tmp_path / "llama-8b"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(LLAMA_8B), encoding="utf-8")
    data = users_run().model_dump(mode="json")
    data["model"]["name_or_path"] = str(model_dir)
    data.update(sections)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def test_memory_command_prints_table_and_ladder(tmp_path: Path, capsys):
    assert main([str(write_run(tmp_path)), "--gpu-memory", "40GB"]) == 3  # found a problem
    out = capsys.readouterr().out
    assert "memory estimate: llama, 8.03 B params" in out and "activations (training)" in out
    assert "does not fit: 58.5 GiB > 37.3 GiB (40GB = decimal units" in out
    assert "1. micro-batch down, accumulation up" in out
    assert "--set train.micro_batch_size=4 --set train.gradient_accumulation_steps=4" in out


def test_memory_command_fits_and_reports_bad_sizes(tmp_path: Path, capsys):
    path = write_run(tmp_path)
    assert main([str(path), "--gpu-memory", "200GiB", "--set", "train.micro_batch_size=4",
                 "--set", "train.gradient_accumulation_steps=4"]) == 0
    assert "fits: " in capsys.readouterr().out
    assert main([str(path), "--gpu-memory", "huge"]) == 2
    assert "error: memory size 'huge' is not a size" in capsys.readouterr().err


def test_measured_peak_on_cpu():
    reset_peak("cpu")
    before = peak_bytes("cpu")
    block = bytearray(64 * 2**20)  # touch 64 MiB
    assert peak_bytes("cpu") >= before + 60 * 2**20
    del block


def test_generation_batch_size_caps_what_generation_holds():
    full = estimate(LLAMA_8B, users_run())
    capped = estimate(LLAMA_8B, users_run(rollout__generation_batch_size=4))
    # 4 of the 16 sequences decoded at once: 131,072 B a token × 640 tokens × 4; the prefill of
    # 4 prompts of 512: 4·512 · 2 B · (2·4096 + 3·14336) + the last tokens' logits 4 · 128256 · 12
    assert capped["kv_cache"] == 131_072 * 640 * 4 == full["kv_cache"] // 4
    assert capped["prefill"] == 4 * 512 * 2 * (2 * 4096 + 3 * 14336) + 4 * 128_256 * 12
    assert capped["activations"] == full["activations"]  # training is unchanged


def test_ladder_decodes_in_smaller_batches_before_costing_quality():
    # the generation peak: all 64 completions (8 prompts × K 8) of 512 + 512 tokens decoded at
    # once, KV cache 8 GiB + prefill 3.2 GiB over 16.4 GiB resident; training is 2.7 GiB
    run = users_run(rollout__num_generations=8, rollout__max_completion_length=512,
                    rollout__max_seq_length=1024, train__micro_batch_size=4,
                    train__gradient_accumulation_steps=16, model__gradient_checkpointing=True)
    steps = ladder(lambda c, n: estimate(LLAMA_8B, c, nproc=n), run, 24 * GIB)
    assert [s.arguments for s in steps] == [["--set", "rollout.generation_batch_size=32"]]
    assert "none in quality" in steps[0].cost and steps[0].total <= 24 * GIB


def test_ladder_from_an_8bit_base_swaps_it_for_a_4bit_one():
    # the 4-bit rung used to add load_in_4bit beside load_in_8bit: the estimate of that config
    # raised "both are set", so `mogrpo plan` printed that error instead of a plan
    run = users_run(model__load_in_8bit=True)
    steps = ladder(lambda c, n: estimate(LLAMA_8B, c, nproc=n), run, parse_size("8GiB"))
    four = next(s for s in steps if s.change.startswith("4-bit NF4 base weights"))
    assert four.overrides == ["model.load_in_8bit=false", "model.load_in_4bit=true"]
    assert four.saving > 0 and steps[-1].total <= 8 * GIB


def test_ladder_offers_no_4bit_base_to_a_vllm_run():
    # the config check refuses a quantised policy under rollout.engine: vllm ("its weight push
    # needs unquantised weights"), so a rung setting load_in_4bit gave flags that cannot run
    run = users_run(rollout__engine="vllm")
    steps = ladder(lambda c, n: estimate(LLAMA_8B, c, nproc=n, gpu_memory=16 * GIB), run,
                   16 * GIB)
    assert steps and not any("load_in_4bit" in o for s in steps for o in s.overrides)
    with pytest.raises(ConfigError, match="vllm cannot follow a quantised policy"):
        validate(with_changes(run, {"model.load_in_4bit": True}), machine=False)


def test_the_quick_eval_decodes_in_the_generation_phase():
    from mogrpo.eval.quick_eval import EVAL_BATCH
    from mogrpo.memory.estimate import EVAL_BATCH as PLANNED

    assert PLANNED == EVAL_BATCH == 32
    # USERS.md's run evaluates held-out prompts greedily: 32 at once, twice the step's 16
    # completions (the plan counted 16, so a generation-bound run that "fit" ran out at eval)
    task = {"data": "x.jsonl", "rewards": ["mc_correct"], "beta": 0.1, "eval_size": 64}
    rollout = users_run()
    evaluated = estimate(LLAMA_8B, users_run(tasks={"fairness": task}))
    assert evaluated["kv_cache"] == 131_072 * 640 * 32 == 2 * estimate(LLAMA_8B, rollout)["kv_cache"]
    assert "32 seqs (the quick eval's batch) × 640 tokens" in evaluated.table()
    # fewer held-out prompts, or two processes sharing them, decode fewer at once
    small = {**task, "eval_size": 10}
    assert estimate(LLAMA_8B, users_run(tasks={"fairness": small}))["kv_cache"] == \
        estimate(LLAMA_8B, rollout)["kv_cache"]
    # the generation batch caps the eval too (mogrpo.eval.quick_eval), so the ladder's rung holds
    capped = estimate(LLAMA_8B, users_run(tasks={"fairness": task},
                                          rollout__generation_batch_size=8))
    assert capped["kv_cache"] == 131_072 * 640 * 8
