#!/usr/bin/env bash
# Every GPU-only check, most needed first, sized for a short lease on one CUDA GPU:
#
#   benchmarks/gpu_check.sh OUT_DIR [SECONDS]        # on the GPU machine (default 420 s)
#   GPU_CHECK_DEVICE=cpu benchmarks/gpu_check.sh OUT_DIR 1200   # a dry run here, on the CPU
#
# Steps, in this order (each with its own time limit; a step that would start with less than
# its limit left is skipped with a line saying so, so the most needed results come first):
#
#  1. equivalence   gpu_equivalence.py: the native engine against generate() (six families,
#                   fp32 and bf16, LoRA, the sampling distribution) and its CUDA-graphed decode
#                   against its eager one (captures per bucket, rows leaving);
#  2. decode        decode_speed.py --sizes xl: tokens/s of native (graphed and eager) against
#                   generate() at 0.21 B, 128 rows × 32 tokens;
#  3. vs_trl_bf16   vs_trl/run.py --precision bf16-mixed, 0.21 B full fine-tuning: both tools
#                   as users train on GPUs (float32 weights, bf16 autocast);
#  4. update        profile_step.py --torch-profile --trl: where mogrpo's and TRL's steps spend
#                   the GPU outside generation (kernels a step, busy time, the top operators);
#  5. sharing       prompt_sharing.py: the update with each distinct prompt once and without
#                   (what train.prompt_sharing: auto decides on a GPU);
#  6. memory        memory_vs_plan.py: torch.cuda.max_memory_allocated against the planner at
#                   Qwen2.5-0.5B, full fine-tuning and LoRA in bf16-mixed (a GPU's default);
#     memory_bnb    the same for bitsandbytes' 8-bit AdamW and QLoRA (a 4-bit base), when
#                   bitsandbytes is installed (gpu_wheels.sh --bitsandbytes);
#  7. smoke         gpu_smoke.py --engines native hf: `mogrpo train` end to end with each engine.
#  8. vs_trl_fp32   vs_trl/run.py in fp32, small and 0.21 B, full and LoRA (the H200 table's
#                   settings, for before/after);
#
# Results go under OUT_DIR as each step ends; with GPU_CHECK_ARCHIVE=FILE, OUT_DIR is also
# packed into FILE (a .tgz) after every step, so a lease that ends early keeps what finished.
# Needs mogrpo's requirements and the bench extra (TRL); `benchmarks/gpu_run.sh` installs them
# from wheels prepared by `benchmarks/gpu_wheels.sh` and runs this. vLLM is not needed
# (gpu_smoke.sh runs the vLLM engines).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out=${1:?usage: benchmarks/gpu_check.sh OUT_DIR [SECONDS]}
budget=${2:-420}
device=${GPU_CHECK_DEVICE:-cuda}
archive=${GPU_CHECK_ARCHIVE:-}
mkdir -p "$out"
out=$(cd "$out" && pwd)
py=$(command -v python3 || command -v python)  # a GPU image's python3 holds torch
work=$(mktemp -d)  # models, runs and profiles: scratch, not results
start=$SECONDS
left() { echo $(( budget - (SECONDS - start) )); }
if [ "$device" = cuda ]; then
    big=xl     # 0.21 B: the size the issue's GPU targets name
    nvidia-smi -L || { echo "gpu_check: no NVIDIA GPU visible" >&2; exit 1; }
else
    big=small  # the dry run: every step's command on the CPU, at the smallest size
    echo "gpu_check: a dry run on the CPU (GPU_CHECK_DEVICE=$device)"
fi
"$py" - "$device" <<'EOF' || exit 1
import importlib, sys
for name in ("torch", "transformers", "peft", "accelerate", "datasets", "pydantic", "mogrpo",
             "trl", "bitsandbytes"):
    try:
        module = importlib.import_module(name)
    except ImportError as err:
        if name in ("trl", "bitsandbytes"):
            print(f"{name} missing: the steps that need it are skipped")
            continue
        raise SystemExit(f"gpu_check: {name} is missing ({err}); install mogrpo's requirements")
    print(name, getattr(module, "__version__", "?"))
