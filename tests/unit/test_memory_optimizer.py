"""The planner's optimizer figures per `train.optimizer`, and FSDP2's CPU offload: computed by
hand for the published shapes (test_memory.py's Llama-3-8B and Qwen2.5-1.5B)."""

from __future__ import annotations

import pytest
from test_memory import LLAMA_8B, QWEN_1_5B, qwen_full_run, users_run

from mogrpo.memory import GIB, estimate, ladder
from mogrpo.memory.optimizer import Trained, state_bytes

# Llama-3-8B, LoRA r 16 on every linear layer; per block, A (16 × in) and B (out × 16) of
# q, o (4096 → 4096), k, v (4096 → 1024), gate, up (4096 → 14336), down (14336 → 4096):
# nine tensors of 65,536 values, two of 16,384 (k's and v's B), three of 229,376
LORA_8B = 32 * (9 * 65_536 + 2 * 16_384 + 3 * 229_376)


def test_lora_states_by_optimizer():
    assert LORA_8B == 41_943_040
    adamw, eight, paged, adafactor = (
        estimate(LLAMA_8B, users_run(train__optimizer=kind))
        for kind in ("adamw", "adamw_8bit", "paged_adamw_8bit", "adafactor"))
    assert adamw["optimizer"] == LORA_8B * 8  # fp32 m and v
    # uint8 m and v, and an fp32 absmax per 256 values for each: every tensor is a multiple of
    # 256 and above bitsandbytes' 4,096-value threshold, so 2 + 8/256 B a parameter
    assert eight["optimizer"] == paged["optimizer"] == LORA_8B * 2 + LORA_8B // 256 * 8
    assert eight["optimizer"] == 85_196_800
    # Adafactor: fp32 means of rows and columns; per block q, o (16 + 4096) + (4096 + 16),
    # k, v (16 + 4096) + (1024 + 16), gate, up, down (16 + 4096) + (14336 + 16)
    assert adafactor["optimizer"] == 4 * 32 * (2 * 8224 + 2 * 5152 + 3 * 18_464) == 10_514_432
    # step: the trainer's fused AdamW and bitsandbytes update in place; Adafactor grad² and
    # its estimate for the largest adapter matrix (14336 × 16), fp32
    assert adamw["optimizer_step"] == eight["optimizer_step"] == paged["optimizer_step"] == 0
    assert adafactor["optimizer_step"] == 229_376 * 4 * 2
    assert "8-bit AdamW states" in eight.table() and "paged" in paged.table()
    assert adafactor.total == adamw.total - adamw["optimizer"] + adafactor["optimizer"]


def test_full_fine_tuning_states_by_optimizer():
    n = 1_543_714_304
    vectors = 144_896  # 28 blocks × (2 RMSNorms × 1536 + q, k, v biases 1536 + 256 + 256) + 1536
    assert vectors == 28 * (2 * 1536 + 2048) + 1536
    adamw, eight, adafactor = (estimate(QWEN_1_5B, qwen_full_run(train={
        "micro_batch_size": 8, "gradient_accumulation_steps": 1, "optimizer": kind}))
        for kind in ("adamw", "adamw_8bit", "adafactor"))
    assert adamw["optimizer"] == n * 4  # pure bf16: m and v in bf16
    # every matrix (the tied embedding 151936 × 1536 among them) is a multiple of 256; the
    # 1-D weights are counted with fp32 states (most are under the 4,096-value threshold)
    assert eight["optimizer"] == (n - vectors) * 2 + (n - vectors) // 256 * 8 + vectors * 8
    assert eight["optimizer"] == 3_136_534_528
    # per block q, o 1536 + 1536, k, v 1536 + 256, gate, up, down 1536 + 8960; the embedding
    # 151936 + 1536; the vectors whole: all fp32, whatever the weights' dtype
    per_block = 2 * 3072 + 2 * 1792 + 3 * 10_496
    assert adafactor["optimizer"] == 4 * (28 * per_block + 153_472 + vectors) == 5_809_664
    # the step upcasts the largest matrix's bf16 gradient and weight and builds grad² and
    # its estimate: four fp32 copies of the embedding
    assert adafactor["optimizer_step"] == 151_936 * 1536 * 4 * 4
    assert state_bytes("adamw_8bit", Trained(((1, 4095),)), 4) == 4095 * 8  # under 4,096: fp32


