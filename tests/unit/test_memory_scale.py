"""The memory planner per process: ddp replicates, fsdp shards, both split the step; the ladder
and `mogrpo memory --nproc` suggest FSDP2 or more GPUs. Figures computed by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from mogrpo.config import RunConfig
from mogrpo.config.processes import check_processes
from mogrpo.errors import ConfigError
from mogrpo.memory import GIB, estimate, ladder, main, scale_out
from mogrpo.modeling.architecture import Architecture

# Llama-3.2-1B's shape: hidden 2048, 16 layers, 32 heads of 64, 8 KV heads, SwiGLU 8192,
# vocabulary 128256, tied embeddings.
LLAMA_1B = {
    "model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 8192,
    "vocab_size": 128256, "tie_word_embeddings": True,
}
# per block: q, o 2048² + k, v 2048·512 + gate, up, down 2048·8192 + 2 RMSNorms 2048
BLOCK = 2 * 4_194_304 + 2 * 1_048_576 + 3 * 16_777_216 + 2 * 2048
ROOT = 128_256 * 2048 + 2048  # the (tied) embedding and the final norm
N = 16 * BLOCK + ROOT
# one training micro-batch of 8 × 512 tokens, fp32, full fine-tuning (test_memory.py's rules):
# per token and layer 4·2·2048 (RMSNorm inputs) + 4·(2·2048 + 2·512) (q, k, v, out)
# + 3·4·8192 (SwiGLU) + 4·(2·2048 + 2·2048 + 8192) (inputs of trainable weights) = 200,704 B;
# head: final norm input 4096·4·2048 + normed and head inputs 4·2048·(4096 + 8·257)
ACTIVATIONS_MB8 = 8 * 512 * 16 * 200_704 + 4096 * 4 * 2048 + 4 * 2048 * (4096 + 8 * 257)
LOGITS_MB8 = 8 * 128_256 * (4 * 257 + 4 * 256)  # fp32 logits over 257 positions + log-softmax
# one process shares prompts (2 distinct prompts of 256 + 8 completions of 256 = 2560 tokens
# through the layers): 2560 · 16 layers · 200,704 B = 8,220,835,840; the final norm's fp32
# input 2560 · 4 · 2048 = 20,971,520; the normed and head inputs 4 · 2048 · (2560 + 8 · 257)
# = 37,814,272; each row's copy of its prompt's keys and values 8·256 · 2·512 · 4 B · 16 layers
# = 134,217,728. The head is chunked: one 130-token chunk of fp32 logits and the head's fp32
# weight gradient in the backward, 16 B a token of logsumexp, target and log-prob (head_mb).
ACTIVATIONS_SHARED = (2560 * 16 * 200_704 + 2560 * 4 * 2048 + 4 * 2048 * (2560 + 8 * 257)
                      + 8 * 256 * 2 * 512 * 4 * 16)


def head_mb(rows: int) -> int:
    """The chunked head's working set for a micro-batch of `rows` completions of 256 tokens."""
    return 130 * 128_256 * 4 + 128_256 * 2048 * 4 + 16 * rows * 256


def run_1b(**sections) -> RunConfig:
    """Full fine-tuning in fp32 (fp32 AdamW m, v), β > 0, 32 completions per step (8 prompts
    × K 4) in micro-batches of 8."""
    data = {
        "model": {"name_or_path": "llama-1b", "dtype": "float32"},
        "tasks": {"t": {"data": "x.jsonl", "rewards": ["mc_correct"], "beta": 0.04}},
        "rollout": {"num_generations": 4, "max_seq_length": 512, "max_prompt_length": 256,
                    "max_completion_length": 256},
        # each distinct prompt once, as ACTIVATIONS_SHARED counts
        "train": {"micro_batch_size": 8, "gradient_accumulation_steps": 4,
                  "prompt_sharing": "on"},
    }
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return RunConfig.model_validate(data)


def test_block_and_root_parameters():
    arch = Architecture.from_config(LLAMA_1B)
    assert (arch.block_params, arch.params) == (60_821_504, 1_235_814_400)
    assert arch.params == N


