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
def _rescaled(acc, s_row, s_col, p_row, p_col):
    """acc, a running sum held in units of the scale p_row·p_col, re-expressed in units of
    s_row·s_col, so that the next K block's raw product adds into it in place (ACC_RESCALE)."""
    return acc * ((p_row / s_row) * (p_col / s_col))


@triton.jit
def _unit_scales(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SCALE_BN: tl.constexpr, SWAP_AB: tl.constexpr):
    """Ones shaped as a K block's activation row scales and weight column scales broadcast against
    the accumulator (a scalar when the tile is inside one scale block along N)."""
    if SWAP_AB:
        rows = tl.full([1, BLOCK_M], 1.0, tl.float32)
    else:
        rows = tl.full([BLOCK_M, 1], 1.0, tl.float32)
    if BLOCK_N <= SCALE_BN:
        cols = tl.full([], 1.0, tl.float32)
    elif SWAP_AB:
        cols = tl.full([BLOCK_N, 1], 1.0, tl.float32)
    else:
        cols = tl.full([1, BLOCK_N], 1.0, tl.float32)
    return rows, cols


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
# ACC_RESCALE (w8a8 only) keeps the running sum in units of the current K block's scale s_k
#              (activation row scale x weight column scale) instead: acc = dot(x, w, acc · s_{k-1}/s_k),
#              times s_K after the loop (FlashAttention's running rescale). The product then adds
#              into the accumulator in place, so the fresh fp32 partial of the other form, as many
#              registers again as the accumulator, is not needed, and wider tiles fit. The scales are
#              floored so that no ratio is 0/0 or overflows: activations at 1e-15 (quant_act_e4m3's own
#              floor is 1e-12 / 448; rows past the block's end load 0), weights at 1e-12 (a block of
#              zeros may have scale 0).
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
    ACT_FP8: tl.constexpr = False, X_FP8: tl.constexpr = False, PDL: tl.constexpr = False,
    ACC_RESCALE: tl.constexpr = False):
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
    p_a, p_g = _unit_scales(BLOCK_M, BLOCK_N, SCALE_BN, SWAP_AB)  # ACC_RESCALE: the sums' units
    p_u = p_g
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
                aq, sa = act_tile_e4m3(a, XS, tok, row_ok, stride_xsm, kb, 0 if SWAP_AB else 1, X_FP8)
                if ACC_RESCALE:
                    sa, sg, su = tl.maximum(sa, 1e-15), tl.maximum(sg, 1e-12), tl.maximum(su, 1e-12)
                    if SWAP_AB:
                        acc_g = tl.dot(bg, aq, _rescaled(acc_g, sa, sg, p_a, p_g))
                        acc_u = tl.dot(bu, aq, _rescaled(acc_u, sa, su, p_a, p_u))
                    else:
                        acc_g = tl.dot(aq, bg, _rescaled(acc_g, sa, sg, p_a, p_g))
                        acc_u = tl.dot(aq, bu, _rescaled(acc_u, sa, su, p_a, p_u))
                    p_a, p_g, p_u = sa, sg, su
                elif SWAP_AB:
                    acc_g += tl.dot(bg, aq) * (sg * sa)
                    acc_u += tl.dot(bu, aq) * (su * sa)
                else:
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
    if FP8 and SCALE_ACC and ACT_FP8 and ACC_RESCALE:
        acc_g = acc_g * (p_a * p_g)
        acc_u = acc_u * (p_a * p_u)
    if SWAP_AB:
        acc_g = tl.trans(acc_g)
        acc_u = tl.trans(acc_u)

    h = swiglu_clamped(acc_g.to(dt), acc_u.to(dt), limit, HAS_LIMIT)  # the reference's roundings
    tl.store(H + pair[:, None] * stride_hm + offs_n[None, :], h.to(H.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_pid_m"])
def _gate_up_one_dot_kernel(
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
    ACT_FP8: tl.constexpr = False, X_FP8: tl.constexpr = False, PDL: tl.constexpr = False,
    ACC_RESCALE: tl.constexpr = False):
    """gate/up of w8a8 prefill blocks as ONE product per K block: the weight tile is BLOCK_N gate
    columns then the same BLOCK_N up columns ([BK, 2·BN], gathered by pointer from the two
    tensors), so that each wgmma reads the activation tile once for both projections; the running
    sum is rescaled to each K block's scales (ACC_RESCALE's form), and split into gate and up in
    the epilogue. X is e4m3 from act_quant (scales XS), BLOCK_K the scale block, BLOCK_N <= SCALE_BN.
    The launch arguments are _gate_up_kernel's; only that one combination of its switches is taken."""
    tl.static_assert(FP8 and ACT_FP8 and X_FP8 and SCALE_ACC and ACC_RESCALE and not SWAP_AB
                     and BLOCK_K == SCALE_BK and BLOCK_N <= SCALE_BN)
    pdl_enter(PDL)
    pid_m, pid_n, e = _block_and_tile(IDS, BLOCK_EXPERT, E, num_pid_m, I, GROUP_M, BLOCK_N, PAIR_BLOCKS)
    if e < 0:
        return
    e = e.to(tl.int64)
    dt = H.dtype.element_ty
    row_ok, pair = _block_rows(SORTED, BLOCK_ROWS, pid_m, BLOCK_M, PAIR_BLOCKS)
    tok = pair // top_k
    n0 = pid_n * BLOCK_N
    offs_2n = tl.arange(0, 2 * BLOCK_N)
    is_g = offs_2n < BLOCK_N
    col = n0 + tl.where(is_g, offs_2n, offs_2n - BLOCK_N)
    col_ok = col < I
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = X + tok[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = tl.where(is_g[None, :], WG + e * stride_ge + col[None, :] * stride_gn,
                      WU + e * stride_ue + col[None, :] * stride_un) + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
    sg_ptr = SG + e * stride_sge + (n0 // SCALE_BN) * stride_sgn
    su_ptr = SU + e * stride_sue + (n0 // SCALE_BN) * stride_sun
    p_a = tl.full([BLOCK_M, 1], 1.0, tl.float32)
    p_w = tl.full([1, 2 * BLOCK_N], 1.0, tl.float32)
    for k0 in range(0, D, BLOCK_K):
        kb = k0 // BLOCK_K
        a = load_k_tile(a_ptrs, row_ok, D - k0, offs_k, 1, EVEN_K)
        b = load_k_tile(w_ptrs, col_ok, D - k0, offs_k, 0, EVEN_K)
        sg = tl.maximum(tl.load(sg_ptr + kb * stride_sgk).to(tl.float32), 1e-12)
        su = tl.maximum(tl.load(su_ptr + kb * stride_suk).to(tl.float32), 1e-12)
        sw = tl.where(is_g, sg, su)[None, :]
        sa = tl.maximum(tl.load(XS + tok * stride_xsm + kb, mask=row_ok, other=0.0), 1e-15)[:, None]
        acc = tl.dot(a, b, _rescaled(acc, sa, sw, p_a, p_w))
        p_a, p_w = sa, sw
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    acc = acc * (p_a * p_w)
    g, u = tl.split(tl.permute(tl.reshape(acc, [BLOCK_M, 2, BLOCK_N]), [0, 2, 1]))
    h = swiglu_clamped(g.to(dt), u.to(dt), limit, HAS_LIMIT)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    tl.store(H + pair[:, None] * stride_hm + offs_n[None, :], h.to(H.dtype.element_ty),
             mask=row_ok[:, None] & (offs_n < I)[None, :])


@triton.jit(do_not_specialize=["num_pid_m"])
def _down_kernel(
    H, WD, SD, RW, Y, SORTED, BLOCK_EXPERT, BLOCK_ROWS, IDS,
    D, I, E, num_pid_m,
    stride_hm, stride_de, stride_dn, stride_sde, stride_sdn, stride_sdk, stride_ym, HS, stride_hsm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    FP8: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
    SCALE_ACC: tl.constexpr = False, SWAP_AB: tl.constexpr = False, PAIR_BLOCKS: tl.constexpr = False,
    ACT_FP8: tl.constexpr = False, X_FP8: tl.constexpr = False, PDL: tl.constexpr = False,
    ACC_RESCALE: tl.constexpr = False):
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
    p_a, p_c = _unit_scales(BLOCK_M, BLOCK_N, SCALE_BN, SWAP_AB)  # ACC_RESCALE: the sum's units
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
                aq, sa = act_tile_e4m3(a, HS, pair, row_ok, stride_hsm, kb, 0 if SWAP_AB else 1, X_FP8)
                if ACC_RESCALE:
                    sa, sc = tl.maximum(sa, 1e-15), tl.maximum(sc, 1e-12)
                    if SWAP_AB:
                        acc = tl.dot(b, aq, _rescaled(acc, sa, sc, p_a, p_c))
                    else:
                        acc = tl.dot(aq, b, _rescaled(acc, sa, sc, p_a, p_c))
                    p_a, p_c = sa, sc
                elif SWAP_AB:
                    acc += tl.dot(b, aq) * (sc * sa)
                else:
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
    if FP8 and SCALE_ACC and ACT_FP8 and ACC_RESCALE:
        acc = acc * (p_a * p_c)
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
