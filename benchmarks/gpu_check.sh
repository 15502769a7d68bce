#!/usr/bin/env bash
# Every GPU check of the rollout engines in one go, sized for a short lease on one CUDA GPU:
#
#   benchmarks/gpu_check.sh OUT_DIR [SECONDS]
#
# 1. gpu_equivalence.py: the native engine against generate() on the GPU (greedy completions and
#    log-probs for six families in fp32, bf16 agreement, LoRA, the sampling distribution), and
#    its CUDA-graphed decode against its eager one (captures per bucket, rows leaving);
# 2. gpu_smoke.py --engines native hf: a short `mogrpo train` with each engine;
# 3. decode_speed.py --device cuda: tokens/s of native against generate() at 128 rows, and of
#    the graphed decode step against the eager one (MOGRPO_DECODE_GRAPH=0);
# 4. rollout_profile.py --train: the rollouts inside `mogrpo train` (the smoke test's bf16 model)
#    timed and profiled, native without and with cuDNN's attention kernel, and generate();
#    their timings go to the log, their profiles to a scratch folder;
# 5. vs_trl/run.py --device cuda: mogrpo against TRL's GRPOTrainer on the GPU (both fp32,
#    neither with vLLM; the 0.21 B size first), with whatever is left of SECONDS (default 480).
#
# Each step has its own time limit and writes its results under OUT_DIR as it goes, so a step
# that fails or runs out of time leaves the others' results. Needs mogrpo's requirements and the
# bench extra (TRL); vLLM is not needed (gpu_smoke.sh runs the vLLM engines).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out=${1:?usage: benchmarks/gpu_check.sh OUT_DIR [SECONDS]}
budget=${2:-480}
mkdir -p "$out"
py=$(command -v python || command -v python3)
work=$(mktemp -d)  # models, runs and profiles: scratch, not results
export work
start=$SECONDS
left() { echo $(( budget - (SECONDS - start) )); }

nvidia-smi -L || { echo "gpu_check: no NVIDIA GPU visible" >&2; exit 1; }
"$py" - <<'EOF' || exit 1
import importlib
for name in ("torch", "transformers", "peft", "datasets", "mogrpo", "trl"):
    try:
        module = importlib.import_module(name)
    except ImportError as err:
        if name != "trl":
            raise SystemExit(f"gpu_check: {name} is missing ({err}); install mogrpo's requirements")
        print("trl missing: the vs_trl step is skipped (pip install 'mogrpo[bench]')")
        continue
    print(name, getattr(module, "__version__", "?"))
import torch
assert torch.cuda.is_available(), "torch sees no CUDA GPU"
EOF

step() {  # step NAME SECONDS COMMAND...: run with a limit, report how it ended
    local name=$1 limit=$2; shift 2
    echo "== $name (limit ${limit} s, $(left) s left)"
    local t0=$SECONDS
    timeout --signal=INT --kill-after=10 "$limit" "$@"
    echo "== $name: exit $?, $(( SECONDS - t0 )) s"
}

step equivalence 120 "$py" benchmarks/gpu_equivalence.py --out "$out/gpu_equivalence"
step smoke 120 "$py" benchmarks/gpu_smoke.py --engines native hf --steps 6 \
    --work "$work/gpu-smoke" --out "$out/gpu_smoke.json"
step decode 150 "$py" benchmarks/decode_speed.py --device cuda --sizes small large xl \
    --prompts 16 --k 8 --repeats 3 --out "$out/decode_speed_gpu"
profile_rollouts() {  # each run's timing line; its profile and log stay in the scratch folder
    local dir=$work/rollout-profile args name
    for args in "--train native" "--train native --allow-cudnn" "--train hf"; do
        name=${args//[ -]/}
        mkdir -p "$dir/$name"
        # shellcheck disable=SC2086  # the options split on purpose
        "$py" benchmarks/rollout_profile.py $args --out "$dir/$name" > "$dir/$name.log" 2>&1
        grep 'profiled rollouts' "$dir/$name.log" || tail -20 "$dir/$name.log"
    done
}
export -f profile_rollouts
export py
step rollouts 150 bash -c profile_rollouts
"$py" -c "import trl" 2>/dev/null || exit 0
step vs_trl "$(left)" "$py" benchmarks/vs_trl/run.py --device cuda --sizes xl small \
    --modes full lora --repeats 2 --steps 8 --work "$work/vs-trl" --out "$out/vs_trl_gpu"
