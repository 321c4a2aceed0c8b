#!/usr/bin/env bash
# The sixth session's lent-GPU calls, one step per call, each time-boxed (the device tool allows
# 600 s a call). Run from the repo root with the wheels of ../shared/tools/device-wheels.sh in .whlg:
#   pdl:   GPU tests of PDL and the skinny linear; bench.skinny_linear (cuBLAS vs ours vs ours+PDL);
#          bench.decode_profile bf16 at batch 1 and 16, PDL and skinny off/on side by side
#   b1:    bench.decode_profile bf16 batch 1, PDL on, skinny off / measured / all, twice (noise),
#          then bench.mla_decode_tiles (the sparse-MLA decode kernel at batch 1 and 16 across tiles)
#   big:   bench.decode_profile fp8 batch 1, 64 and bf16 batch 16, 64, 128 with the defaults
#   final: GPU tests (PDL, the row-list kernel, sparse MLA, skinny, the tiny model), then
#          bench.decode_profile bf16 at batch 1, 16, 64, 128 and fp8 at 64, 1 with the defaults
#     bash bench/device_s6.sh pdl|b1|big|final
source bench/device_common.sh
case "${1:-}" in
  pdl)
    tests 170 "pdl or skinny or graph_safe" tests/backends/test_pdl.py tests/backends/test_triton_fp8_linear.py
    timeout 90 python3 -m bench.skinny_linear --rows 1,4 > "$OUT/skinny.txt" 2>&1
    tail -n 23 "$OUT/skinny.txt"
    TBOX=$(( $(left) - 5 )) profile decode_profile --batches 1,16 --quantization bf16 --pdl off,on --skinny off,all ;;
  b1)
    TBOX=300 profile profile_b1 --batches 1 --quantization bf16 --skinny off,measured,all,off,measured
    timeout $(( $(left) - 5 )) python3 -m bench.mla_decode_tiles --batches 1,16 > "$OUT/mla_tiles.txt" 2>&1
    tail -n 28 "$OUT/mla_tiles.txt" ;;
  big)
    TBOX=200 profile profile_fp8 --batches 1,64 --quantization fp8
    TBOX=$(( $(left) - 5 )) profile profile_big --batches 16,64,128 --quantization bf16 ;;
  final)
    tests 170 "pdl or decode_rows or sparse_mla_op or skinny or tiny_model_decode" tests/backends/test_pdl.py \
      tests/backends/test_triton_kernels.py tests/backends/test_triton_fp8_linear.py
    TBOX=240 profile profile_bf16 --batches 1,16,64,128 --quantization bf16
    TBOX=$(( $(left) - 5 )) profile profile_fp8 --batches 64,1 --quantization fp8 ;;
  *) echo "usage: bash bench/device_s6.sh pdl|b1|big|final"; exit 2 ;;
esac
