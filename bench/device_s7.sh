#!/usr/bin/env bash
# The seventh session's lent-GPU calls, each time-boxed (the device tool allows 600 s a call).
# Run from the repo root with the wheels of ../shared/tools/device-wheels.sh in .whlg:
#   fp8:   GPU tests of w8a8 (act_fp8); bench.moe_h200 sweep of fp8 (w8a16) and fp8a8 (w8a8) tiles
#          at 1 and 64 tokens; bench.decode_profile bf16 and fp8 at batch 64 and 1, fp8 with
#          activations none (w8a16) and dynamic (w8a8) side by side
#   fp8b:  GPU tests of w8a8 (the act_quant route too); bench.fp8_linear_h200 at 1 and 64 rows,
#          activations none then dynamic; bench.decode_profile as in fp8 with the tuned tiles
#   fp8c:  GPU tests of w8a8; the fp8a8 MoE sweep at 64 tokens (tiles with 2 programs per SM);
#          bench.decode_profile bf16 at 64 and 1, fp8 w8a8 at 64 with PDL up to 1 and 64 tokens
#   fp8d:  GPU tests of w8a8; the w8a8 linear's tiles at 64 rows on the big projections; the fp8a8
#          MoE sweep at 64 tokens; bench.decode_profile fp8 w8a8 at batch 64
#   final: GPU tests (w8a8, the tf32x3 decode mix); bench.decode_profile bf16 at 64 and 1 and fp8 at 64
#          (w8a8 and w8a16) and 1 (w8a8), the mHC decode mix in ieee and tf32x3 side by side; then
#          the tiny-model tests compiled, with the time left
#   again: bench.decode_profile with the defaults, bf16 and fp8 (w8a8) at batch 1, 64, 1, 64: each
#          figure twice, from two captures
#   tests: the kernel tests this session touched, compiled (w8a8, mHC, the seated shared expert, the
#          ops' fp8 dispatch with the w8a8 default)
#     bash bench/device_s7.sh fp8|fp8b|fp8c|fp8d|final|again|tests
source bench/device_common.sh
case "${1:-}" in
  fp8)
    tests 100 "w8a8 or act_quant" tests/backends/test_triton_moe.py tests/backends/test_triton_fp8_linear.py
    timeout 170 python3 -m bench.moe_h200 --sweep --sweep-only --kinds fp8,fp8a8 --sweep-tokens 1,64 \
      --check-tokens 1,64 --no-ref > "$OUT/moe_sweep.txt" 2>&1
    grep -A 40 "^sweep (best" "$OUT/moe_sweep.txt" | head -40
    mv "$OUT/moe_h200.json" "$OUT/moe_sweep.json" 2> /dev/null
    TBOX=$(( $(left) - 5 )) profile profile_fp8 --batches 64,1 --quantization bf16,fp8 --fp8-act none,dynamic ;;
  fp8b)
    tests 100 "w8a8 or act_quant" tests/backends/test_triton_moe.py tests/backends/test_triton_fp8_linear.py
    for a in none dynamic; do
      timeout 75 python3 -m bench.fp8_linear_h200 --tokens 1,64 --prefill-tokens 0 --act $a > "$OUT/lin_$a.txt" 2>&1
      grep -A 30 "^decode, act" "$OUT/lin_$a.txt" | head -30
    done
    rm -f "$OUT/fp8_linear_h200.json"
    TBOX=$(( $(left) - 5 )) profile profile_fp8 --batches 64,1 --quantization bf16,fp8 --fp8-act none,dynamic ;;
  fp8c)
    tests 100 "w8a8 or act_quant" tests/backends/test_triton_moe.py tests/backends/test_triton_fp8_linear.py
    timeout 150 python3 -m bench.moe_h200 --sweep --sweep-only --kinds fp8a8 --no-baseline --sweep-tokens 64 \
      --check-tokens 64 --no-ref > "$OUT/moe_sweep.txt" 2>&1
    grep -A 14 "^sweep (best" "$OUT/moe_sweep.txt" | head -14
    mv "$OUT/moe_h200.json" "$OUT/moe_sweep.json" 2> /dev/null
    TBOX=200 profile profile_bf16 --batches 64,1 --quantization bf16
    TBOX=$(( $(left) - 5 )) profile profile_fp8 --batches 64 --quantization fp8 --fp8-act dynamic \
      --pdl-max-tokens 1,64 ;;
  fp8d)
    tests 100 "w8a8 or act_quant" tests/backends/test_triton_moe.py tests/backends/test_triton_fp8_linear.py
    timeout 170 python3 -m bench.fp8_linear_h200 --tokens 64 --prefill-tokens 0 --act dynamic \
      --shapes kda.q,kda.o,dsa.o --sweep --sweep-tokens 64 \
      --sweep-tiles 64x32x4x4,64x64x8x4,64x128x8x4,64x32x4x6,64x64x4x6 > "$OUT/lin_sweep.txt" 2>&1
    grep -A 24 "^sweep (best" "$OUT/lin_sweep.txt" | head -24
    mv "$OUT/fp8_linear_h200.json" "$OUT/lin_sweep.json" 2> /dev/null
    timeout 100 python3 -m bench.moe_h200 --sweep --sweep-only --kinds fp8a8 --no-baseline --sweep-tokens 64 \
      --check-tokens 64 --no-ref > "$OUT/moe_sweep.txt" 2>&1
    grep -A 14 "^sweep (best" "$OUT/moe_sweep.txt" | head -14
    mv "$OUT/moe_h200.json" "$OUT/moe_sweep.json" 2> /dev/null
    TBOX=$(( $(left) - 5 )) profile profile_fp8 --batches 64 --quantization fp8 --fp8-act dynamic ;;
  final)
    tests 90 "w8a8 or act_quant or tf32x3" tests/backends/test_triton_moe.py tests/backends/test_triton_fp8_linear.py \
      tests/backends/test_triton_norms_mhc.py
    TBOX=150 profile profile_bf16 --batches 64,1 --quantization bf16 --mhc-precision ieee,tf32x3
    TBOX=170 profile profile_fp8 --batches 64 --quantization fp8 --fp8-act dynamic,none --mhc-precision ieee,tf32x3
    mv "$OUT/t_gpu.txt" "$OUT/t_gpu_w8a8.txt"
    tests $(( $(left) - 10 )) "tiny" tests/backends/test_triton_kernels.py tests/backends/test_pdl.py ;;
  again)
    TBOX=300 profile profile_again --batches 1,64,1,64 --quantization bf16,fp8 ;;
  tests)
    tests 200 "w8a8 or act_quant or mhc_pre or seated or unseatable or dispatch or model_moe_layer or model_linear" \
      tests/backends/test_triton_moe.py tests/backends/test_triton_fp8_linear.py \
      tests/backends/test_triton_norms_mhc.py tests/backends/test_triton_shared_expert.py ;;
  *) echo "usage: bash bench/device_s7.sh fp8|fp8b|fp8c|fp8d|final|again|tests"; exit 2 ;;
esac
