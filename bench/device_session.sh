#!/usr/bin/env bash
# One lent-GPU call for the open H200 work, in the order that matters, each step time-boxed so
# that a slow one cannot eat the call (the device tool allows 600 s a call):
#   1. tests/backends compiled on the GPU, in three parallel pytest runs (compile-bound: the
#      16 CPU cores), waited for by PID;
#   2. bench/decode_profile.py: the decode step per kernel, bf16 and fp8, fused small ops off/on;
#   3. bench/serving_sweep.sh, if the budget given as $1 (seconds, default 560) leaves room.
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
P=(python3 -m pytest -q -p no:cacheprovider); [ -n "$K" ] && P+=(-k "$K")
timeout 300 "${P[@]}" tests/backends/test_triton_kernels.py > "$OUT/t_kernels.txt" 2>&1 & A=$!
timeout 300 "${P[@]}" tests/backends/test_triton_moe.py tests/backends/test_triton_fp8_linear.py \
  tests/backends/test_triton_sampling.py > "$OUT/t_moe_fp8_sampling.txt" 2>&1 & B=$!
timeout 300 "${P[@]}" tests/backends/test_triton_kda.py tests/backends/test_triton_norms_mhc.py > "$OUT/t_kda_norms.txt" 2>&1 & C=$!
wait $A $B $C
for f in "$OUT"/t_*.txt; do echo "== $(basename "$f"): $(tail -n 1 "$f")"; grep -E "^FAILED" "$f" | head -5; done
timeout $(( $(left) - 15 )) python3 -m bench.decode_profile --batches "$BATCHES" \
  > "$OUT/decode_profile.txt" 2>&1
grep -v "^  kernels" "$OUT/decode_profile.txt" | tail -n 24
if [ "$(left)" -gt 240 ]; then
  timeout $(( $(left) - 10 )) bash bench/serving_sweep.sh 1024 64 128 > "$OUT/serving_sweep.txt" 2>&1
  tail -n 40 "$OUT/serving_sweep.txt"
else
  echo "serving sweep skipped: $(left) s left"
fi