def test_cpu_offload_keeps_the_shards_off_the_gpu():
    def run(offload: bool):
        return qwen_full_run(model={"name_or_path": "qwen", "precision": "bf16-mixed"},
                             distributed={"strategy": "fsdp", "cpu_offload": offload})

    plain, off = estimate(QWEN_1_5B, run(False), nproc=2), estimate(QWEN_1_5B, run(True), nproc=2)
    n = 1_543_714_304
    assert plain["weights"] == plain["gradients"] == n * 4 / 2
    assert plain["optimizer"] == n * 8 / 2 and plain["reference"] == n * 2 / 2
    for key in ("weights", "gradients", "optimizer", "optimizer_step", "reference"):
        assert off[key] == 0, key
    assert "in host memory (distributed.cpu_offload)" in off.table()
    # what FSDP2 gathers to the GPU to compute is the same
    assert off["fsdp_gather"] == plain["fsdp_gather"] and off["fsdp_grads"] == plain["fsdp_grads"]
    assert off.total <= plain.total - n * (4 + 8 + 2) // 2  # at least what is always there


@pytest.mark.parametrize(("optimizer", "offered"), [("adamw", True), ("adafactor", False)])
def test_the_ladder_shards_only_what_fsdp_can_step(optimizer, offered):
    run = qwen_full_run(model={"name_or_path": "qwen", "precision": "bf16-mixed"},
                        train={"micro_batch_size": 4, "gradient_accumulation_steps": 2,
                               "optimizer": optimizer})
    steps = ladder(lambda c, n: estimate(QWEN_1_5B, c, nproc=n), run, 8 * GIB, nproc=2)
    assert any(s.change.startswith("shard with FSDP2") for s in steps) == offered


def test_the_ladder_offers_8bit_adamw_to_full_fine_tuning_before_pure_bf16():
    run = qwen_full_run(model={"name_or_path": "qwen", "precision": "bf16-mixed"},
                        train={"micro_batch_size": 1, "gradient_accumulation_steps": 8})
    steps = ladder(lambda c, n: estimate(QWEN_1_5B, c, nproc=n), run, 1 * GIB)
    names = [s.change.split(":")[0] for s in steps]
    assert names.index("8-bit AdamW states") < names.index("pure bf16 weights and AdamW states")
    # 8-bit states cost little in quality; shorter or fewer completions change what GRPO sees
    for costly in ("shorter completions", "fewer completions per prompt (K)"):
        if costly in names:
            assert names.index("8-bit AdamW states") < names.index(costly)
    eight = next(s for s in steps if s.changes == {"train.optimizer": "adamw_8bit"})
    assert "--set train.optimizer=adamw_8bit" in " ".join(eight.arguments)


def test_bitsandbytes_steps_in_place_on_cuda_and_with_fp32_copies_on_a_cpu():
    """Its CPU step dequantises m and v of one tensor at a time and computes in fp32: m, v, the
    gradient, sqrt(v) and the quotient (and a 16-bit weight's fp32 copy): measured 5.0 copies
    of the largest tensor on the Qwen2.5-0.5B shape (benchmarks/memory_vs_plan.py)."""
    from mogrpo.memory.optimizer import step_bytes

    trained = Trained(((151_936, 896), (896, 4864)), vectors=896)
    for kind in ("adamw_8bit", "paged_adamw_8bit"):
        assert step_bytes(kind, trained, 4) == step_bytes(kind, trained, 4, "cuda") == 0
        assert step_bytes(kind, trained, 4, "cpu") == 5 * 4 * 151_936 * 896
        assert step_bytes(kind, trained, 2, "cpu") == 6 * 4 * 151_936 * 896
    assert step_bytes("adamw", trained, 4, "cpu") == 0  # torch's fused AdamW: in place
    cpu = estimate(QWEN_1_5B, qwen_full_run(model={"name_or_path": "qwen", "precision": "fp32"},
                                            train={"optimizer": "adamw_8bit"}), device="cpu")
    assert cpu["optimizer_step"] == 5 * 4 * 151_936 * 1536
    assert "bitsandbytes' CPU step" in cpu.table()