def test_single_process_is_unchanged_by_the_layout():
    est = estimate(LLAMA_1B, run_1b())
    assert est["weights"] == est["gradients"] == est["reference"] == N * 4
    assert est["optimizer"] == N * 8
    assert est["activations"] == ACTIVATIONS_SHARED == 8_413_839_360
    assert est["logits"] == head_mb(8)
    assert est["kv_cache"] == 2 * 16 * 512 * 4 * 512 * 32  # all 32 completions at once
    assert "ddp_buckets" not in [t.key for t in est.terms]
    assert est.title.startswith("memory estimate: llama")


@pytest.mark.parametrize("nproc", [2, 8])
def test_ddp_replicates_the_model_and_splits_the_step(nproc):
    est = estimate(LLAMA_1B, run_1b(), nproc=nproc)  # strategy auto = ddp
    # every process: the whole model, gradients, DDP's bucket copy of them, m and v, reference
    assert est["weights"] == est["gradients"] == est["ddp_buckets"] == est["reference"] == N * 4
    assert est["optimizer"] == N * 8
    # 24 GiB whatever the process count; the gradients only from backward to the optimizer step
    assert est.phase("always") == N * 20 + GIB
    # each process generates 32 / nproc completions and trains on micro-batches of at most 8
    # (DDP: no prompt sharing); the gradients are in training from a 2nd micro-batch on
    rows = 32 // nproc
    grads = est["gradients"] if rows > 8 else 0
    assert est.phase("training") - est.phase("generation") == \
        grads + est["activations"] + est["logits"] - est["kv_cache"] - est["prefill"]
    assert est["kv_cache"] == 2 * 16 * 512 * 4 * 512 * rows
    assert est["activations"] == ACTIVATIONS_MB8 * min(8, rows) // 8
    assert est["logits"] == head_mb(min(8, rows))
    assert est.total == N * 20 + GIB + est.phase("training")
    assert est.title.startswith(f"memory estimate per process (ddp, {nproc} processes)")


def test_fsdp_shards_state_and_adds_what_it_gathers():
    two = estimate(LLAMA_1B, run_1b(distributed={"strategy": "fsdp"}), nproc=2)
    assert two["weights"] == two["gradients"] == two["reference"] == N * 2  # 4 B / 2
    assert two["optimizer"] == N * 4 and two["optimizer_step"] == 0  # fused AdamW
    assert "ddp_buckets" not in [t.key for t in two.terms]
    # training: the root (263 M) stays gathered, plus the running and the prefetched block,
    # fp32; in backward the root's and one block's unsharded gradients
    assert two["fsdp_gather"] == (ROOT + 2 * BLOCK) * 4 == 1_537_253_376
    assert two["fsdp_grads"] == (ROOT + BLOCK) * 4 == 1_293_967_360
    assert two["fsdp_rollout"] == N * 4  # the whole model gathered to generate
    training = ACTIVATIONS_MB8 + LOGITS_MB8 + 1_537_253_376 + 1_293_967_360
    assert two.total == N * 10 + GIB + training  # 12.5 + 16.9 = 29.4 GiB per process
    assert f"{two.total / GIB:7.2f}" == "  29.44"

    eight = estimate(LLAMA_1B, run_1b(distributed={"strategy": "fsdp"}), nproc=8)
    assert eight["weights"] == eight["gradients"] == eight["reference"] == N // 2  # 4 B / 8
    assert eight["optimizer"] == N  # 8 B / 8
    assert eight.phase("always") == N * 2 + GIB  # weights N/2 + AdamW N + reference N/2
    # 4 completions each: micro-batches of 4, half the activations of 8 (FSDP2: no prompt
    # sharing, the model's own logits)
    assert eight["activations"] == ACTIVATIONS_MB8 // 2
    # one micro-batch a pass: the gradient shard (N/2) exists from its backward on, counted
    # with the optimizer step, so the training peak holds activations, logits and gathers only
    assert eight.total == N * 2 + GIB + ACTIVATIONS_MB8 // 2 + LOGITS_MB8 // 2 + \
        1_537_253_376 + 1_293_967_360


