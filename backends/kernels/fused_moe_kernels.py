"""The Triton kernels of the fused MoE: the two grouped GEMMs (`_gate_up_kernel` with the clamped
SwiGLU in its epilogue, `_down_kernel` with the routing weight) and the top-k sum (`_sum_kernel`).
What they compute, in which numerics, and how they are launched: fused_moe.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .act_quant import act_tile_e4m3
from .interpreter import patch_interpreter
from .pdl import pdl_enter
from .tile_loads import load_k_tile

patch_interpreter()


# ---------------------------------------------------------------------------------------
# grouped GEMMs
# ---------------------------------------------------------------------------------------
@triton.jit
def swiglu_clamped(g, u, limit, HAS_LIMIT: tl.constexpr):
    """h = silu(min(g, limit)) · clamp(u, ±limit) from gate and up already rounded to the model
    dtype, with the reference's roundings (silu(gate) and the product); h in that dtype."""
    dt = g.dtype
    g = g.to(tl.float32)
    u = u.to(tl.float32)
    if HAS_LIMIT:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    return (s * u).to(dt)


@triton.jit
def _block_and_tile(IDS, BLOCK_EXPERT, E, num_pid_m, n_out, GROUP_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    PAIR_BLOCKS: tl.constexpr):
    """(pid_m, pid_n, e) of this program of either GEMM: grouped launch order (GROUP_M consecutive
    blocks sweep the N tiles of n_out together, for L2 reuse) and the block's expert, < 0 when
    the block has nothing to do. With PAIR_BLOCKS block pid_m is pair pid_m, its expert straight
    from ids (ids outside [0, E): dropped, -1)."""
    pid = tl.program_id(0)
    in_group = GROUP_M * tl.cdiv(n_out, BLOCK_N)
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m
    if PAIR_BLOCKS:
        e = tl.load(IDS + pid_m).to(tl.int64)
        e = tl.where((e >= 0) & (e < E), e, -1)
    else:
        e = tl.load(BLOCK_EXPERT + pid_m)
    return pid_m, pid_n, e


@triton.jit
def _block_rows(SORTED, BLOCK_ROWS, pid_m, BLOCK_M: tl.constexpr, PAIR_BLOCKS: tl.constexpr):
    """(row_ok, pair) of block pid_m: which of its BLOCK_M rows are real, and their flat pair
    indices (int64). A pair block has one real row, the pair itself."""
    offs_m = tl.arange(0, BLOCK_M)
    if PAIR_BLOCKS:
        row_ok = offs_m < 1
        pair = tl.zeros([BLOCK_M], dtype=tl.int64) + pid_m
    else:
        row_ok = offs_m < tl.load(BLOCK_ROWS + pid_m)
        pair = tl.load(SORTED + pid_m * BLOCK_M + offs_m, mask=row_ok, other=0).to(tl.int64)
    return row_ok, pair


