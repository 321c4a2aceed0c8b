#!/usr/bin/env bash
# The tenth session's lent-GPU calls, each time-boxed (the device tool allows 600 s a call).
# Run from the repo root with the wheels of ../shared/tools/device-wheels.sh in .whlg:
#   tma: GPU tests of the sorted-row TMA MoE GEMMs (fused_moe_tma); bench.moe_h200 --tma-sweep at 16K and
#        4K tokens (the pointer GEMMs against TMA tile variants, whole fused_moe calls); bench.prefill_model
#        at 16K tokens, bf16, the MoE on the pointer GEMMs and (--moe-tma) on the TMA GEMMs
#     bash bench/device_s10.sh tma
# Not run yet: the device time for this work was spent when it was written (2026-12-01).
source bench/device_common.sh
case "${1:-}" in
  tma)
    tests 100 "tma" tests/backends/test_triton_moe.py
    timeout 200 python3 -m bench.moe_h200 --kinds bf16 --check-tokens 64,4096 --no-ref --sweep-only \
      --sweep-tokens 16384,4096 --tma-sweep ";a=0;gws=1,dws=1;gs=3,ds=3;gg=16,dg=16;dn=128;bm=64,gw=4,dw=4;\
gk=128,gs=2,dk=128,ds=2;gws=1,dws=1,gs=3,ds=3" > "$OUT/moe_tma.txt" 2>&1
    grep -A 30 "^bf16 fused MoE: pointer" "$OUT/moe_tma.txt"; grep -E "PASS|FAIL|Error" "$OUT/moe_tma.txt" | head -8
    prefill16k prefill16k $(( $(left) - 5 )) --dsa triton --moe-tma --profile 30 ;;
  *) echo "usage: $0 tma" >&2; exit 2 ;;
esac
