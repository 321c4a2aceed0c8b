#!/usr/bin/env bash
# The kernel tests of tests/backends on the lent GPU: with CUDA present every kernel test runs
# compiled on the device ("cuda" cases) and the interpreter cases skip. Run from the repo root
# with the wheels of ../shared/tools/device-wheels.sh (fla-core, einops) carried in .whlg:
#     bash bench/gpu_tests.sh [pytest args...]
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whlg/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/backends "$@" 2>&1 | tee "$OUT/gpu_tests.txt" | tail -15
