#!/usr/bin/env bash
# One lent-GPU call (sixth session): the PDL and skinny-linear changes, compiled and measured.
#   1. their GPU tests (bit-identical decode with PDL on/off, the PTX wait order, skinny vs reference);
#   2. bench.skinny_linear (cuBLAS vs ours vs ours+PDL at the decode shapes);
#   3. bench.decode_profile, bf16, PDL and skinny off/on side by side at the given batches.
#     bash bench/device_pdl.sh [budget_s] [batches]
set -u
BUDGET=${1:-570}
BATCHES=${2:-1,16}
T0=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - T0))); }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whlg/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/backends/test_pdl.py tests/backends/test_triton_fp8_linear.py \
  -k "pdl or skinny or graph_safe" > "$OUT/t_gpu.txt" 2>&1
echo "== tests: $(tail -n 1 "$OUT/t_gpu.txt")"; grep -E "^(FAILED|ERROR)|Error" "$OUT/t_gpu.txt" | head -8
timeout 90 python3 -m bench.skinny_linear --rows 1,4 > "$OUT/skinny.txt" 2>&1
tail -n 23 "$OUT/skinny.txt"
timeout $(( $(left) - 5 )) python3 -m bench.decode_profile --batches "$BATCHES" --quantization bf16 \
  --pdl off,on --skinny off,on > "$OUT/decode_profile.txt" 2>&1
grep -v "^  kernels" "$OUT/decode_profile.txt" | tail -n 12
