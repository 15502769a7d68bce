#!/usr/bin/env bash
# The one command for a lent GPU machine: install the wheels of `benchmarks/gpu_wheels.sh`
# (carried in .whl/) into a folder of their own, then run `benchmarks/gpu_check.sh`, its log and
# its results packed into $OUT (the device tool's folder that comes back; at most 8 files).
#
#   bash benchmarks/gpu_run.sh [SECONDS]     # gpu_check.sh's budget, default 420
#
# $OUT/gpu_check.log is the whole log (the install's too), $OUT/gpu_check.tgz every result file,
# refreshed after each step so that a call stopped at its limit keeps the steps that finished.
# Unpack it into benchmarks/results/<gpu>/ and commit what it measured.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:?"gpu_run: set OUT to the folder whose files come back"}
mkdir -p "$out"
exec > >(tee "$out/gpu_check.log") 2>&1
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' || {
        echo "gpu_run: the wheels in .whl/ are for CPython 3.12 (gpu_wheels.sh);" \
             "python3 here is $(python3 -V 2>&1)"
        exit 1
    }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || { echo "gpu_run: installing .whl/ failed"; exit 1; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
results=$(mktemp -d)
GPU_CHECK_ARCHIVE="$out/gpu_check.tgz" bash benchmarks/gpu_check.sh "$results" "${1:-420}"
