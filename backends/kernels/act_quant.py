"""Dynamic fp8 activation quantisation (w8a8) for the fp8 GEMMs of the cuda-h200 kernels.

    s = max|x| / 448 per row and K scale block (the weight's, 32..256 wide), q = e4m3(x / s)

DeepSeek-V3's and SGLang's per-token-group quantisation; ReferenceOps.act_quant_e4m3 is the torch
version (backends/reference.py). `quant_act_e4m3` quantises a tile inside a GEMM (fused_moe,
fp8_linear); `act_quant` quantises a whole [N, K] x in one launch, for GEMMs whose out tiles would
each redo it (many rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..fp8_numerics import w8a8_possible
from . import pdl
from .pdl import pdl_enter
from .interpreter import patch_interpreter

patch_interpreter()

E4M3_MAX = tl.constexpr(448.0)  # the largest finite e4m3 value


@triton.jit
def quant_act_e4m3(a, AXIS: tl.constexpr, EXACT: tl.constexpr = False):
    """Dynamic activation quantisation (w8a8): one scale per row of the [rows, K-group] tile
    (AXIS is the tile's K axis), s = max|a| / 448, q = a / s rounded to e4m3. Returns (q, s), s
    with the K axis kept (size 1) to broadcast against the product. All-zero rows give q = 0.
    EXACT divides as IEEE does (div_rn, torch's act_quant_e4m3 bit for bit; act_quant's kernel);
    else `/`, an approximate divide that may move an e4m3 code by one step now and then. Inside
    the GEMMs div_rn made the fp8 MoE 2x slower on the H200 (and, at 8 warps, less accurate)."""
    af = a.to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(af), axis=AXIS, keep_dims=True), 1e-12)
    if EXACT:
        s = tl.div_rn(amax, E4M3_MAX)
        q = tl.clamp(tl.div_rn(af, s), -E4M3_MAX, E4M3_MAX).to(tl.float8e4nv)
    else:
        s = amax / E4M3_MAX
        q = tl.clamp(af / s, -E4M3_MAX, E4M3_MAX).to(tl.float8e4nv)
    return q, s


def act_fp8_supported(want: bool, act_dtype: torch.dtype, weight_dtype: torch.dtype, block: tuple[int, int]) -> bool:
    """Whether a w8a8 product is asked for and possible (fp8_numerics.w8a8_possible, the one rule).
    Else the kernels run w8a16."""
    return bool(want and w8a8_possible(act_dtype, weight_dtype, block))


@triton.jit(do_not_specialize=["M"])
def _act_quant_kernel(X, XQ, XS, M, K, stride_xm, stride_qm, stride_sm,
                      GROUP: tl.constexpr, GROUPS: tl.constexpr, PDL: tl.constexpr = False):
    """GROUPS groups of one row per program: xq = e4m3(x / s), s = max|x| / 448 per group."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    k = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    ok = k < K
    x = tl.load(X + row * stride_xm + k, mask=ok, other=0.0)
    q, s = quant_act_e4m3(x, 1, EXACT=True)
    tl.store(XQ + row * stride_qm + k, q, mask=ok)
    tl.store(XS + row * stride_sm + g[:, None], s, mask=(g * GROUP < K)[:, None])


def act_quant(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, K] (16-bit) -> (e4m3 [N, K], fp32 scales [N, ceil(K / group)]), one launch: the
    quantisation the w8a8 GEMMs otherwise do per K tile (quant_act_e4m3, the same values)."""
    n, k = x.shape
    ng = triton.cdiv(k, group)
    xq = torch.empty(n, k, dtype=torch.float8_e4m3fn, device=x.device)
    xs = torch.empty(n, ng, dtype=torch.float32, device=x.device)
    if n:
        per = min(triton.next_power_of_2(ng), max(1, 2048 // group))
        _act_quant_kernel[(n, triton.cdiv(ng, per))](x, xq, xs, n, k, x.stride(0), xq.stride(0), xs.stride(0),
                                                    GROUP=group, GROUPS=per, **pdl.launch(x.device), num_warps=4)
    return xq, xs


@triton.jit
def act_tile_e4m3(a, XS, rows, row_ok, stride_xsm, kb, AXIS: tl.constexpr, X_FP8: tl.constexpr):
    """A GEMM's activation tile as e4m3 with its per-row scales (the K axis, AXIS, kept at size 1):
    quantised here (quant_act_e4m3), or, with X_FP8, already quantised by act_quant, its scales
    read from XS [rows, K blocks] at K block kb."""
    if X_FP8:
        s = tl.load(XS + rows * stride_xsm + kb, mask=row_ok, other=0.0)
        if AXIS == 0:
            s = s[None, :]
        else:
            s = s[:, None]
        return a, s
    else:
        return quant_act_e4m3(a, AXIS)
