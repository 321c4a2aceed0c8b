#!/usr/bin/env bash
# The eighth session's lent-GPU calls, each time-boxed (the device tool allows 600 s a call).
# Run from the repo root with the wheels of ../shared/tools/device-wheels.sh in .whlg:
#   align: GPU tests (the parallel MoE alignment, the KDA decode tiles, w8a8 and the seated shared
#          expert with the K >= 32 rule); bench.kda_h200 --decode-sweep; bench.decode_profile at
#          batch 64, bf16 and fp8 (w8a8), the decode alignment parallel and one-program side by
#          side; batch 1 bf16 with PDL off and on (off: the kernels' own times, no waits inside)
#     bash bench/device_s8.sh align
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
  *) echo "usage: bash bench/device_s8.sh align"; exit 2 ;;
esac