import torch
if sys.argv[1] == "cuda":
    assert torch.cuda.is_available(), "torch sees no CUDA GPU"
    print(torch.cuda.get_device_name(0), f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
EOF
has() { "$py" -c "import $1" 2>/dev/null; }

pack() {  # OUT_DIR into the archive, when one is asked for
    [ -n "$archive" ] && tar czf "$archive.part" -C "$out" . && mv "$archive.part" "$archive"
    return 0
}

step() {  # step NAME SECONDS COMMAND...: run with a limit if that much time is left
    local name=$1 limit=$2; shift 2
    if [ "$(left)" -lt "$limit" ]; then
        echo "== $name: skipped, $(left) s left of the budget and it needs up to $limit s"
        return 0
    fi
    echo "== $name (limit ${limit} s, $(left) s left)"
    local t0=$SECONDS
    timeout --signal=INT --kill-after=10 "$limit" "$@"
    echo "== $name: exit $?, $(( SECONDS - t0 )) s"
    pack
}

step equivalence 90 "$py" benchmarks/gpu_equivalence.py --device "$device" \
    --out "$out/gpu_equivalence"
step decode 60 "$py" benchmarks/decode_speed.py --device "$device" --sizes "$big" \
    --prompts 16 --k 8 --repeats 3 --out "$out/decode_speed_gpu"
if has trl; then
    step vs_trl_bf16 110 "$py" benchmarks/vs_trl/run.py --device "$device" --sizes "$big" \
        --modes full --precision bf16-mixed --repeats 2 --steps 6 --work "$work/vs-trl-bf16" \
        --out "$out/vs_trl_gpu_bf16"
    # the rollout is left out of the profile; its CUDA graphs are too (no capture under the
    # profiler's session)
    MOGRPO_DECODE_GRAPH=0 step update 70 "$py" benchmarks/profile_step.py --device "$device" --size "$big" \
        --mode full --precision bf16-mixed --steps 6 --threads 1 --trl --work "$work/profile" \
        --torch-profile "$out/update_profile.txt" --out "$out/update_phases.txt"
fi
step sharing 60 "$py" benchmarks/prompt_sharing.py --device "$device" --precision bf16-mixed \
    --sizes "$big" --repeats 1 --steps 6 --no-ops --work "$work/sharing" \
    --out "$out/prompt_sharing"
if [ "$device" = cuda ]; then
    step memory 90 "$py" benchmarks/memory_vs_plan.py --work "$work/memory" \
        --out "$out/memory_vs_plan" --cases qwen2.5-0.5b/full-bf16-mixed \
        qwen2.5-0.5b/lora-bf16-mixed
    if has bitsandbytes; then
        step memory_bnb 90 "$py" benchmarks/memory_vs_plan.py --work "$work/memory" \
            --out "$out/memory_vs_plan" --cases qwen2.5-0.5b/full-adamw8bit \
            qwen2.5-0.5b/qlora-bf16-mixed
    fi
else  # a 0.5 B model's two steps take minutes on a CPU: the table alone, from the CPU results
    cp benchmarks/results/memory_vs_plan.json "$work/memory_vs_plan.json"
    step memory 60 "$py" benchmarks/memory_vs_plan.py --report --out "$work/memory_vs_plan"
fi
if [ "$device" = cuda ]; then  # two `mogrpo train` processes of ~30 s each on the H200
    step smoke 90 "$py" benchmarks/gpu_smoke.py --engines native hf --steps 6 \
        --work "$work/gpu-smoke" --out "$out/gpu_smoke.json"
fi
sizes="$big small"
[ "$big" = small ] && sizes=small
if has trl; then
    step vs_trl_fp32 "$(( $(left) > 60 ? $(left) - 10 : 60 ))" "$py" benchmarks/vs_trl/run.py \
        --device "$device" --sizes $sizes --modes full lora --repeats 2 --steps 8 \
        --work "$work/vs-trl" --out "$out/vs_trl_gpu"
fi
echo "gpu_check: done in $(( SECONDS - start )) s; results in $out"