def test_fsdp_bf16_mixed_precision_halves_the_compute_copy():
    mixed = estimate(LLAMA_1B, run_1b(distributed={"strategy": "fsdp",
                                                   "mixed_precision": "bf16"}), nproc=8)
    assert mixed["weights"] == N // 2  # the shards stay fp32
    assert mixed["fsdp_gather"] == (ROOT + 2 * BLOCK) * 2
    assert mixed["fsdp_rollout"] == N * 2
    # bf16 gradients, cast to fp32 for the reduce-scatter
    assert mixed["fsdp_grads"] == (ROOT + BLOCK) * (2 + 4)
    # activations are those of a bf16 model with micro-batches of 4 whose prompts are not
    # shared (as under DDP; one process would run each distinct prompt once)
    bf16 = estimate(LLAMA_1B, run_1b(model={"dtype": "bfloat16"},
                                     distributed={"strategy": "ddp"}), nproc=8)
    assert mixed["activations"] == bf16["activations"]


def test_fsdp_without_reshard_after_forward_keeps_every_block():
    est = estimate(LLAMA_1B, run_1b(distributed={"strategy": "fsdp",
                                                 "reshard_after_forward": False}), nproc=2)
    assert est["fsdp_gather"] == N * 4


def test_fsdp_reference_absent_under_lora_and_at_beta_zero():
    lora = estimate(LLAMA_1B, run_1b(lora={"enabled": True, "r": 8},
                                     distributed={"strategy": "fsdp"}), nproc=2)
    assert lora["reference"] == 0 and lora["weights"] == N * 2
    no_kl = estimate(LLAMA_1B, run_1b(tasks={"t": {"data": "x", "rewards": ["f"], "beta": 0.0}},
                                      distributed={"strategy": "fsdp"}), nproc=2)
    assert no_kl["reference"] == 0


def test_vllm_rollout_gathers_nothing():
    est = estimate(LLAMA_1B, run_1b(rollout={"engine": "vllm"},
                                    distributed={"strategy": "fsdp"}), nproc=2)
    assert "fsdp_rollout" not in [t.key for t in est.terms]


def test_process_counts_the_trainer_would_refuse():
    with pytest.raises(ConfigError, match="8 prompts per step do not split over 3 processes"):
        check_processes(run_1b(), 3)
    with pytest.raises(ConfigError, match="strategy: none trains in one process, but 2 processes "
                       "were asked for"):
        check_processes(run_1b(distributed={"strategy": "none"}), 2)
    with pytest.raises(ConfigError, match="--nproc 0"):
        check_processes(run_1b(), 0)
    assert [check_processes(run_1b(), n) for n in (1, 2)] == ["none", "ddp"]
    # one process is never wrapped, whatever the config says
    fsdp = run_1b(distributed={"strategy": "fsdp"})
    assert check_processes(fsdp, 1) == "none"
    assert estimate(LLAMA_1B, fsdp).total == estimate(LLAMA_1B, run_1b()).total


def fn(c, n):
    return estimate(LLAMA_1B, c, nproc=n)


def test_one_gpu_too_small_suggests_fsdp_over_more_gpus():
    gpu = 32 * GIB
    run = run_1b()
    assert fn(run, 1).total > gpu  # 38.3 GiB
    # ddp over 2 still holds 26.6 GiB of state per process: no; fsdp over 2 fits as it is
    assert fn(run, 2).total > gpu
    step = scale_out(fn, run, gpu)
    assert (step.nproc, step.changes) == (2, {"distributed.strategy": "fsdp"})
    assert step.total == N * 10 + GIB + ACTIVATIONS_MB8 + LOGITS_MB8 + 1_537_253_376 + \
        1_293_967_360
    assert step.arguments == ["--nproc", "2", "--set", "distributed.strategy=fsdp"]
    # on 16 GiB, fsdp over 2 needs 18.4 GiB even with checkpointing: 4 processes
    small = scale_out(fn, run, 16 * GIB)
    assert (small.nproc, small.changes) == (4, {"distributed.strategy": "fsdp",
                                                "model.gradient_checkpointing": True})
    assert small.total <= 16 * GIB
    assert scale_out(fn, run, 2 * GIB) is None  # the CUDA context alone is a GiB


