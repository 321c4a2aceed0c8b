"""Fused routed-expert MoE (docs/MODEL.md §5, MoE) as Triton kernels: ReferenceOps.moe_experts, fast.

    out[t] = Σ_k w[t,k] · down_e( silu(clamp(gate_e x_t)) · clamp(up_e x_t) ),   e = ids[t,k]

Stacked weights gate/up [E, I, D], down [E, D, I] (bf16/fp16/fp32, or fp8 e4m3 with DeepSeek
128x128 block scales `scale_inv [E, out/bo, in/bi]`). Three launches at the smallest batches
(up to PAIR_BLOCKS_MAX_PAIRS pairs), four at the other decode sizes, six above; no host sync,
every size an upper bound computed from (N, top_k, E, BLOCK_M), so the whole op can be captured
in a CUDA graph:

0. Pair blocks (M = N·top_k <= PAIR_BLOCKS_MAX_PAIRS, e.g. batch <= 4 at top-8): no alignment.
   Block b is pair b alone (one real row of its BLOCK_M), its expert read straight from
   ids.flat[b] by the GEMMs (ids outside [0, E): the block is skipped), M blocks in all. An
   expert routed twice in the batch has its weights read twice: cheaper than the alignment
   launch only at these sizes (see PAIR_BLOCKS_MAX_PAIRS). Steps 2-4 as below.
1. Alignment (moe_align.py): the pairs grouped by expert, each expert's group padded to a
   multiple of BLOCK_M, so that every BLOCK_M-row block of the sorted list belongs to one
   expert; one launch up to ONE_LAUNCH_MAX_PAIRS pairs, three above.
2. _gate_up  grouped GEMM over (block, I-tile): both projections in one program (two weight
   pointers, two accumulators) with the clamped SwiGLU fused in the epilogue; writes the
   activation h [M, I] at the pair's flat index.
3. _down     grouped GEMM over (block, D-tile): y = h · W_downᵀ, times the routing weight,
   written to ybuf [M, D] = [N, top_k, D] at the pair's flat index (no atomics).
4. _sum      out[t] = Σ_k ybuf[t, k] in fp32, rounded once: deterministic.

Numerics follow ReferenceOps.moe_experts step by step, but for one thing: fp8 weight tiles are
converted exactly to the activation dtype (w8a16: activations stay in the model dtype), the
products accumulate in fp32 on the tensor cores, and the 128x128 block scale multiplies each K
tile's fp32 partial product (acc += dot(x, w)·s; one multiply per output element per K tile)
instead of each weight element before the dot, where the reference rounds w·s to the activation
dtype (dequantize_block_fp8). That is closer to the exact product, and differs from the
reference by about the reference's own error (bf16: a few 1e-3 relative). Tiles that straddle
scale blocks along K (BLOCK_K above the block), or a config's scale_acc=False, dequantise per
element exactly as the reference does. With `act_fp8` (w8a8, CudaH200Ops' default for fp8
weights) each GEMM also quantises its x tile to e4m3 per row and K scale block (quant_act_e4m3)
and multiplies e4m3 by e4m3 (an fp8 wgmma on the swapped decode tiles, FP8A8_CONFIGS); its
reference is ReferenceOps.moe_experts with fp8_activations="dynamic". Gate, up, silu(gate), the
activation, the down product and the weighted term are each rounded to the model dtype where the
reference rounds them; the final top-k sum is fp32 with one rounding here, a chain of bf16 adds
in the reference.

Tiles per token count come from fused_moe_configs.py: CONFIGS (16-bit weights), FP8_CONFIGS (fp8
weights: half the bytes per element, so wider tiles / deeper pipelines) and FP8A8_CONFIGS (w8a8)
(decode: BLOCK_M 16 and wide K tiles, memory-bound, every routed expert's weights read once per
step (once per pair that picks it with pair blocks); prefill: BLOCK_M 64/128
tensor-core tiles with a grouped launch order so that the blocks of one expert share its weight
tiles in L2). A config may also ask for SWAP_AB (the transposed product accᵀ = W·xᵀ, the weight
tile as the MMA's A operand).

Expert ids outside [0, E) (e.g. -1) are dropped: the pair contributes nothing, as in the
reference (expert parallelism marks another rank's experts -1: glmrt.model.moe.TokenDispatcher).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# the tile tables live in fused_moe_configs; re-exported here for tests and benches (fm.CONFIGS, ...)
from .fused_moe_configs import CONFIGS, FP8_CONFIGS, FP8A8_CONFIGS, FP8_DTYPES, FP32_CONFIG, get_config  # noqa: F401
from . import pdl
from .pdl import pdl_enter
from .act_quant import act_fp8_supported, act_quant, act_tile_e4m3
from .interpreter import patch_interpreter
from .moe_align import moe_align
from ..reference import MoEPartials

patch_interpreter()

ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
WEIGHT_DTYPES = ACT_DTYPES + FP8_DTYPES

# Up to this many (token, slot) pairs every pair is its own BLOCK_M block (no alignment launch).
# The price: an expert picked by two pairs of the batch has its weights read twice. Uniform
# top-8 routing of B tokens over 288 experts reaches 288·(1-(1-8/288)^B) distinct experts, so the
# duplicate reads add ~1.4% bytes at B=2, ~4% at B=4, ~10% at B=8, against the ~9 µs per layer the
# alignment costs on an H200 out of an MoE layer of ~100 µs (B=1) .. ~150 µs (B=8): a win up to
# B=4 at top-8, i.e. 32 pairs. Measured on an H200 (D 4096, I 2048, fp8, CUDA graph, random
# routing): pair minus aligned -8 µs at B=1 and B=2, -7 µs at B=4, +6 .. +57 µs at B=8.
PAIR_BLOCKS_MAX_PAIRS = 32
# w8a8 (act_fp8): up to this many tokens each GEMM program quantises its own activation tile (the
# measured decode path); above, act_quant quantises x and h once first (at BLOCK_M 128 the in-GEMM
# quantisation of a 128x128 x tile spills on sm_90, and every N tile would redo it).
INKERNEL_QUANT_MAX_TOKENS = 1024
# 16-bit weights on pair blocks: gate/up in 32-column tiles, 3 stages (the table's 64 / 4 left
# the last of ~2.2 waves mostly empty at batch 1 with the shared expert seated, 9 pairs). H200,
# one MoE layer call in a CUDA graph: 128.8 -> 119.6 µs, the same output.
PAIR_GATE_UP_16BIT = dict(BLOCK_N=32, num_stages=3)


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
    # grouped launch order: GROUP_M consecutive blocks sweep the N tiles together (L2 reuse)
    pid = tl.program_id(0)
    in_group = GROUP_M * tl.cdiv(I, BLOCK_N)
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m
    if PAIR_BLOCKS:  # block pid_m is pair pid_m: its expert straight from ids (dropped: -1)
        e = tl.load(IDS + pid_m).to(tl.int64)
        e = tl.where((e >= 0) & (e < E), e, -1)
    else:
        e = tl.load(BLOCK_EXPERT + pid_m)
    if e < 0:
        return
    e = e.to(tl.int64)
    dt = H.dtype.element_ty  # the model dtype (X's, unless X_FP8)
    offs_m = tl.arange(0, BLOCK_M)
    if PAIR_BLOCKS:  # one real row: the pair itself
        row_ok = offs_m < 1
        pair = tl.zeros([BLOCK_M], dtype=tl.int64) + pid_m
    else:
        row_ok = offs_m < tl.load(BLOCK_ROWS + pid_m)
        pair = tl.load(SORTED + pid_m * BLOCK_M + offs_m, mask=row_ok, other=0).to(tl.int64)
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
        if SWAP_AB:
            if EVEN_K:
                a = tl.load(a_ptrs, mask=row_ok[None, :], other=0.0)
                bg = tl.load(g_ptrs, mask=n_ok[:, None], other=0.0)
                bu = tl.load(u_ptrs, mask=n_ok[:, None], other=0.0)
            else:
                k_ok = offs_k < D - k0
                a = tl.load(a_ptrs, mask=k_ok[:, None] & row_ok[None, :], other=0.0)
                bg = tl.load(g_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                bu = tl.load(u_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        else:
            if EVEN_K:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                bg = tl.load(g_ptrs, mask=n_ok[None, :], other=0.0)
                bu = tl.load(u_ptrs, mask=n_ok[None, :], other=0.0)
            else:
                k_ok = offs_k < D - k0
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                bg = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                bu = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
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
    # grouped launch order: GROUP_M consecutive blocks sweep the N tiles together (L2 reuse)
    pid = tl.program_id(0)
    in_group = GROUP_M * tl.cdiv(D, BLOCK_N)
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m
    if PAIR_BLOCKS:  # block pid_m is pair pid_m (see _gate_up_kernel)
        e = tl.load(IDS + pid_m).to(tl.int64)
        e = tl.where((e >= 0) & (e < E), e, -1)
    else:
        e = tl.load(BLOCK_EXPERT + pid_m)
    if e < 0:
        return
    e = e.to(tl.int64)
    dt = Y.dtype.element_ty  # the model dtype (H's, unless X_FP8)
    offs_m = tl.arange(0, BLOCK_M)
    if PAIR_BLOCKS:
        row_ok = offs_m < 1
        pair = tl.zeros([BLOCK_M], dtype=tl.int64) + pid_m
    else:
        row_ok = offs_m < tl.load(BLOCK_ROWS + pid_m)
        pair = tl.load(SORTED + pid_m * BLOCK_M + offs_m, mask=row_ok, other=0).to(tl.int64)
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
        if SWAP_AB:
            if EVEN_K:
                a = tl.load(a_ptrs, mask=row_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=n_ok[:, None], other=0.0)
            else:
                k_ok = offs_k < I - k0
                a = tl.load(a_ptrs, mask=k_ok[:, None] & row_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        else:
            if EVEN_K:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
            else:
                k_ok = offs_k < I - k0
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
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
def _sum_kernel(Y, IDS, OUT, D, E, top_k, stride_ym, stride_om, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = offs < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for k in range(0, top_k):
        e = tl.load(IDS + t * top_k + k)
        routed = (e >= 0) & (e < E)
        acc += tl.load(Y + (t * top_k + k) * stride_ym + offs, mask=ok & routed, other=0.0).to(tl.float32)
    tl.store(OUT + t * stride_om + offs, acc.to(OUT.dtype.element_ty), mask=ok)


# ---------------------------------------------------------------------------------------
# entry points
# ---------------------------------------------------------------------------------------
def supported(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w_gate: torch.Tensor,
              w_up: torch.Tensor, w_down: torch.Tensor,
              scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
              block: tuple[int, int] = (128, 128)) -> bool:
    """Whether fused_moe takes these arguments (shapes, dtypes, layouts); else use the reference."""
    if x.dim() != 2 or ids.dim() != 2 or weights.shape != ids.shape or ids.shape[0] != x.shape[0]:
        return False
    if x.dtype not in ACT_DTYPES or ids.dtype not in (torch.int32, torch.int64) or not weights.is_floating_point():
        return False
    if w_gate.dim() != 3 or w_gate.shape != w_up.shape or w_down.dim() != 3:
        return False
    e, i, d = w_gate.shape
    if x.shape[1] != d or tuple(w_down.shape) != (e, d, i) or e < 1 or ids.shape[1] < 1:
        return False
    ws = (w_gate, w_up, w_down)
    if any(w.stride(-1) != 1 for w in ws) or len({w.dtype for w in ws}) != 1 or w_gate.dtype not in WEIGHT_DTYPES:
        return False
    tensors = [x, ids, weights, *ws]
    if (scales is None) != (w_gate.dtype not in FP8_DTYPES):
        return False
    if scales is not None:
        if len(scales) != 3 or len(block) != 2:
            return False
        bo, bi = int(block[0]), int(block[1])
        if bo < 16 or bi < 16 or bo & (bo - 1) or bi & (bi - 1):
            return False
        want = ((e, triton.cdiv(i, bo), triton.cdiv(d, bi)),) * 2 + ((e, triton.cdiv(d, bo), triton.cdiv(i, bi)),)
        if any(tuple(s.shape) != w or not s.is_floating_point() for s, w in zip(scales, want)):
            return False
        tensors += list(scales)
    return all(t.device == x.device for t in tensors)


# Tiles that a table or a caller asks for but whose shared memory the device lacks (the per-element
# dequant keeps a converted weight tile per stage): fewer stages first, then a narrower K tile,
# once per (kernel, tile, K); the shrunk tile is remembered. Triton compiles at the first launch,
# so the OutOfResources comes before anything runs.
_FITTED: dict[tuple, tuple[int, int]] = {}


def _launch_fitting(kernel, grid, args: tuple, meta: dict, c: dict, k_dim: int, scale_acc: bool) -> None:
    key = (id(kernel), c["BLOCK_N"], c["BLOCK_K"], c["num_warps"], c["num_stages"], scale_acc,
           k_dim % c["BLOCK_K"] == 0, meta["FP8"], meta["SWAP_AB"], meta.get("ACT_FP8", False),
           meta.get("X_FP8", False))
    bk, stages = _FITTED.get(key, (c["BLOCK_K"], c["num_stages"]))
    while True:
        try:
            kernel[grid(c)](*args, **meta, BLOCK_N=c["BLOCK_N"], BLOCK_K=bk, EVEN_K=k_dim % bk == 0,
                            SCALE_ACC=scale_acc and bk <= meta["SCALE_BK"],
                            num_warps=c["num_warps"], num_stages=stages)
            _FITTED[key] = (bk, stages)
            return
        except triton.runtime.errors.OutOfResources:
            if stages > 1:
                stages -= 1
            elif bk > 16 and not meta.get("ACT_FP8"):  # w8a8 quantises groups of the scale's K block
                bk, stages = bk // 2, c["num_stages"]
            else:
                raise


def fused_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w_gate: torch.Tensor,
              w_up: torch.Tensor, w_down: torch.Tensor, limit: float | None,
              scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
              block: tuple[int, int] = (128, 128), *, out: torch.Tensor | None = None,
              config: dict | None = None, pair_blocks: bool | None = None, act_fp8: bool = False,
              reduce: bool = True) -> torch.Tensor | MoEPartials:
    """ReferenceOps.moe_experts: x [N, D], ids/weights [N, k], gate/up [E, I, D], down [E, D, I].

    `act_fp8` (where act_fp8_supported): w8a8, i.e. both GEMMs' inputs quantised per row and
    scale block along K (inside the GEMMs up to INKERNEL_QUANT_MAX_TOKENS tokens, else once by
    act_quant) and fp8 x fp8 products; ReferenceOps.moe_experts with fp8_activations="dynamic" is
    its reference. Otherwise (and for other weights) w8a16.

    `out` [N, D] (x.dtype, contiguous) is written in place when given; `config` overrides the
    tile table entry (same layout as get_config's result); `pair_blocks` forces one block per
    (token, slot) pair without alignment (True) or the aligned blocks (False); None: pair blocks
    up to PAIR_BLOCKS_MAX_PAIRS pairs. `reduce=False`: no sum launch, MoEPartials (the weighted
    per-pair rows) for a consumer that sums them itself (mhc.mhc_post)."""
    n, d = x.shape
    top_k = ids.shape[1]
    e, i, _ = w_gate.shape
    if out is None and (reduce or n == 0):  # unreduced, the pair rows are the result
        out = torch.empty(n, d, dtype=x.dtype, device=x.device)
    assert out is None or (out.shape == (n, d) and out.dtype == x.dtype and out.stride(-1) == 1)
    if n == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    m = n * top_k
    fp8 = scales is not None
    act_fp8 = act_fp8_supported(act_fp8, x.dtype, w_gate.dtype, block)
    cfg = get_config(n, x.dtype, w_gate.dtype, act_fp8)
    if pair_blocks is None:
        pair_blocks = m <= PAIR_BLOCKS_MAX_PAIRS
    if pair_blocks and not fp8 and x.dtype != torch.float32:
        cfg["gate_up"].update(PAIR_GATE_UP_16BIT)
    if config:
        cfg.update({k: v for k, v in config.items() if k == "BLOCK_M"})
        for part in ("gate_up", "down"):
            cfg[part].update(config.get(part, {}))
    bm = cfg["BLOCK_M"]
    gu, dn = dict(cfg["gate_up"]), dict(cfg["down"])
    bo, bi = (int(block[0]), int(block[1])) if fp8 else (1 << 30, 1 << 30)
    flags = {}
    for part, c in (("gate_up", gu), ("down", dn)):
        if fp8 and x.dtype == torch.float32:
            c["BLOCK_K"] = min(c["BLOCK_K"], 32)  # fp32 + dequant at K 64 spills (parity path)
        if act_fp8:  # one K tile = one activation group = the weight's scale block
            c["BLOCK_K"], c["scale_acc"] = bi, True
        # the scale may multiply the K tile's partial product when the tile is inside one scale
        # block along K (powers of two: BLOCK_K <= bi means it divides it); else per element
        flags[part] = dict(SCALE_ACC=bool(fp8 and c.get("scale_acc", True) and c["BLOCK_K"] <= bi),
                           SWAP_AB=bool(c.get("SWAP_AB", False)))
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # tf32 is moot for 16-bit operands

    flat_ids = ids.reshape(-1).contiguous()
    rw = weights.reshape(-1).contiguous()
    if pair_blocks:  # block b = pair b, expert ids.flat[b]: no alignment launch, no buffers
        sorted_ids = block_expert = block_rows = flat_ids  # unused (PAIR_BLOCKS)
        nb = m
    else:
        sorted_ids, block_expert, block_rows = moe_align(ids, e, bm)
        nb = block_expert.shape[0]
    h = torch.empty(m, i, dtype=x.dtype, device=x.device)
    y = torch.empty(m, d, dtype=x.dtype, device=x.device)
    if fp8:
        sg, su, sd = scales
    else:
        sg = su = sd = w_gate  # unused (FP8=False)
    sstr = (lambda s: (s.stride(0), s.stride(1), s.stride(2))) if fp8 else (lambda s: (0, 0, 0))
    launch = pdl.launch(x.device)
    # w8a8 above INKERNEL_QUANT_MAX_TOKENS: x (and below, h) quantised once by act_quant, not once
    # per N tile inside the GEMMs
    pre = act_fp8 and n > INKERNEL_QUANT_MAX_TOKENS
    x_in, xs = act_quant(x, bi) if pre else (x, x)  # xs unused unless X_FP8

    _launch_fitting(
        _gate_up_kernel, lambda c: (nb * triton.cdiv(i, c["BLOCK_N"]),),
        (x_in, w_gate, w_up, sg, su, h, sorted_ids, block_expert, block_rows, flat_ids,
         d, i, e, top_k, nb, float(limit) if limit is not None else 0.0,
         x_in.stride(0),
         w_gate.stride(0), w_gate.stride(1), w_up.stride(0), w_up.stride(1),
         *sstr(sg), *sstr(su),
         h.stride(0), xs, xs.stride(0)),
        dict(BLOCK_M=bm, GROUP_M=gu["GROUP_M"], FP8=fp8, SCALE_BN=bo, SCALE_BK=bi, HAS_LIMIT=limit is not None,
             PRECISION=precision, SWAP_AB=flags["gate_up"]["SWAP_AB"], PAIR_BLOCKS=pair_blocks, ACT_FP8=act_fp8,
             X_FP8=pre, **launch),
        gu, d, flags["gate_up"]["SCALE_ACC"])
    h_in, hs = act_quant(h, bi) if pre else (h, h)
    _launch_fitting(
        _down_kernel, lambda c: (nb * triton.cdiv(d, c["BLOCK_N"]),),
        (h_in, w_down, sd, rw, y, sorted_ids, block_expert, block_rows, flat_ids,
         d, i, e, nb,
         h_in.stride(0), w_down.stride(0), w_down.stride(1), *sstr(sd), y.stride(0), hs, hs.stride(0)),
        dict(BLOCK_M=bm, GROUP_M=dn["GROUP_M"], FP8=fp8, SCALE_BN=bo, SCALE_BK=bi, PRECISION=precision,
             SWAP_AB=flags["down"]["SWAP_AB"], PAIR_BLOCKS=pair_blocks, ACT_FP8=act_fp8, X_FP8=pre, **launch),
        dn, i, flags["down"]["SCALE_ACC"])
    if not reduce:
        return MoEPartials(y.view(n, top_k, d), ids, e)
    block_d = min(1024, triton.next_power_of_2(d))
    _sum_kernel[(n, triton.cdiv(d, block_d))](y, flat_ids, out, d, e, top_k, y.stride(0), out.stride(0),
                                              BLOCK_D=block_d, **launch, num_warps=4)
    return out
