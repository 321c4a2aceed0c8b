#!/usr/bin/env bash
# The kernel tests of tests/backends on a CUDA host: with CUDA present every kernel test runs
# compiled on the device ("cuda" cases) and the interpreter cases skip. From the repo root:
#     [WHEELS=DIR] bash bench/gpu_tests.sh [pytest args...]
# Prints the summary; the whole log goes to $OUT/gpu_tests.txt.
set -u
source bench/host_env.sh
python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/backends "$@" 2>&1 | tee "$OUT/gpu_tests.txt" | tail -15