# fp8 weights (FP8) are applied in one of two ways, picked per launch (constexpr):
#   SCALE_ACC  the K tile sits inside one scale block (BLOCK_K divides SCALE_BK): the fp8 tile
#              is converted to the activation dtype (exact for e4m3/e5m2 -> bf16/fp16/fp32),
#              multiplied in a fresh fp32 partial, and the partial is scaled as it is added:
#              acc += dot(x, w) * s  (one multiply per output element per K step instead of one
#              per weight element; s a scalar when BLOCK_N <= SCALE_BN, else one per column).
#   else       per element, as dequantize_block_fp8 does: (w.f32 * s[k // SBK, n // SBN]) -> dt
#              (K tiles that straddle scale blocks, or config scale_acc=False).
# SWAP_AB computes the transposed product accᵀ [BLOCK_N, BLOCK_M] = W_tile [BLOCK_N, BLOCK_K] ·
# xᵀ [BLOCK_K, BLOCK_M]: the (converted) weight tile is the MMA's A operand, which Hopper's
# wgmma can take from registers (no shared-memory round trip after the fp8 -> bf16 convert),
# and the weight rows fill the MMA's M side while the few tokens of decode sit on its N side.
@triton.jit(do_not_specialize=["num_pid_m"])
def _gate_up_kernel(
    X, WG, WU, SG, SU, H, SORTED, BLOCK_EXPERT, BLOCK_ROWS, IDS,
    D, I, E, top_k, num_pid_m, limit,
    stride_xm,
    stride_ge, stride_gn, stride_ue, stride_un,
    stride_sge, stride_sgn, stride_sgk, stride_sue, stride_sun, stride_suk,
    stride_hm, XS, stride_xsm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    FP8: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
    HAS_LIMIT: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
    SCALE_ACC: tl.constexpr = False, SWAP_AB: tl.constexpr = False, PAIR_BLOCKS: tl.constexpr = False,
    ACT_FP8: tl.constexpr = False, X_FP8: tl.constexpr = False, PDL: tl.constexpr = False):
    # X_FP8 (with ACT_FP8): X is e4m3 from act_quant, its scales XS [tokens, K blocks]
    pdl_enter(PDL)
    pid_m, pid_n, e = _block_and_tile(IDS, BLOCK_EXPERT, E, num_pid_m, I, GROUP_M, BLOCK_N, PAIR_BLOCKS)
    if e < 0:
        return
    e = e.to(tl.int64)
    dt = H.dtype.element_ty  # the model dtype (X's, unless X_FP8)
    row_ok, pair = _block_rows(SORTED, BLOCK_ROWS, pid_m, BLOCK_M, PAIR_BLOCKS)
    tok = pair // top_k
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)

    if SWAP_AB:  # x tile [BK, BM], weight tiles [BN, BK], accumulators [BN, BM]
        a_ptrs = X + tok[None, :] * stride_xm + offs_k[:, None]
        g_ptrs = WG + e * stride_ge + offs_n[:, None] * stride_gn + offs_k[None, :]
        u_ptrs = WU + e * stride_ue + offs_n[:, None] * stride_un + offs_k[None, :]
        acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:        # x tile [BM, BK], weight tiles [BK, BN], accumulators [BM, BN]
        a_ptrs = X + tok[:, None] * stride_xm + offs_k[None, :]
        g_ptrs = WG + e * stride_ge + offs_n[None, :] * stride_gn + offs_k[:, None]
        u_ptrs = WU + e * stride_ue + offs_n[None, :] * stride_un + offs_k[:, None]
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if FP8:
        sg_base = SG + e * stride_sge
        su_base = SU + e * stride_sue
        sg_n = (offs_n // SCALE_BN) * stride_sgn   # per column (clamped by the masks)
        su_n = (offs_n // SCALE_BN) * stride_sun
    for k0 in range(0, D, BLOCK_K):
        # the x tile's K axis is 0 when swapped (xᵀ [BK, BM]), the weight tiles' the other one
        a = load_k_tile(a_ptrs, row_ok, D - k0, offs_k, 0 if SWAP_AB else 1, EVEN_K)
        bg = load_k_tile(g_ptrs, n_ok, D - k0, offs_k, 1 if SWAP_AB else 0, EVEN_K)
        bu = load_k_tile(u_ptrs, n_ok, D - k0, offs_k, 1 if SWAP_AB else 0, EVEN_K)
        if FP8 and SCALE_ACC:
            kb = k0 // SCALE_BK
            if BLOCK_N <= SCALE_BN:  # one scale for the whole tile
                sg = tl.load(sg_base + (n0 // SCALE_BN) * stride_sgn + kb * stride_sgk).to(tl.float32)
                su = tl.load(su_base + (n0 // SCALE_BN) * stride_sun + kb * stride_suk).to(tl.float32)
            else:                    # one per column
                sg = tl.load(sg_base + sg_n + kb * stride_sgk, mask=n_ok, other=0.0).to(tl.float32)
                su = tl.load(su_base + su_n + kb * stride_suk, mask=n_ok, other=0.0).to(tl.float32)
                if SWAP_AB:
                    sg = sg[:, None]
                    su = su[:, None]
                else:
                    sg = sg[None, :]
                    su = su[None, :]
            if ACT_FP8:  # fp8 x fp8 products (w8a8): the weight tiles are never converted
                if SWAP_AB:
                    aq, sa = act_tile_e4m3(a, XS, tok, row_ok, stride_xsm, kb, 0, X_FP8)
                    acc_g += tl.dot(bg, aq) * (sg * sa)
                    acc_u += tl.dot(bu, aq) * (su * sa)
                else:
                    aq, sa = act_tile_e4m3(a, XS, tok, row_ok, stride_xsm, kb, 1, X_FP8)
                    acc_g += tl.dot(aq, bg) * (sg * sa)
                    acc_u += tl.dot(aq, bu) * (su * sa)
            elif SWAP_AB:
                acc_g += tl.dot(bg.to(dt), a, input_precision=PRECISION) * sg
                acc_u += tl.dot(bu.to(dt), a, input_precision=PRECISION) * su
            else:
                acc_g += tl.dot(a, bg.to(dt), input_precision=PRECISION) * sg
                acc_u += tl.dot(a, bu.to(dt), input_precision=PRECISION) * su
        else:
            if FP8:  # per element, exactly as dequantize_block_fp8 (the tile may straddle blocks)
                kk = (k0 + offs_k) // SCALE_BK
                if SWAP_AB:
                    s_ok = n_ok[:, None] & (k0 + offs_k < D)[None, :]
                    sg = tl.load(sg_base + sg_n[:, None] + kk[None, :] * stride_sgk, mask=s_ok, other=0.0)
                    su = tl.load(su_base + su_n[:, None] + kk[None, :] * stride_suk, mask=s_ok, other=0.0)
                else:
                    s_ok = (k0 + offs_k < D)[:, None] & n_ok[None, :]
                    sg = tl.load(sg_base + kk[:, None] * stride_sgk + sg_n[None, :], mask=s_ok, other=0.0)
                    su = tl.load(su_base + kk[:, None] * stride_suk + su_n[None, :], mask=s_ok, other=0.0)
                bg = (bg.to(tl.float32) * sg.to(tl.float32)).to(dt)
                bu = (bu.to(tl.float32) * su.to(tl.float32)).to(dt)
            else:
                bg = bg.to(dt)
                bu = bu.to(dt)
            if SWAP_AB:
                acc_g = tl.dot(bg, a, acc_g, input_precision=PRECISION)
                acc_u = tl.dot(bu, a, acc_u, input_precision=PRECISION)
            else:
                acc_g = tl.dot(a, bg, acc_g, input_precision=PRECISION)
                acc_u = tl.dot(a, bu, acc_u, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    if SWAP_AB:
        acc_g = tl.trans(acc_g)
        acc_u = tl.trans(acc_u)

    h = swiglu_clamped(acc_g.to(dt), acc_u.to(dt), limit, HAS_LIMIT)  # the reference's roundings
    tl.store(H + pair[:, None] * stride_hm + offs_n[None, :], h.to(H.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_pid_m"])
def _down_kernel(
    H, WD, SD, RW, Y, SORTED, BLOCK_EXPERT, BLOCK_ROWS, IDS,
    D, I, E, num_pid_m,
    stride_hm, stride_de, stride_dn, stride_sde, stride_sdn, stride_sdk, stride_ym, HS, stride_hsm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    FP8: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
    SCALE_ACC: tl.constexpr = False, SWAP_AB: tl.constexpr = False, PAIR_BLOCKS: tl.constexpr = False,
    ACT_FP8: tl.constexpr = False, X_FP8: tl.constexpr = False, PDL: tl.constexpr = False):
    # X_FP8 (with ACT_FP8): H is e4m3 from act_quant, its scales HS [pairs, K blocks]
    pdl_enter(PDL)
    pid_m, pid_n, e = _block_and_tile(IDS, BLOCK_EXPERT, E, num_pid_m, D, GROUP_M, BLOCK_N, PAIR_BLOCKS)
    if e < 0:
        return
    e = e.to(tl.int64)
    dt = Y.dtype.element_ty  # the model dtype (H's, unless X_FP8)
    row_ok, pair = _block_rows(SORTED, BLOCK_ROWS, pid_m, BLOCK_M, PAIR_BLOCKS)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < D
    offs_k = tl.arange(0, BLOCK_K)

    if SWAP_AB:  # h tile [BK, BM], weight tile [BN, BK], accumulator [BN, BM]
        a_ptrs = H + pair[None, :] * stride_hm + offs_k[:, None]
        b_ptrs = WD + e * stride_de + offs_n[:, None] * stride_dn + offs_k[None, :]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:        # h tile [BM, BK], weight tile [BK, BN], accumulator [BM, BN]
        a_ptrs = H + pair[:, None] * stride_hm + offs_k[None, :]
        b_ptrs = WD + e * stride_de + offs_n[None, :] * stride_dn + offs_k[:, None]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if FP8:
        s_base = SD + e * stride_sde
        s_n = (offs_n // SCALE_BN) * stride_sdn
    for k0 in range(0, I, BLOCK_K):
        a = load_k_tile(a_ptrs, row_ok, I - k0, offs_k, 0 if SWAP_AB else 1, EVEN_K)
        b = load_k_tile(b_ptrs, n_ok, I - k0, offs_k, 1 if SWAP_AB else 0, EVEN_K)
        if FP8 and SCALE_ACC:
            kb = k0 // SCALE_BK
            if BLOCK_N <= SCALE_BN:
                sc = tl.load(s_base + (n0 // SCALE_BN) * stride_sdn + kb * stride_sdk).to(tl.float32)
            else:
                sc = tl.load(s_base + s_n + kb * stride_sdk, mask=n_ok, other=0.0).to(tl.float32)
                if SWAP_AB:
                    sc = sc[:, None]
                else:
                    sc = sc[None, :]
            if ACT_FP8:
                if SWAP_AB:
                    aq, sa = act_tile_e4m3(a, HS, pair, row_ok, stride_hsm, kb, 0, X_FP8)
                    acc += tl.dot(b, aq) * (sc * sa)
                else:
                    aq, sa = act_tile_e4m3(a, HS, pair, row_ok, stride_hsm, kb, 1, X_FP8)
                    acc += tl.dot(aq, b) * (sc * sa)
            elif SWAP_AB:
                acc += tl.dot(b.to(dt), a, input_precision=PRECISION) * sc
            else:
                acc += tl.dot(a, b.to(dt), input_precision=PRECISION) * sc
        else:
            if FP8:
                kk = (k0 + offs_k) // SCALE_BK
                if SWAP_AB:
                    s_ok = n_ok[:, None] & (k0 + offs_k < I)[None, :]
                    sc = tl.load(s_base + s_n[:, None] + kk[None, :] * stride_sdk, mask=s_ok, other=0.0)
                else:
                    s_ok = (k0 + offs_k < I)[:, None] & n_ok[None, :]
                    sc = tl.load(s_base + kk[:, None] * stride_sdk + s_n[None, :], mask=s_ok, other=0.0)
                b = (b.to(tl.float32) * sc.to(tl.float32)).to(dt)
            else:
                b = b.to(dt)
            if SWAP_AB:
                acc = tl.dot(b, a, acc, input_precision=PRECISION)
            else:
                acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if SWAP_AB:
        acc = tl.trans(acc)

    w = tl.load(RW + pair, mask=row_ok, other=0.0).to(tl.float32)
    y = acc.to(dt).to(tl.float32) * w[:, None]
    tl.store(Y + pair[:, None] * stride_ym + offs_n[None, :], y.to(Y.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _sum_kernel(Y, IDS, OUT, D, E, top_k, stride_ym, stride_om, ROWS, RW, BLOCK_D: tl.constexpr,
                GATHER: tl.constexpr = False, PDL: tl.constexpr = False):
    """out[t] = Σ_k y[t, k] in fp32, one rounding. GATHER (grouped_moe.py): pair p's row of Y is
    ROWS[p] and it is weighted here, w = RW[p], the term rounded to the model dtype first."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = offs < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for k in range(0, top_k):
        p = t * top_k + k
        e = tl.load(IDS + p)
        routed = (e >= 0) & (e < E)
        if GATHER:
            row = tl.load(ROWS + p).to(tl.int64)
            y = tl.load(Y + row * stride_ym + offs, mask=ok & routed, other=0.0).to(tl.float32)
            acc += (y * tl.load(RW + p).to(tl.float32)).to(OUT.dtype.element_ty).to(tl.float32)
        else:
            acc += tl.load(Y + p * stride_ym + offs, mask=ok & routed, other=0.0).to(tl.float32)
    tl.store(OUT + t * stride_om + offs, acc.to(OUT.dtype.element_ty), mask=ok)
