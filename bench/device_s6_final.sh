#!/usr/bin/env bash
# The sixth session's last lent-GPU call: the changes compiled and measured, each step time-boxed.
#   1. GPU tests: PDL (bit-identical decode, PTX wait order), the row-list kernel, sparse MLA op,
#      skinny linear, the tiny model end to end;
#   2. bench.decode_profile bf16 at batch 1, 16, 64, 128 with the defaults (PDL <= 16 tokens,
#      skinny "measured", decode row lists);
#   3. bench.decode_profile fp8 at batch 1 and 64 with the time left.
#     bash bench/device_s6_final.sh
set -u
T0=$(date +%s)
left() { echo $((565 - ($(date +%s) - T0))); }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whlg/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/backends/test_pdl.py tests/backends/test_triton_kernels.py \
  tests/backends/test_triton_fp8_linear.py -k "pdl or decode_rows or sparse_mla_op or skinny or tiny_model_decode" \
  > "$OUT/t_gpu.txt" 2>&1
echo "== tests: $(tail -n 1 "$OUT/t_gpu.txt")"; grep -E "^(FAILED|ERROR)" "$OUT/t_gpu.txt" | head -8
timeout 240 python3 -m bench.decode_profile --batches 1,16,64,128 --quantization bf16 > "$OUT/profile_bf16.txt" 2>&1
grep -v "^  kernels" "$OUT/profile_bf16.txt" | tail -n 7
mv "$OUT/decode_profile.json" "$OUT/profile_bf16.json" 2> /dev/null
timeout $(( $(left) - 5 )) python3 -m bench.decode_profile --batches 64,1 --quantization fp8 > "$OUT/profile_fp8.txt" 2>&1
grep -v "^  kernels" "$OUT/profile_fp8.txt" | tail -n 4
mv "$OUT/decode_profile.json" "$OUT/profile_fp8.json" 2> /dev/null
