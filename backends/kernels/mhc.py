"""mHC (docs/MODEL.md §2.2) as Triton kernels: the pre block (RMS + mixing matmul + gates +
Sinkhorn + collapse) and the post combine.

mhc_pre, per token, all fp32 (ReferenceOps.mhc_pre):
    r = rsqrt(mean(x²) + norm_eps) over x = flatten(X) [M·D];   z = r · (fn · x)
    pre  = sigmoid(z_pre·s0 + b_pre) + hc_eps;   post = 2·sigmoid(z_post·s1 + b_post)
    C = softmax_row(z_comb·s2 + b_comb) + hc_eps;  C /= colsum + hc_eps;
    (iters-1)×: C /= rowsum + hc_eps; C /= colsum + hc_eps
    collapsed = cast(Σ_i pre[i]·X[i])
(r is applied after the product, r·(fn·x) instead of fn·(r·x): equal up to fp32 rounding.)

Two shapes of launch, chosen by the number of 16-token blocks:
  * fused (many tokens, prefill): one program per BLOCK_N tokens streams its tokens and all
    of fn through two fp32 matrix products (pre|post columns, comb columns), then does the
    gates, the Sinkhorn iterations in registers ([BLOCK_N, M, M] tiles) and the collapse.
  * split-K (few tokens, decode): `_mhc_mix_kernel` spreads the M·D reduction over a grid of
    (token blocks × K splits) writing fp32 partials (no atomics: deterministic), then the same
    epilogue kernel finishes on a 2-D grid of (tokens × D tiles): every program sums the
    partials (zp, ss) for r and pre and collapses its own D tile; the D-tile-0 programs also sum
    zc and do post and comb (the Sinkhorn), concurrently with the other tiles' collapse. fn is
    [(2+M)M, M·D] fp32 = 1.5 MiB at full size, so one program per token block would read it
    through one SM; splitting spreads it over the chip.
M is padded to BLOCK_M = max(4, next_pow2(M)) (M <= 8), so BLOCK_M² >= 16 for tl.dot.

mhc_post (the post combine): mhc_post.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .pdl import pdl_enter
from .interpreter import patch_interpreter

patch_interpreter()

_BLOCK_PP = 16  # pre|post columns of z (2M <= 16)
_NUM_SMS_GUESS = 132
# K splits of the decode (split) launch at most. The epilogue loads all partials at once, so
# many splits cost it little; few splits leave each mix program a chain of dependent fp32 dots
# (at N = 1, 32 splits of 8 K tiles: 19 µs a call on the H200; 128 splits of one tile: ~6).
_MAX_SPLIT = 128
_LARGE_N = 1024  # tokens from which the one-launch path takes 64-token blocks and tf32x3 products
# tl.dot precision of the decode (split) mix: "tf32x3" (tensor cores, ~fp32; what prefill sizes
# take) or "ieee" (fp32 FMAs). H200, bench.decode_profile --mhc-precision ieee,tf32x3 in one run:
# bf16 batch 1 1.363 -> 1.343 ms, batch 64 9.482 -> 9.402; fp8 batch 64 5.949 -> 5.943 (kernels
# 5.919 -> 5.820). The tests hold the same 1e-5 bound either way.
DECODE_PRECISION = "tf32x3"
PREFILL_PRECISION = "bf16x3"  # from _LARGE_N tokens (bf16 streams; others take tf32x3): see mhc_pre
_SPLIT_BLOCK_K = 128  # the mix kernel's K tile: one or two per split at decode sizes
# Prefill sizes (>= _LARGE_N tokens): 128-token mixing blocks with at least ceil(M·D /
# PREFILL_MIX_K) K splits, then the 2-D epilogue. Each mixing program then streams 128 x
# PREFILL_MIX_K stream values (512 KB at 2048) whatever the prompt's length, as the 4K prefill's
# 8 splits did, instead of one fused launch (one program per 64 tokens mixing all of M·D, then
# re-reading its 2 MB of streams for the collapse) from ~8.4K tokens. `bench.mhc_h200` on an H100,
# M 4, D 4096, ms (this / the fused launch): 16K tokens 0.542 / 0.709, 64K 2.097 / 2.407; 4K
# 0.143 (split before too). 0: the fused launch from 2 x SMs 128-token blocks (~8.4K tokens).
PREFILL_MIX_K = 2048
# Split (decode) epilogue: a 2-D grid (tokens x D tiles) of _SPLIT_TILE stream elements per program
# (BLOCK_D = _SPLIT_TILE / BLOCK_M columns: 1024 at M 4, so 4 tiles at D 4096). The tile-0
# program's Sinkhorn (~0.12 µs per iteration, ~2.3 µs at 20) is the critical path, so narrower
# tiles gain nothing there, while every program re-reads all the zp/ss partials (17 fp32 per
# split: 8.7 KiB at 128 splits, about the 8 KiB of one bf16 tile of 4096), so wider tiles keep
# that overhead at most as large as the tile. H200, D 4096, 20 iterations, epilogue µs at batch
# 1 / 4 / 16 / 64: before the D split 8.6 / 6.8 / 7.0 / 6.5; tiles of 2048 elements 5.9 / 6.1 /
# 6.4 / 8.2, 4096: 5.2 / 5.4 / 5.6 / 5.9, 8192: 5.3 / 5.4 / 5.5 / 5.6. 4 warps: 1 or 2 were no
# faster (within noise) and change the partial sums' reduction order (not bit-equal to the
# one-program-per-token epilogue, which 4 warps at 4096 are).
_SPLIT_TILE = 4096
_SPLIT_WARPS = 4
# With the layer's RMSNorm fused in (mhc_pre(norm=...)), one program collapses a token's whole
# row (the norm needs all of it): up to _NORM_TILE stream elements (4 x 4096), on 8 warps
# (64 fp32 registers a thread for the tile).
_NORM_TILE = 16384
_NORM_WARPS = 8
# ... or at prefill sizes (>= _LARGE_N tokens), with NORM_CHUNK > 0, in a loop over chunks of
# NORM_CHUNK columns on _NORM_LOOP_WARPS: the collapse stored as it goes, then read back (L2) for
# the norm once the row's sum of squares is known (likely why it is faster, not profiled: fewer
# registers per program than the whole row, so more programs per SM keep loads in flight).
# `bench.mhc_h200` on an H100 (M 4, D 4096,
# mhc_post then mhc_pre with the norm, ms at 16K tokens, 0 / 1024 / 2048): 1.084 / 1.017 / 0.993
# after an attention output, 1.388 / 1.320 / 1.295 after an MoE's rows. 0: the whole row.
NORM_CHUNK = 2048
_NORM_LOOP_WARPS = 4


@triton.jit
def _dot_bf16x3(xb, f, acc):
    """acc + xb · fᵀ at ~fp32 accuracy on bf16 tensor cores: xb is exact in bf16 (the streams),
    f (fp32) splits into hi + mid + lo bf16 parts (24 significant bits, f's own), and three
    bf16 products accumulate in fp32, the small parts first. The tile's sum starts from zero
    and joins the running sum in one IEEE add: chained through the MMAs (acc as their C
    operand) the running sum drifted (H200, 16K tokens x K 16384: post 1.2e-5 relative against
    3.9e-7 for tf32x3, whose products also start from zero per tile)."""
    hi = f.to(tl.bfloat16)
    rest = f - hi.to(tl.float32)
    mid = rest.to(tl.bfloat16)
    lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
    t = tl.dot(xb, tl.trans(lo))
    t = tl.dot(xb, tl.trans(mid), t)
    return acc + tl.dot(xb, tl.trans(hi), t)


@triton.jit
def _mhc_mix(X, FN, tok, n_ok, stride_xn, stride_fn, M, k_lo, k_hi,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_PP: tl.constexpr, PRECISION: tl.constexpr):
    """Unnormalised z partials over flat columns [k_lo, k_hi): (z_prepost [BN, BPP],
    z_comb [BN, BM*BM] (q = i*BM + j), sum of squares [BN])."""
    offs_k = tl.arange(0, BLOCK_K)
    offs_pp = tl.arange(0, BLOCK_PP)
    pp_ok = offs_pp < 2 * M
    offs_q = tl.arange(0, BLOCK_M * BLOCK_M)
    qi = offs_q // BLOCK_M
    qj = offs_q % BLOCK_M
    q_ok = (qi < M) & (qj < M)
    q_row = tl.where(q_ok, 2 * M + qi * M + qj, 0)
    x_row = tok.to(tl.int64) * stride_xn
    zp = tl.zeros([BLOCK_N, BLOCK_PP], dtype=tl.float32)
    zc = tl.zeros([BLOCK_N, BLOCK_M * BLOCK_M], dtype=tl.float32)
    ss = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < k_hi
        xs = tl.load(X + x_row[:, None] + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = xs.to(tl.float32)
        ss += tl.sum(x * x, 1)
        # fn rows are contiguous along k: load [rows, BLOCK_K] (coalesced) and transpose
        fp = tl.load(FN + offs_pp[:, None] * stride_fn + kk[None, :], mask=pp_ok[:, None] & k_ok[None, :],
                     other=0.0).to(tl.float32)
        fc = tl.load(FN + q_row[:, None] * stride_fn + kk[None, :], mask=q_ok[:, None] & k_ok[None, :],
                     other=0.0).to(tl.float32)
        if PRECISION == "bf16x3":  # bf16 streams straight into bf16 products (no fp32 operand)
            zp = _dot_bf16x3(xs, fp, zp)
            zc = _dot_bf16x3(xs, fc, zc)
        else:
            zp += tl.dot(x, tl.trans(fp), input_precision=PRECISION)
            zc += tl.dot(x, tl.trans(fc), input_precision=PRECISION)
    return zp, zc, ss


@triton.jit
def _mhc_mix_kernel(X, FN, ZP, ZC, SS, N, stride_xn, stride_fn, M, K, k_per,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_PP: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    nb = tl.program_id(0)
    s = tl.program_id(1)
    tok = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = tok < N
    k_lo = s * k_per
    k_hi = tl.minimum(k_lo + k_per, K)
    zp, zc, ss = _mhc_mix(X, FN, tok, n_ok, stride_xn, stride_fn, M, k_lo, k_hi,
                          BLOCK_N, BLOCK_K, BLOCK_M, BLOCK_PP, PRECISION)
    row = (s * N + tok).to(tl.int64)
    tl.store(ZP + row[:, None] * BLOCK_PP + tl.arange(0, BLOCK_PP)[None, :], zp, mask=n_ok[:, None])
    BMM: tl.constexpr = BLOCK_M * BLOCK_M
    tl.store(ZC + row[:, None] * BMM + tl.arange(0, BMM)[None, :], zc, mask=n_ok[:, None])
    tl.store(SS + row, ss, mask=n_ok)


@triton.jit
def _mhc_gate_pre(zp, BASE, SCALE, M, hc_eps, BLOCK_M: tl.constexpr, BLOCK_PP: tl.constexpr):
    """pre [BN, BM] (0 in the padded streams) from the r-scaled pre|post columns zp [BN, BPP]."""
    offs_pp = tl.arange(0, BLOCK_PP)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    s0 = tl.load(SCALE + 0).to(tl.float32)
    # pick columns m out of the BLOCK_PP pre|post columns (exact)
    sel_pre = offs_pp[:, None] == offs_m[None, :]
    z_pre = tl.sum(tl.where(sel_pre[None, :, :], zp[:, :, None], 0.0), 1)     # [BN, BM]
    b_pre = tl.load(BASE + offs_m, mask=m_ok, other=0.0).to(tl.float32)
    pre = tl.sigmoid(z_pre * s0 + b_pre[None, :]) + hc_eps
    return tl.where(m_ok[None, :], pre, 0.0)


@triton.jit
def _mhc_post_comb(zp, zc, tok64, n_ok, BASE, SCALE, POST, COMB, M, iters, hc_eps,
                   BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_PP: tl.constexpr):
    """post and comb (softmax + Sinkhorn) from the r-scaled zp [BN, BPP] and zc [BN, BM*BM]:
    computed and stored."""
    offs_pp = tl.arange(0, BLOCK_PP)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    s1 = tl.load(SCALE + 1).to(tl.float32)
    s2 = tl.load(SCALE + 2).to(tl.float32)
    # post: columns M + m of the pre|post columns (exact)
    sel_post = offs_pp[:, None] == (offs_m[None, :] + M)
    z_post = tl.sum(tl.where(sel_post[None, :, :], zp[:, :, None], 0.0), 1)   # [BN, BM]
    b_post = tl.load(BASE + M + offs_m, mask=m_ok, other=0.0).to(tl.float32)
    post = 2.0 * tl.sigmoid(z_post * s1 + b_post[None, :])
    tl.store(POST + tok64[:, None] * M + offs_m[None, :], post, mask=n_ok[:, None] & m_ok[None, :])

    # comb: row softmax, then Sinkhorn in registers on [BN, BM, BM]
    zc3 = tl.reshape(zc, [BLOCK_N, BLOCK_M, BLOCK_M])
    ii = offs_m[:, None]
    jj = offs_m[None, :]
    valid = (ii < M) & (jj < M)                                                 # [BM, BM]
    b_comb = tl.load(BASE + 2 * M + ii * M + jj, mask=valid, other=0.0).to(tl.float32)
    logit = zc3 * s2 + b_comb[None, :, :]
    logit = tl.where((jj < M)[None, :, :], logit, float("-inf"))
    mx = tl.max(logit, 2)
    e = tl.exp(logit - mx[:, :, None])
    e = tl.where((jj < M)[None, :, :], e, 0.0)
    c = e / tl.sum(e, 2)[:, :, None]
    v3 = valid[None, :, :]
    c = tl.where(v3, c + hc_eps, 0.0)
    c = tl.where(v3, c / (tl.sum(c, 1)[:, None, :] + hc_eps), 0.0)
    for _ in range(1, iters):
        c = tl.where(v3, c / (tl.sum(c, 2)[:, :, None] + hc_eps), 0.0)
        c = tl.where(v3, c / (tl.sum(c, 1)[:, None, :] + hc_eps), 0.0)
    tl.store(COMB + tok64[:, None, None] * (M * M) + (ii * M + jj)[None, :, :], c,
             mask=n_ok[:, None, None] & v3)


@triton.jit
def _collapse_norm_loop(x_base, xm, pre, U, NW, tok64, n_ok, stride_un, D, out_eps,
                        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """u = Σ_i pre[i]·X[i] rounded to the stream dtype, then RMSNorm (ReferenceOps.rms_norm's
    cast order), a row in BLOCK_D chunks: the collapse is stored chunk by chunk with its sum of
    squares, then read back (this program's own stores, from L2) and normalised in place."""
    xdt = U.dtype.element_ty
    offs_d = tl.arange(0, BLOCK_D)
    sq = tl.zeros([BLOCK_N], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        dd = d0 + offs_d
        d_ok = dd < D
        x = tl.load(x_base + dd[None, None, :], mask=xm & d_ok[None, None, :], other=0.0).to(tl.float32)
        u = tl.sum(x * pre[:, :, None], 1).to(xdt)
        tl.store(U + tok64[:, None] * stride_un + dd[None, :], u, mask=n_ok[:, None] & d_ok[None, :])
        uf = u.to(tl.float32)
        sq += tl.sum(uf * uf, 1)
    rn = tl.rsqrt(sq / D + out_eps)
    tl.debug_barrier()  # every thread's stores above seen by the threads that read them back
    for d0 in range(0, D, BLOCK_D):
        dd = d0 + offs_d
        d_ok = dd < D
        ok = n_ok[:, None] & d_ok[None, :]
        u = tl.load(U + tok64[:, None] * stride_un + dd[None, :], mask=ok, other=0.0).to(tl.float32)
        w = tl.load(NW + dd, mask=d_ok, other=0.0).to(xdt).to(tl.float32)
        tl.store(U + tok64[:, None] * stride_un + dd[None, :], (w[None, :] * (u * rn[:, None]).to(xdt).to(tl.float32)).to(xdt),
                 mask=ok)


# n_split unspecialised: it follows the token count, and a multiple of 16 compiled its own
# variant mid-traffic (a step of 2048 tokens)
@triton.jit(do_not_specialize=["n_split"])
def _mhc_pre_kernel(X, FN, BASE, SCALE, ZP, ZC, SS, POST, COMB, U, NW,
                    N, stride_xn, stride_fn, stride_un, M, D, n_split, iters, hc_eps, norm_eps, out_eps,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_PP: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT: tl.constexpr,
                    BLOCK_S: tl.constexpr, PRECISION: tl.constexpr, NORM: tl.constexpr = False,
                    NORM_LOOP: tl.constexpr = False, PDL: tl.constexpr = False):
    """Fused (SPLIT=False): grid (token blocks,), each program does the whole token block.
    Split epilogue (SPLIT=True): grid (token blocks, D tiles of BLOCK_D); every program sums the
    partials it needs for r and pre and collapses its own D tile; the D-tile-0 programs also do
    post and comb (the Sinkhorn), in parallel with the other tiles' collapse.
    Split with NORM: grid (tokens, 2): program 1 collapses the whole row (BLOCK_D >= D) and
    applies the layer's RMSNorm (weight NW, eps out_eps, ReferenceOps.rms_norm's cast order)
    before the store; program 0 does the Sinkhorn alone, concurrently. NORM_LOOP: program 1
    goes over the row in BLOCK_D chunks, storing the collapse, then normalises what it stored."""
    pdl_enter(PDL)
    nb = tl.program_id(0)
    tok = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = tok < N
    tok64 = tok.to(tl.int64)
    K = M * D
    BMM: tl.constexpr = BLOCK_M * BLOCK_M
    offs_pp = tl.arange(0, BLOCK_PP)
    offs_q = tl.arange(0, BMM)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_d = tl.arange(0, BLOCK_D)
    x_base = X + tok64[:, None, None] * stride_xn + offs_m[None, :, None] * D
    xm = n_ok[:, None, None] & m_ok[None, :, None]
    if SPLIT:
        db = tl.program_id(1)
        # this program's D tile of the streams, loaded first: independent of the partials, its
        # latency overlaps theirs (with NORM the one tile is the whole row)
        dd = offs_d if NORM else db * BLOCK_D + offs_d
        d_ok = dd < D
        if not NORM_LOOP:  # (the loop loads its chunks itself)
            ld_ok = d_ok
            if NORM:  # program 0 only does the Sinkhorn
                ld_ok = d_ok & (db == 1)
            x = tl.load(x_base + dd[None, None, :], mask=xm & ld_ok[None, None, :], other=0.0).to(tl.float32)
        # all partials in one load each and a tree sum: a loop over the splits costs a dependent
        # round trip per split (~0.25 µs each on the H200, 8 µs a call at 32 splits)
        offs_s = tl.arange(0, BLOCK_S)
        row = (offs_s[:, None] * N + tok[None, :]).to(tl.int64)                # [BS, BN]
        ok = (offs_s < n_split)[:, None] & n_ok[None, :]
        zp = tl.sum(tl.load(ZP + row[:, :, None] * BLOCK_PP + offs_pp[None, None, :], mask=ok[:, :, None],
                            other=0.0), 0)
        ss = tl.sum(tl.load(SS + row, mask=ok, other=0.0), 0)
        r = tl.rsqrt(ss / K + norm_eps)
        zp = zp * r[:, None]
        pre = _mhc_gate_pre(zp, BASE, SCALE, M, hc_eps, BLOCK_M, BLOCK_PP)
        if NORM_LOOP:
            if db == 1:
                _collapse_norm_loop(x_base, xm, pre, U, NW, tok64, n_ok, stride_un, D, out_eps, BLOCK_N, BLOCK_D)
        elif (not NORM) or db == 1:
            u = tl.sum(x * pre[:, :, None], 1)
            if NORM:  # u rounded to the stream dtype, then RMSNorm as ReferenceOps.rms_norm
                xdt = X.dtype.element_ty
                u = u.to(xdt).to(tl.float32)
                rn = tl.rsqrt(tl.sum(u * u, 1) / D + out_eps)
                w = tl.load(NW + dd, mask=d_ok, other=0.0).to(xdt).to(tl.float32)
                u = w[None, :] * (u * rn[:, None]).to(xdt).to(tl.float32)
            tl.store(U + tok64[:, None] * stride_un + dd[None, :], u.to(U.dtype.element_ty),
                     mask=n_ok[:, None] & d_ok[None, :])
        if db == 0:
            zc = tl.sum(tl.load(ZC + row[:, :, None] * BMM + offs_q[None, None, :], mask=ok[:, :, None],
                                other=0.0), 0)
            zc = zc * r[:, None]
            _mhc_post_comb(zp, zc, tok64, n_ok, BASE, SCALE, POST, COMB, M, iters, hc_eps,
                           BLOCK_N, BLOCK_M, BLOCK_PP)
    else:
        zp, zc, ss = _mhc_mix(X, FN, tok, n_ok, stride_xn, stride_fn, M, 0, K,
                              BLOCK_N, BLOCK_K, BLOCK_M, BLOCK_PP, PRECISION)
        r = tl.rsqrt(ss / K + norm_eps)
        zp = zp * r[:, None]
        zc = zc * r[:, None]
        pre = _mhc_gate_pre(zp, BASE, SCALE, M, hc_eps, BLOCK_M, BLOCK_PP)
        _mhc_post_comb(zp, zc, tok64, n_ok, BASE, SCALE, POST, COMB, M, iters, hc_eps,
                       BLOCK_N, BLOCK_M, BLOCK_PP)
        # collapse: u = Σ_i pre[i] X[i] in fp32, cast to the stream dtype
        for d0 in range(0, D, BLOCK_D):
            dd = d0 + offs_d
            d_ok = dd < D
            x = tl.load(x_base + dd[None, None, :], mask=xm & d_ok[None, None, :], other=0.0).to(tl.float32)
            u = tl.sum(x * pre[:, :, None], 1)
            tl.store(U + tok64[:, None] * stride_un + dd[None, :], u.to(U.dtype.element_ty),
                     mask=n_ok[:, None] & d_ok[None, :])


def _block_m(m: int) -> int:
    assert 1 <= m <= 8, f"mhc kernels support 1 <= M <= 8 streams, got {m}"
    return max(4, triton.next_power_of_2(m))


def _split_epilogue(x, fn, base, scale, partials, post, comb, u, sinkhorn_iters, hc_eps, norm_eps, norm):
    """mhc_pre's epilogue from the partials of the split mixing pass (_mhc_mix_kernel's): post,
    comb and the collapse u, through `norm` where given.

    It needs no tl.dot: one token per program, so that the partial sums, Sinkhorn and the
    collapse over D (M·D model-dtype values per token) spread over N programs instead of N/16
    (the H200 decode profile: at batch 64 four programs streamed the collapse, 44 µs a call). It
    also splits D: a 2-D grid of (tokens, D tiles) (see _SPLIT_TILE for the tile size)."""
    n, m, d = x.shape
    bm = _block_m(m)
    zp, zc, ss = partials
    n_split = zp.shape[0]
    norm_loop = norm is not None and n >= _LARGE_N and 0 < NORM_CHUNK < triton.next_power_of_2(d)
    fuse_norm = norm is not None and (norm_loop or bm * triton.next_power_of_2(d) <= _NORM_TILE)
    block_d = max(32, min(triton.next_power_of_2(d), _SPLIT_TILE // bm))
    grid = (n, triton.cdiv(d, block_d))
    if fuse_norm:
        block_d, grid = NORM_CHUNK if norm_loop else triton.next_power_of_2(d), (n, 2)
    nw, out_eps = (norm[0], float(norm[1])) if fuse_norm else (u, 0.0)
    _mhc_pre_kernel[grid](x, fn, base, scale, zp, zc, ss, post, comb, u, nw,
                          n, x.stride(0), fn.stride(0), u.stride(0), m, d, n_split,
                          int(sinkhorn_iters), float(hc_eps), float(norm_eps), out_eps,
                          BLOCK_N=1, BLOCK_K=64, BLOCK_M=bm, BLOCK_PP=_BLOCK_PP,
                          BLOCK_D=block_d, SPLIT=True, BLOCK_S=triton.next_power_of_2(n_split),
                          PRECISION="ieee", NORM=fuse_norm, NORM_LOOP=norm_loop, **pdl.launch(x.device),
                          num_warps=(_NORM_LOOP_WARPS if norm_loop else _NORM_WARPS) if fuse_norm else _SPLIT_WARPS)
    if norm is not None and not fuse_norm:  # in place: `out`'s collapse is the normed one either way
        from .norms import rms_norm
        rms_norm(u, norm[0], float(norm[1]), out=u)


def mhc_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
            sinkhorn_iters: int, hc_eps: float, norm_eps: float, *, split: int | None = None,
            out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
            block_n: int | None = None, block_k: int = 64, precision: str | None = None,
            num_warps: int | None = None, num_stages: int | None = None,
            norm: tuple[torch.Tensor, float] | None = None):
    """ReferenceOps.mhc_pre: streams [N, M, D] -> (post [N, M] f32, comb [N, M, M] f32,
    collapsed [N, D] streams.dtype). fn [(2+M)M, M*D], base [(2+M)M], scale [3], any float dtype
    (used in fp32). `split` = number of K splits (1 = one fused launch; None = by heuristic);
    `out` = (post, comb, collapsed) written in place; `precision` is tl.dot's input_precision
    for the fp32 products ("ieee" = exact fp32 FMAs; "tf32x3" is faster at ~fp32 accuracy; "bf16x3",
    bf16 streams only, splits fn in three bf16 parts: bf16 products at ~fp32 accuracy);
    num_warps / num_stages override the mixing launch's (bench.mhc_h200 sweeps them).
    `norm` = (weight, eps): the collapse comes back through that RMSNorm (the layer's input norm);
    inside the epilogue whenever K is split (a row of M·D values fits one program), else by
    norms.rms_norm after.
    By default decode sizes take 16-token blocks and DECODE_PRECISION. Prefill sizes (>= _LARGE_N
    tokens) take PREFILL_PRECISION; there the ieee FMA products made mhc_pre 16% of a 16K-token
    prefill on the H200 (39 ms, ~3 TFLOP/s). Their blocks: 128 tokens per mixing program with K
    split over the chip and in pieces of at most PREFILL_MIX_K.
    `bench.mhc_h200` on an H200 (M 4, D 4096): 16K tokens tf32x3 0.93 ms, bf16x3 0.64; 4K tokens
    (one launch: 64 programs) tf32x3 0.58, bf16x3 0.40, split bf16x3 at 128-token blocks 0.13."""
    n, m, d = streams.shape
    k = m * d
    assert fn.shape == ((2 + m) * m, k), (fn.shape, m, d)
    bm = _block_m(m)
    x = streams if streams.is_contiguous() else streams.contiguous()
    fn = fn if fn.is_contiguous() else fn.contiguous()
    base = base.contiguous()
    scale = scale.contiguous()
    dev = streams.device
    if out is None:
        post = torch.empty(n, m, dtype=torch.float32, device=dev)
        comb = torch.empty(n, m, m, dtype=torch.float32, device=dev)
        u = torch.empty(n, d, dtype=streams.dtype, device=dev)
    else:
        post, comb, u = out
        assert post.shape == (n, m) and post.dtype == torch.float32 and post.is_contiguous()
        assert comb.shape == (n, m, m) and comb.dtype == torch.float32 and comb.is_contiguous()
        assert u.shape == (n, d) and u.dtype == streams.dtype and u.stride(-1) == 1
    if n == 0:
        return post, comb, u
    prefill = n >= _LARGE_N
    split_prefill = prefill and block_n is None and split is None and (
        PREFILL_MIX_K > 0 or triton.cdiv(n, 128) * 2 < _NUM_SMS_GUESS)
    if split_prefill:
        block_n, num_warps = 128, num_warps or 8  # 128-token mixing blocks, K split (see PREFILL_MIX_K)
    nblocks = triton.cdiv(n, block_n or 16)
    if split is None:
        split = 1 if nblocks * 2 >= _NUM_SMS_GUESS else max(1, min(triton.cdiv(k, 2 * block_k),
                                                                    2 * _NUM_SMS_GUESS // nblocks, _MAX_SPLIT))
        if split_prefill and PREFILL_MIX_K > 0:
            split = min(max(split, triton.cdiv(k, PREFILL_MIX_K)), _MAX_SPLIT)
    large = split == 1 and prefill
    block_n = block_n or (64 if large else 16)
    precision = precision or (PREFILL_PRECISION if prefill else DECODE_PRECISION)
    if precision == "bf16x3" and streams.dtype != torch.bfloat16:
        precision = "tf32x3"  # the streams must be exact in bf16
    nblocks = triton.cdiv(n, block_n)
    # tf32x3 keeps three products' operands live: 64-wide K tiles (128 spilled 528 B on sm_90)
    mix_k = (_SPLIT_BLOCK_K if precision == "ieee" else _SPLIT_BLOCK_K // 2) if split > 1 else block_k
    k_per = triton.cdiv(triton.cdiv(k, max(1, split)), mix_k) * mix_k
    n_split = triton.cdiv(k, k_per)
    if n_split > 1:
        # fp32 partials, a row per (K split, token); no atomics: the epilogue sums them in split order
        zp = torch.empty(n_split, n, _BLOCK_PP, dtype=torch.float32, device=dev)
        zc = torch.empty(n_split, n, bm * bm, dtype=torch.float32, device=dev)
        ss = torch.empty(n_split, n, dtype=torch.float32, device=dev)
        _mhc_mix_kernel[(nblocks, n_split)](x, fn, zp, zc, ss, n, x.stride(0), fn.stride(0), m, k, k_per,
                                            BLOCK_N=block_n, BLOCK_K=mix_k, BLOCK_M=bm, BLOCK_PP=_BLOCK_PP,
                                            PRECISION=precision, **pdl.launch(x.device), num_warps=num_warps or 4,
                                            **({"num_stages": num_stages} if num_stages else {}))
        _split_epilogue(x, fn, base, scale, (zp, zc, ss), post, comb, u, sinkhorn_iters, hc_eps, norm_eps, norm)
        return post, comb, u
    _mhc_pre_kernel[(nblocks,)](x, fn, base, scale, post, post, post, post, comb, u, u,
                                n, x.stride(0), fn.stride(0), u.stride(0), m, d, 1,
                                int(sinkhorn_iters), float(hc_eps), float(norm_eps), 0.0,
                                BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_M=bm, BLOCK_PP=_BLOCK_PP,
                                BLOCK_D=min(triton.next_power_of_2(d), max(32, 4096 // (block_n * bm))),
                                SPLIT=False, BLOCK_S=1, PRECISION=precision, **pdl.launch(x.device),
                                num_warps=num_warps or 4, **({"num_stages": num_stages} if num_stages else {}))
    if norm is not None:  # in place: `out`'s collapse is the normed one either way
        from .norms import rms_norm
        u = rms_norm(u, norm[0], float(norm[1]), out=u)
    return post, comb, u
