#!/usr/bin/env bash
# The eighth session's lent-GPU calls, each time-boxed (the device tool allows 600 s a call).
# Run from the repo root with the wheels of ../shared/tools/device-wheels.sh in .whlg:
#   align: GPU tests (the parallel MoE alignment, the KDA decode tiles, w8a8 and the seated shared
#          expert with the K >= 32 rule); bench.kda_h200 --decode-sweep; bench.decode_profile at
#          batch 64, bf16 and fp8 (w8a8), the decode alignment parallel and one-program side by
#          side; batch 1 bf16 with PDL off and on (off: the kernels' own times, no waits inside)
#   tiles: GPU tests (swapped w8a8 linear tiles, the prequantised MoE bound); bench.fp8_linear_h200's
#          w8a8 tile sweep at 64 rows with swapped tiles; a finer KDA decode sweep; bench.decode_profile
#          at batch 1 bf16 with skinny measured / all, at batch 64 fp8 with the KDA tiles 32x4x2 / 32x2x2
#   fused: GPU tests (mhc_pre_norm's one launch, the MoE sum in mhc_post, the alignment, the KDA
#          tiles, the tiny model end to end with PDL); bench.decode_profile at batch 1 bf16 with skinny
#          measured / all, at batch 64 bf16 and fp8 (w8a8)
#   final: GPU tests (mhc_pre_norm's epilogues, at 07ffc35; the partials' bound);
#          bench.decode_profile: batch 1 bf16, two captures (at 07ffc35 also with mHC pre + norm fused,
#          since removed); bf16 at 16, 64, 128; fp8 (w8a8) at 64, two captures; the tiny-model PDL
#          tests with the time left
#   paired: GPU tests (the MoE partials); bench.decode_profile --interleave 7: bf16 and fp8 (w8a8) at
#          batch 1 and 64 captured side by side on one GPU and replayed in turn; the tiny-model PDL
#          tests, time-boxed
#   paired2: bench.decode_profile --interleave 5 at batch 1, 16, 64 and 128, bf16 and fp8 (w8a8)
#     bash bench/device_s8.sh align|tiles|fused|final|paired|paired2
source bench/device_common.sh
case "${1:-}" in
  align)
    tests 150 "align or launch_shapes or w8a8 or seated or unseatable" tests/backends/test_triton_moe.py \
      tests/backends/test_triton_kda.py tests/backends/test_triton_shared_expert.py
    timeout 90 python3 -m bench.kda_h200 --only decode --no-ref \
      --decode-sweep 32x4x2,16x4x2,16x2x2,64x4x2,64x8x2,128x8x2,32x2x2,32x8x1 > "$OUT/kda_sweep.txt" 2>&1
    grep -E "^kda decode|^case" "$OUT/kda_sweep.txt" | grep -v "{" | tail -n 40
    rm -f "$OUT/kda_h200.json"
    TBOX=170 profile profile_b64 --batches 64 --quantization bf16,fp8 --align parallel,one-program
    TBOX=$(( $(left) - 5 )) profile profile_b1 --batches 1 --quantization bf16 --pdl off,on ;;
  tiles)
    tests 100 "w8a8 or launch_shapes" tests/backends/test_triton_fp8_linear.py tests/backends/test_triton_moe.py \
      tests/backends/test_triton_kda.py
    timeout 200 python3 -m bench.fp8_linear_h200 --tokens 64 --prefill-tokens 0 --act dynamic --shapes dsa,idx,kda \
      --sweep --sweep-tokens 64 --sweep-tiles \
      64x64x4x4,16x128x8x3s,16x128x8x4s,32x128x8x4s,16x64x4x4s,32x64x4x4s,64x64x4x3s,16x128x4x4s \
      > "$OUT/lin_sweep.txt" 2>&1
    grep -A 40 "^sweep (best" "$OUT/lin_sweep.txt" | head -40
    mv "$OUT/fp8_linear_h200.json" "$OUT/lin_sweep.json" 2> /dev/null
    timeout 60 python3 -m bench.kda_h200 --only decode --no-ref \
      --decode-sweep 32x4x2,32x2x2,32x1x2,32x2x1,32x2x3,32x2x4,64x2x2,16x1x2 > "$OUT/kda_sweep.txt" 2>&1
    grep -E "^kda decode B=(64|128)" "$OUT/kda_sweep.txt" | grep -v "{" | tail -n 20
    rm -f "$OUT/kda_h200.json"
    TBOX=120 profile profile_b1 --batches 1 --quantization bf16 --skinny measured,all
    TBOX=$(( $(left) - 5 )) profile profile_b64 --batches 64 --quantization fp8 --kda-tile 32x4x2,32x2x2 ;;
  fused)
    tests 120 "pre_norm or partials or unreduced or align or launch_shapes or ops_chain" \
      tests/backends/test_triton_norms_mhc.py tests/backends/test_triton_moe.py tests/backends/test_triton_kda.py
    mv "$OUT/t_gpu.txt" "$OUT/t_gpu_kernels.txt"
    tests 150 "tiny" tests/backends/test_triton_kernels.py tests/backends/test_pdl.py
    TBOX=110 profile profile_b1 --batches 1 --quantization bf16 --skinny measured,all
    TBOX=$(( $(left) - 5 )) profile profile_b64 --batches 64 --quantization bf16,fp8 ;;
  final)
    tests 70 "pre_norm or partials" tests/backends/test_triton_norms_mhc.py
    mv "$OUT/t_gpu.txt" "$OUT/t_gpu_kernels.txt"
    # ran at 07ffc35 with --mhc-fused-norm 4,0 (mHC pre + norm in one launch at batch 1: slower, since removed)
    TBOX=150 profile profile_b1 --batches 1,1 --quantization bf16
    TBOX=150 profile profile_bf16 --batches 16,64,128 --quantization bf16
    TBOX=110 profile profile_fp8 --batches 64,64 --quantization fp8
    tests $(( $(left) - 5 )) "tiny" tests/backends/test_pdl.py ;;
  paired)
    tests 60 "partials or unreduced" tests/backends/test_triton_norms_mhc.py tests/backends/test_triton_moe.py
    mv "$OUT/t_gpu.txt" "$OUT/t_gpu_kernels.txt"
    timeout 200 python3 -m bench.decode_profile --batches 1,64 --quantization bf16,fp8 --interleave 7 \
      > "$OUT/paired.txt" 2>&1
    tail -n 8 "$OUT/paired.txt"
    mv "$OUT/decode_profile.json" "$OUT/paired.json" 2> /dev/null
    tests 120 "tiny" tests/backends/test_pdl.py ;;
  paired2)
    timeout 290 python3 -m bench.decode_profile --batches 1,16,64,128 --quantization bf16,fp8 --interleave 5 \
      > "$OUT/paired2.txt" 2>&1
    tail -n 12 "$OUT/paired2.txt"
    mv "$OUT/decode_profile.json" "$OUT/paired2.json" 2> /dev/null ;;
  *) echo "usage: bash bench/device_s8.sh align|tiles|fused|final|paired|paired2"; exit 2 ;;
esac