def test_equal_process_counts_prefer_ddp():
    # a LoRA run: fsdp over 2 would fit too, but ddp moves less over the network
    lora = {"enabled": True, "r": 16}
    run = run_1b(lora=lora, model={"dtype": "bfloat16"},
                 train={"micro_batch_size": 32, "gradient_accumulation_steps": 1})
    gpu = fn(run, 1).total - GIB
    step = scale_out(fn, run, gpu)
    assert (step.nproc, step.changes) == (2, {"distributed.strategy": "ddp"})
    assert fn(run_1b(lora=lora, model={"dtype": "bfloat16"},
                     train={"micro_batch_size": 32, "gradient_accumulation_steps": 1},
                     distributed={"strategy": "fsdp"}), 2).total <= gpu


def test_ladder_shards_the_processes_already_launched():
    steps = ladder(fn, run_1b(), 20 * GIB, nproc=2)
    shard = next(s for s in steps if s.change.startswith("shard with FSDP2"))
    assert shard.changes["distributed.strategy"] == "fsdp"
    assert shard.arguments[:2] == ["--set", "distributed.strategy=fsdp"]
    assert steps[-1].total <= 20 * GIB
    # more GPUs means more than the 2 already there (fsdp over 2 is the rung above)
    assert scale_out(fn, run_1b(), 20 * GIB, nproc=2).nproc == 4
    # with one process there is nothing to shard
    assert not any(s.change.startswith("shard") for s in ladder(fn, run_1b(), 20 * GIB))


