#!/usr/bin/env bash
# A lent-GPU call of the sixth session, each step time-boxed (the device tool allows 600 s a call):
#   b1:  bench.decode_profile bf16 batch 1, PDL on, skinny off / measured / all, twice (noise),
#        then bench.mla_decode_tiles (the sparse-MLA decode kernel at batch 1 and 16 across tiles);
#   big: bench.decode_profile fp8 batch 1, 64 and bf16 batch 16, 64, 128 with the defaults.
#     bash bench/device_s6.sh [all|b1|big]
set -u
T0=$(date +%s)
left() { echo $((575 - ($(date +%s) - T0))); }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whlg/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEP=${1:-all}
if [ "$STEP" = all ] || [ "$STEP" = b1 ]; then
  timeout 300 python3 -m bench.decode_profile --batches 1 --quantization bf16 --skinny off,measured,all,off,measured \
    > "$OUT/profile_b1.txt" 2>&1
  grep -v "^  kernels" "$OUT/profile_b1.txt" | tail -n 8
  cp "$OUT/decode_profile.json" "$OUT/profile_b1.json" 2> /dev/null
  timeout $(( $(left) - 5 )) python3 -m bench.mla_decode_tiles --batches 1,16 > "$OUT/mla_tiles.txt" 2>&1
  tail -n 28 "$OUT/mla_tiles.txt"
fi
if [ "$STEP" = all ] || [ "$STEP" = big ]; then
  timeout 200 python3 -m bench.decode_profile --batches 1,64 --quantization fp8 > "$OUT/profile_fp8.txt" 2>&1
  grep -v "^  kernels" "$OUT/profile_fp8.txt" | tail -n 5
  cp "$OUT/decode_profile.json" "$OUT/profile_fp8.json" 2> /dev/null
  timeout $(( $(left) - 5 )) python3 -m bench.decode_profile --batches 16,64,128 --quantization bf16 \
    > "$OUT/profile_big.txt" 2>&1
  grep -v "^  kernels" "$OUT/profile_big.txt" | tail -n 5
fi
rm -f "$OUT/decode_profile.json"
