#!/usr/bin/env bash
# The ninth session's lent-GPU calls, each time-boxed (the device tool allows 600 s a call).
# Run from the repo root with the wheels of ../shared/tools/device-wheels.sh in .whlg:
#   profile: GPU tests (the lazy softmax rescale, since removed); bench.prefill_model at 16K tokens with the
#            50 largest kernels of one profiled forward; bench.prefill_h200 --mla-sweep (the
#            sparse-MLA prefill kernel alone: block shapes, lazy rescale); bench.moe_h200's bf16
#            prefill tile sweep at 16K tokens; bench.decode_profile at batch 1 bf16 with --warm-s 3
#   prefill: GPU tests (bf16x3 mHC products, the sparse-MLA prefill with its 64-row steps, the tiny
#            model on the prefill kernels); bench.mhc_h200 launch variants at 16K and 4K tokens;
#            more sparse-MLA prefill shapes; bench.prefill_model at 16K tokens, bf16 and fp8 (w8a8
#            at every size), each with its 30 largest kernels
#   sweeps: GPU tests (bf16x3 mHC, the sparse-MLA prefill); bench.mhc_h200 (bf16x3 with the tile sum
#           started from zero); the w8a8 dense linear's prefill tiles at 16K rows; the w8a8 MoE's
#           prefill tiles at 16K tokens
#   final: GPU tests (the tables and kernels changed this session); bench.prefill_model at 16K tokens,
#          bf16 (also with the sparse-MLA prefill in one launch) and fp8 (w8a8 at every size)
#   cublas: GPU tests (w8a8 on cuBLASLt's block-scaled GEMM); the w8a8 prefill linears at 16K rows on
#           Triton and on cuBLASLt; bench.prefill_model at 16K tokens, fp8 (w8a8 at every size) and bf16
#   last: GPU tests (KDA prefill, l2norm on head views, the sparse-MLA and indexer prefill); bench.prefill_model
#         at 16K tokens, bf16 and fp8 (w8a8 at every size), after the host-wait and copy removals
#   (call 6 ran `grouped` at 59d8bf4, since reverted; call 8 only GPU tests, see bench/RESULTS.md)
#     bash bench/device_s9.sh profile|prefill|sweeps|final|cublas|last
source bench/device_common.sh
MLA="BLOCK_H=64,BLOCK_N=32,num_warps=8,num_stages=2,list=precomputed"
case "${1:-}" in
  profile)
    # ran with the kernel's LAZY_RESCALE option and its test (since removed; bench/RESULTS.md)
    # ran as --dsa triton, which then meant the rows derived in the kernel (bench/RESULTS.md)
    prefill16k prefill16k 200 --dsa triton-kernel --reps 2 --profile 50
    timeout 120 python3 -m bench.prefill_h200 --no-ref --mla-sweep "$MLA;$MLA,LAZY_RESCALE=8;\
BLOCK_H=64,BLOCK_N=64,num_warps=8,num_stages=2,list=precomputed;\
BLOCK_H=64,BLOCK_N=64,num_warps=8,num_stages=2,LAZY_RESCALE=8,list=precomputed;\
BLOCK_H=64,BLOCK_N=64,num_warps=8,num_stages=3,LAZY_RESCALE=8,list=precomputed;\
BLOCK_H=64,BLOCK_N=32,num_warps=8,num_stages=3,LAZY_RESCALE=8,list=precomputed" > "$OUT/mla_sweep.txt" 2>&1
    tail -n 9 "$OUT/mla_sweep.txt"
    timeout 150 python3 -m bench.moe_h200 --kinds bf16 --sweep --sweep-only --sweep-tokens 16384 \
      > "$OUT/moe_sweep.txt" 2>&1
    grep -A 8 "^sweep (best" "$OUT/moe_sweep.txt"
    TBOX=$(( $(left) - 5 )) profile profile_b1 --batches 1 --quantization bf16 --warm-s 3 ;;
  prefill)
    tests 150 "bf16x3 or prefill_size or sparse_mla_prefill or tiny_model_with_prefill" \
      tests/backends/test_triton_norms_mhc.py tests/backends/test_triton_kernels.py
    timeout 100 python3 -m bench.mhc_h200 --tokens 16384,4096 --variants ";precision=bf16x3;block_n=32;\
block_n=32,precision=bf16x3;split=4,precision=bf16x3;num_warps=8,precision=bf16x3;block_k=128,precision=bf16x3;\
num_stages=4,precision=bf16x3;block_n=128,num_warps=8,precision=bf16x3" > "$OUT/mhc.txt" 2>&1
    tail -n 22 "$OUT/mhc.txt"
    timeout 90 python3 -m bench.prefill_h200 --no-ref --mla-sweep \
      "BLOCK_N=64,num_warps=8,num_stages=2,list=precomputed;BLOCK_N=64,num_warps=8,num_stages=1,list=precomputed;\
BLOCK_N=64,num_warps=8,num_stages=3,list=precomputed;BLOCK_N=128,num_warps=8,num_stages=2,list=precomputed" \
      > "$OUT/mla_sweep.txt" 2>&1
    tail -n 5 "$OUT/mla_sweep.txt"
    prefill16k prefill16k 150 --dsa triton --profile 30
    prefill16k prefill16k_fp8 $(( $(left) - 5 )) --dsa triton --profile 30 --quantization fp8 \
      --fp8-act-max-tokens all ;;
  sweeps)
    tests 80 "bf16x3 or prefill_size or sparse_mla_prefill_matches" tests/backends/test_triton_norms_mhc.py \
      tests/backends/test_triton_kernels.py
    timeout 60 python3 -m bench.mhc_h200 --tokens 16384,4096 --variants ";precision=bf16x3;\
block_k=128,precision=bf16x3;block_n=128,num_warps=8,precision=bf16x3;block_n=128,num_warps=8" > "$OUT/mhc.txt" 2>&1
    tail -n 13 "$OUT/mhc.txt"
    timeout 200 python3 -m bench.fp8_linear_h200 --tokens 64 --prefill-tokens 16384 --act dynamic \
      --shapes "kda.q,kda.o,dsa.q_b,dsa.o" --sweep --sweep-tokens 16384 \
      --sweep-tiles 128x128x8x4,128x256x8x3,256x128x8x3,128x128x4x4,128x128x8x3,64x128x4x4 > "$OUT/lin_sweep.txt" 2>&1
    grep -A 30 "^sweep (best" "$OUT/lin_sweep.txt" | head -30
    timeout $(( $(left) - 5 )) python3 -m bench.moe_h200 --kinds fp8a8 --sweep --sweep-only --sweep-tokens 16384 \
      --no-baseline > "$OUT/moe_sweep.txt" 2>&1
    grep -A 12 "^sweep (best" "$OUT/moe_sweep.txt" ;;
  final)
    tests 110 "bf16x3 or prefill_split_k or prefill_size or w8a8 or tile_choice or config_table or chunk or \
sparse_mla_prefill_matches" tests/backends/test_triton_norms_mhc.py tests/backends/test_triton_fp8_linear.py \
      tests/backends/test_triton_moe.py tests/backends/test_triton_kda.py tests/backends/test_triton_kernels.py
    prefill16k prefill16k 200 --dsa triton --profile 30 --mla-chunk-rows 16384
    prefill16k prefill16k_fp8 $(( $(left) - 5 )) --dsa triton --profile 30 --quantization fp8 \
      --fp8-act-max-tokens all ;;
  cublas)
    tests 60 "cublas or w8a8" tests/backends/test_triton_fp8_linear.py
    for m in 1073741824 1024; do
      timeout 60 python3 -m bench.fp8_linear_h200 --tokens 64 --prefill-tokens 16384 --act dynamic \
        --shapes "kda.q,kda.o,dsa.q_b,dsa.o" --cublas-min-rows $m > "$OUT/lin_$m.txt" 2>&1
      echo "== CUBLAS_MIN_ROWS $m"; grep -A 4 "^prefill (do_bench" "$OUT/lin_$m.txt"
      grep -i "warn" "$OUT/lin_$m.txt" | head -2
    done
    rm -f "$OUT/fp8_linear_h200.json"
    prefill16k prefill16k_fp8 170 --dsa triton --profile 12 --quantization fp8 \
      --fp8-act-max-tokens all
    prefill16k prefill16k $(( $(left) - 5 )) --dsa triton --profile 12 ;;
  last)
    tests 90 "kda or chunk or l2norm or sparse_mla_prefill_matches or indexer_select_prefill or cublas" \
      tests/backends/test_triton_kda.py tests/backends/test_triton_norms_mhc.py tests/backends/test_triton_kernels.py \
      tests/backends/test_triton_fp8_linear.py
    prefill16k prefill16k 170 --dsa triton --profile 12
    prefill16k prefill16k_fp8 $(( $(left) - 5 )) --dsa triton --profile 12 --quantization fp8 \
      --fp8-act-max-tokens all ;;
  *) echo "usage: bash bench/device_s9.sh profile|prefill|sweeps|final|cublas|last"; exit 2 ;;
esac
