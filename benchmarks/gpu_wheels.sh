#!/usr/bin/env bash
# The Python packages `benchmarks/gpu_check.sh` needs that a bare GPU machine's image lacks, as
# wheels in .whl/ (git-ignored), fetched here where a package index is reachable:
#
#   benchmarks/gpu_wheels.sh [--bitsandbytes]
#
# For CPython 3.12 on x86-64 Linux, without their dependencies (each one needed is named):
# mogrpo's pydantic, transformers and datasets at the versions CI tests, TRL for the vs_trl
# steps. The image already holds torch, accelerate's and datasets' other needs (numpy, pyarrow,
# fsspec, xxhash, huggingface-hub, tokenizers, safetensors, pyyaml, tqdm) and peft.
# `--bitsandbytes` adds bitsandbytes, for the 8-bit optimizer and 4-bit cases. Its wheel (43 MB)
# holds a library for every CUDA, ROCm and XPU release, over the 64 MiB a device call carries
# with the rest; it is slimmed to the CPU library and the CUDA ones named by BNB_CUDA (a glob
# over the release digits, default `13*`: the lent GPU machines' torch is built for CUDA 13.0,
# see benchmarks/results/h200/README.md; bitsandbytes loads the one matching torch.version.cuda).
# Then, on the GPU machine, `benchmarks/gpu_run.sh` installs them and runs gpu_check.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
packages=(
    pydantic==2.13.4 pydantic_core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
    transformers==5.24.0 peft==0.21.2 accelerate==1.15.0
    datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
    trl==1.16.0
)
bnb=
[ "${1:-}" = --bitsandbytes ] && bnb=bitsandbytes==0.50.2
mkdir -p .whl
rm -f .whl/bitsandbytes-*.whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d .whl "${packages[@]}"
if [ -n "$bnb" ]; then
    tmp=$(mktemp -d)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${platforms[@]}" -d "$tmp" "$bnb"
    python3 benchmarks/slim_wheel.py "$tmp"/bitsandbytes-*.whl .whl \
        --keep 'bitsandbytes/libbitsandbytes_cpu.so' \
        --keep "bitsandbytes/libbitsandbytes_cuda${BNB_CUDA:-13*}.so" \
        --drop 'bitsandbytes/libbitsandbytes_*.so'
    rm -rf "$tmp"
fi
# what a device call carries: the tracked files, the untracked ones git does not ignore, .whl/
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 cat 2>/dev/null | wc -c)
wheels=$(cat .whl/*.whl | wc -c)
echo "wheels $(( wheels / 1048576 )) MiB + working tree $(( tree / 1048576 )) MiB" \
     "= $(( (wheels + tree) / 1048576 )) MiB of the 64 MiB a device call carries"
if [ $(( wheels + tree )) -gt $(( 64 * 1048576 )) ]; then
    echo "gpu_wheels: over 64 MiB: remove a wheel the GPU image already has at a version that" \
         "works (transformers is the largest)" >&2
    exit 1
fi
echo "carry .whl to the GPU machine and run: bash benchmarks/gpu_run.sh"