def write_run(tmp_path: Path, run: RunConfig) -> Path:
    """`run` as a config file whose model is a folder holding Llama-1B's config.json."""
    model = tmp_path / "llama-1b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA_1B), encoding="utf-8")
    data = run.model_dump(mode="json")
    data["model"]["name_or_path"] = str(model)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def test_memory_command_per_process(tmp_path: Path, capsys):
    path = write_run(tmp_path, run_1b())
    assert main([str(path), "--gpu-memory", "32GiB"]) == 3
    out = capsys.readouterr().out
    # always 19.42 (N × 16 B + 1 GiB) + training 13.48 (gradients N × 4 B, ACTIVATIONS_SHARED,
    # head_mb(8)); fsdp over 2: 29.44 (test_fsdp_shards_state_and_adds_what_it_gathers)
    assert "does not fit: 32.9 GiB > 32.0 GiB" in out
    assert "or, at no cost in quality, on more GPUs (one process each):\n  1. fsdp over 2 " \
        "processes — saves 3.5 GiB → 29.4 GiB per process" in out
    assert "     --nproc 2 --set distributed.strategy=fsdp" in out
    assert main([str(path), "--gpu-memory", "32GiB", "--nproc", "2", "--set",
                 "distributed.strategy=fsdp"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("memory estimate per process (fsdp, 2 processes): llama")
    assert "fits: 29.4 of 32.0 GiB per process" in out
    assert main([str(path), "--nproc", "3"]) == 2
    assert "error: 8 prompts per step do not split over 3 processes" in capsys.readouterr().err


def test_vllm_colocated_holds_its_share_while_sampling_and_a_server_nothing():
    hf = estimate(LLAMA_1B, run_1b())
    keys = lambda est: {t.key for t in est.terms}  # noqa: E731
    assert {"kv_cache", "prefill"} <= keys(hf)
    gpu = 40 * GIB
    colocated = estimate(LLAMA_1B, run_1b(rollout={"engine": "vllm"}), gpu_memory=gpu)
    # vLLM computes its KV cache and prefill inside its share: 0.3 of the GPU, while sampling
    assert not {"kv_cache", "prefill"} & keys(colocated)
    assert colocated["vllm"] == int(0.3 * gpu)
    assert colocated.phase("generation") == int(0.3 * gpu)
    assert colocated.total == colocated.phase("always") + max(
        colocated.phase(p) for p in ("generation", "training", "optimizer step"))
    awake = estimate(LLAMA_1B, run_1b(rollout={"engine": "vllm", "vllm": {
        "sleep_during_update": False, "gpu_memory_utilization": 0.25}}), gpu_memory=gpu)
    assert awake.phase("always") == colocated.phase("always") + int(0.25 * gpu)  # never freed
    unknown = estimate(LLAMA_1B, run_1b(rollout={"engine": "vllm"}))
    assert "vllm" not in keys(unknown)
    assert any("vLLM's share not counted" in a and "--gpu-memory" in a
               for a in unknown.assumptions)
    server = estimate(LLAMA_1B, run_1b(rollout={"engine": "vllm", "vllm": {
        "server_url": "http://10.0.0.7:8100"}}), gpu_memory=gpu)
    assert not {"kv_cache", "prefill", "vllm"} & keys(server)
    assert server.phase("generation") == 0 and server.phase("always") == hf.phase("always")
    assert server.total == hf.phase("always") + max(hf.phase("training"),
                                                    hf.phase("optimizer step"))
    assert hf.phase("generation") == hf["kv_cache"] + hf["prefill"]  # no gradients by then


def test_the_ladder_lowers_a_colocated_vllm_share_where_sampling_is_the_peak():
    share = {"rollout": {"engine": "vllm", "vllm": {"gpu_memory_utilization": 0.6}}}
    gpu = 48 * GIB  # always 19.42 + generation 28.80 (0.6 of 48) GiB: 48.22, over by a little
    plan = lambda run, gpu: ladder(  # noqa: E731
        lambda c, n: estimate(LLAMA_1B, c, nproc=n, gpu_memory=gpu), run, gpu)
    (step,) = plan(run_1b(**share), gpu)  # micro-batch and checkpointing would save nothing
    assert step.arguments == ["--set", "rollout.vllm.gpu_memory_utilization=0.45"]
    assert step.saving == int(0.6 * gpu) - int(0.45 * gpu) and step.total <= gpu
    assert "fewer sequences at once" in step.cost
    # 32 GiB: 0.45 of it (14.4) over 19.42 does not fit, 0.3 (9.6) does; then the training
    # peak, 19.42 + 13.48 = 32.90 GiB, needs a rung of its own
    steps = plan(run_1b(**share), 32 * GIB)
    assert steps[0].arguments == ["--set", "rollout.vllm.gpu_memory_utilization=0.3"]
    assert steps[0].total == estimate(LLAMA_1B, run_1b()).total  # the training peak
    assert len(steps) > 1 and steps[-1].total <= 32 * GIB
    awake = {"rollout": {"engine": "vllm", "vllm": {"sleep_during_update": False}}}
    steps = plan(run_1b(**awake), 24 * GIB)  # its share held through the update: put it to sleep
    assert ["--set", "rollout.vllm.sleep_during_update=true"] in [s.arguments for s in steps]
    server = {"rollout": {"engine": "vllm", "vllm": {"server_url": "http://10.0.0.7:8100"}}}
    assert not any("vllm" in " ".join(s.arguments) for s in plan(run_1b(**server), 24 * GIB))


def test_a_vllm_run_is_planned_on_a_machine_without_vllm_or_a_gpu(tmp_path: Path, capsys):
    from mogrpo.cli import main as mogrpo
    from mogrpo.config.engines import vllm_unavailable_reason

    assert vllm_unavailable_reason() is not None  # this machine could not run it
    path = write_run(tmp_path, run_1b(rollout={"engine": "vllm"}))
    assert main([str(path), "--gpu-memory", "80GiB"]) == 0
    out = capsys.readouterr().out
    assert "vLLM engine (weights + KV cache)    24.00  generation      30% of 80 GiB" in out
    # the gradients (4.60 GiB) are freed before vLLM wakes: not in the generation phase
    assert "peak                                43.42  = always 19.42 + generation 24.00" in out
    assert mogrpo(["config", "show", str(path)]) == 0
    capsys.readouterr()
    assert mogrpo(["train", str(path)]) == 2  # training it here is refused, with the reason
    assert "vLLM is not installed" in capsys.readouterr().err
