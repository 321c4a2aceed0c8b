"""Tile tables of the fused MoE (backends/kernels/fused_moe.py), by token count: 16-bit
weights, fp8 weights (from the H200 sweep, bench/moe_h200.py --sweep) and the fp32 parity path.
Plain data and one lookup; no Triton here."""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# Tiles by number of tokens N (first row with N <= max_tokens wins). BLOCK_M is shared by both
# GEMMs (one alignment). gate_up's BLOCK_N is per projection: a program computes BLOCK_N gate
# AND BLOCK_N up columns (2·BLOCK_N output columns of a fused gate_up).
CONFIGS: list[tuple[int, dict]] = [
    (32, dict(BLOCK_M=16,
              gate_up=dict(BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4),
              down=dict(BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4))),
    (256, dict(BLOCK_M=16,
               gate_up=dict(BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4),
               down=dict(BLOCK_N=128, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3))),
    (1024, dict(BLOCK_M=32,
                gate_up=dict(BLOCK_N=64, BLOCK_K=128, GROUP_M=4, num_warps=4, num_stages=3),
                down=dict(BLOCK_N=128, BLOCK_K=128, GROUP_M=4, num_warps=8, num_stages=3))),
    (4096, dict(BLOCK_M=64,
                gate_up=dict(BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
                down=dict(BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4))),
    # `bench.moe_h200 --sweep --kinds bf16 --sweep-tokens 16384` on an H200, 2026-11-30: 15.01 ms
    # (440 TFLOP/s) against 16.51 for gate/up 64 wide and down 128 (the table's entry until then)
    (1 << 62, dict(BLOCK_M=128,
                   gate_up=dict(BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4),
                   down=dict(BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4))),
]
# fp8 (w8a16) weights: their own table, since a weight element is half the bytes of bf16's (wider
# N tiles / deeper pipelines keep as many bytes in flight). Edit freely: per GEMM the keys are
# BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages and optionally
#   SWAP_AB    (default False) compute accᵀ = W·xᵀ: the converted weight tile is the MMA's A
#              operand (registers on Hopper's wgmma), the tokens its N side;
#   scale_acc  (default True) scale the fp32 partial per K tile (acc += dot(x, w)·s) rather than
#              each weight element; needs BLOCK_K <= the scale block's K (128), else per element.
# BLOCK_N may exceed the scale block's N (then one scale per column); BLOCK_K above it straddles
# scale blocks and takes the per-element path. bench/moe_h200.py --sweep --kinds fp8 times
# alternatives (the sweep's FP8 lists) and prints the best per token count.
FP8_CONFIGS: list[tuple[int, dict]] = [
    # decode rows: the best of `bench.moe_h200 --sweep --kinds fp8` on an H200, 2026-11-30
    # (N=1: 0.147 ms, N=16: 0.770 ms, N=64: 1.457 ms, N=128: 1.821 ms; 0.68-0.78x bf16)
    (32, dict(BLOCK_M=16,
              gate_up=dict(BLOCK_N=128, BLOCK_K=128, GROUP_M=1, num_warps=8, num_stages=4),
              down=dict(BLOCK_N=128, BLOCK_K=128, GROUP_M=1, num_warps=8, num_stages=5))),
    (256, dict(BLOCK_M=16,
               gate_up=dict(BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4),
               down=dict(BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4))),
    (1024, dict(BLOCK_M=32,
                gate_up=dict(BLOCK_N=128, BLOCK_K=128, GROUP_M=4, num_warps=8, num_stages=3),
                down=dict(BLOCK_N=128, BLOCK_K=128, GROUP_M=4, num_warps=8, num_stages=4))),
    (4096, dict(BLOCK_M=64,
                gate_up=dict(BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4),
                down=dict(BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4))),
    (1 << 62, dict(BLOCK_M=128,
                   gate_up=dict(BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3),
                   down=dict(BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3))),
]
# fp8 weights with fp8 activations (act_fp8, w8a8): BLOCK_K is always the scale block (128; one
# activation group per K tile). Decode rows: SWAP_AB, where the product is an fp8 wgmma (the weight
# tile is its M side, never converted); at BLOCK_M 16 without the swap Triton converts both
# operands to f16 for mma.sync. Prefill rows: BLOCK_M 64/128, an fp8 wgmma as they stand.
# One token: a 64-wide gate/up tile (two programs per SM) times 0.062 ms isolated against this
# table's 0.065, yet the captured flash-4l decode step reads 1.16-1.18 ms with it against 1.12
# (`bench.decode_profile --batches 1 --quantization fp8`, H200, 2026-12-04), so it is not here.
FP8A8_CONFIGS: list[tuple[int, dict]] = [
    # the best of `bench.moe_h200 --sweep --kinds fp8a8` on an H200, 2026-11-30 (N=64: 1.123 ms,
    # 98% of 4.09 TB/s, 2 programs per SM; the 1-per-SM 4/5 stages 1.148-1.188 ms; fp8 w8a16's
    # best 1.470 ms, bf16 2.115 ms)
    (256, dict(BLOCK_M=16,
               gate_up=dict(BLOCK_N=128, BLOCK_K=128, GROUP_M=1, num_warps=8, num_stages=3, SWAP_AB=True),
               down=dict(BLOCK_N=128, BLOCK_K=128, GROUP_M=1, num_warps=8, num_stages=4, SWAP_AB=True))),
    (1024, dict(BLOCK_M=32,
                gate_up=dict(BLOCK_N=128, BLOCK_K=128, GROUP_M=4, num_warps=4, num_stages=4, SWAP_AB=True),
                down=dict(BLOCK_N=128, BLOCK_K=128, GROUP_M=4, num_warps=4, num_stages=4, SWAP_AB=True))),
    (4096, dict(BLOCK_M=64,
                gate_up=dict(BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4),
                down=dict(BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4))),
    # rows past 1024 tokens (prefill chunks; x and h come quantised by act_quant, as at every size
    # by default: INKERNEL_QUANT_MAX_TOKENS). Up to 4096 tokens the 64-row tiles above; past it 128 rows over
    # two warpgroups, gate/up 128 wide: `bench.moe_h200 --kinds fp8a8 --sweep --sweep-only
    # --sweep-tokens 16384,8192,4096` on an H100, 2026-12-06: 10.45 ms at 16384 tokens against
    # 11.78 for the 64-row tiles, 6.02-6.09 at 8192 against 6.50, 3.98 at 4096 against 3.86.
    (1 << 62, dict(BLOCK_M=128,
                   gate_up=dict(BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3),
                   down=dict(BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=4))),
]
# fp32 activations are the parity path (FMA dots on the GPU): small tiles.
FP32_CONFIG = dict(BLOCK_M=16,
                   gate_up=dict(BLOCK_N=64, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=2),
                   down=dict(BLOCK_N=64, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=2))


# Benches set this to try a tile in the whole model (bench.decode_profile --moe-tile): keys as in a
# table entry ("BLOCK_M", or "gate_up"/"down" dicts of per-GEMM keys) overriding the entry found.
OVERRIDE: dict | None = None


def get_config(n_tokens: int, act_dtype: torch.dtype = torch.bfloat16,
               weight_dtype: torch.dtype | None = None, act_fp8: bool = False) -> dict:
    """The tile table's entry for N tokens (a fresh copy; callers may edit it). fp8 weights
    (weight_dtype in FP8_DTYPES) with 16-bit activations use FP8_CONFIGS, or FP8A8_CONFIGS when
    the activations are quantised too (act_fp8), else CONFIGS."""
    if act_dtype == torch.float32:
        src = FP32_CONFIG
    elif weight_dtype in FP8_DTYPES and act_fp8:
        src = next(c for lim, c in FP8A8_CONFIGS if n_tokens <= lim)
    elif weight_dtype in FP8_DTYPES:
        src = next(c for lim, c in FP8_CONFIGS if n_tokens <= lim)
    else:
        src = next(c for lim, c in CONFIGS if n_tokens <= lim)
    cfg = dict(BLOCK_M=src["BLOCK_M"], gate_up=dict(src["gate_up"]), down=dict(src["down"]))
    for key, val in (OVERRIDE or {}).items():
        if isinstance(val, dict):
            cfg[key].update(val)
        else:
            cfg[key] = val
    return cfg
