#!/usr/bin/env bash
# One lent-GPU call for the open H200 work, each step time-boxed so that a slow one cannot eat
# the call (the device tool allows 600 s a call):
#   1. bench/serving_sweep.sh (the engine's start-up warm-up compiles every prefill kernel
#      variant: ~3 min on a cold Triton cache, then the sweep itself ~2.5 min);
#   2. bench/decode_profile.py, bf16 at the given batches, with the time left;
#   3. with a pytest -k expression: those tests of tests/backends compiled on the GPU, in the
#      background of step 2 (compile-bound, on the CPU cores; the profile times graph replays).
# Run from the repo root with the wheels of ../shared/tools/device-wheels.sh (+ einops) in .whlg:
#     bash bench/device_session.sh [budget_s] [pytest -k expression] [decode_profile batches]
set -u
BUDGET=${1:-560}
K=${2:-}
BATCHES=${3:-1,16,64,128}
T0=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - T0))); }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whlg/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=/tmp/sweep; mkdir -p "$S"  # the sweep writes ~10 files; the device tool brings back 8
OUT=$S timeout $(( $(left) - 150 )) bash bench/serving_sweep.sh 1024 64 128 > "$S/serving_sweep.txt" 2>&1
(cd "$S" && cp serving_0.json serving_0.5.json serving_0.9375.json serving_0.9375.png serving_sweep.txt serving_up.log \
  "$OUT"/ 2> /dev/null)
tail -n 30 "$S/serving_sweep.txt"
echo "== slow steps logged: $(grep -c "slow step" "$S/serving_up.log")"; grep "slow step" "$S/serving_up.log" | head -5
if [ -n "$K" ]; then
  timeout $(( $(left) - 10 )) python3 -m pytest -q -p no:cacheprovider -k "$K" tests/backends > "$OUT/t_gpu.txt" 2>&1 & T=$!
fi
timeout $(( $(left) - 15 )) python3 -m bench.decode_profile --batches "$BATCHES" --quantization bf16 \
  --fused-small-ops on > "$OUT/decode_profile.txt" 2>&1
grep -v "^  kernels" "$OUT/decode_profile.txt" | tail -n 8
if [ -n "$K" ]; then wait $T; echo "== tests: $(tail -n 1 "$OUT/t_gpu.txt")"; grep -E "^FAILED" "$OUT/t_gpu.txt" | head -5; fi
