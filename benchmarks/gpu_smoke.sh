#!/usr/bin/env bash
# GPU smoke test of the rollout engines: a short GRPO run with `rollout.engine: native`,
# `rollout.engine: vllm` (colocated) and vLLM server mode (`mogrpo vllm-server`, on a second GPU
# where there is one) on CUDA GPUs; their median step and rollout times (from each run's
# metrics.jsonl, time/step_s and time/rollout_s) go to benchmarks/results/gpu_smoke.json.
#
#   benchmarks/gpu_smoke.sh [MODEL_DIR] [STEPS]
#
# MODEL_DIR: a local Hugging Face causal LM (default: a small Qwen2-style model built from
# scratch, nothing downloaded). STEPS: GRPO steps per engine (default 8, the first 2 are
# warm-up). Installs the vllm extra when vLLM is missing. Stops with an error without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's mogrpo

if ! python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_smoke: no CUDA GPU is visible (torch.cuda.is_available() is False);" \
         "this smoke test needs one" >&2
    exit 1
fi
if ! python -c 'import vllm' 2>/dev/null; then
    echo "gpu_smoke: vLLM is missing; installing the vllm extra" >&2
    python -m pip install -e '.[vllm]'
    # vLLM pins its own torch build: check the GPU is still usable with it
    python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' || {
        echo "gpu_smoke: after installing vLLM, torch sees no GPU (torch/driver mismatch?)" >&2
        exit 1
    }
fi

args=(--steps "${2:-8}" --out benchmarks/results/gpu_smoke.json)
if [[ -n "${1:-}" ]]; then
    args+=(--model "$1")
fi
exec python benchmarks/gpu_smoke.py "${args[@]}"
