"""mHC post (docs/MODEL.md §2.2) as Triton kernels: the combine of a sublayer's output into the
streams, alone (mhc_post) or with the next sublayer's mhc_pre (mhc_post_pre).

mhc_post: X'[j] = post[j]·y + Σ_i C[i, j]·X[i] with post and C rounded to the model dtype
first and both terms rounded to the model dtype before their sum (HF / ReferenceOps order;
the i-sum runs in fp32, one rounding, like torch's bf16 matmul).

mhc_post_pre (prefill sizes, one boundary between sublayers): the post combine for a block of
tokens over a range of D columns of every stream, and in the same program the next mhc_pre's
mixing partials of the values it just wrote; mhc.py's split epilogue then finishes that
mhc_pre. A standalone mix would read the new streams back from HBM (0.54 GB at 16K tokens, M 4,
D 4096).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import mhc as pre
from . import pdl
from .mhc import _BLOCK_PP, _block_m, _dot_bf16x3, _partials, _split_epilogue
from .pdl import pdl_enter
from .interpreter import patch_interpreter

patch_interpreter()

# CudaH200Ops.mhc_post_pre takes the one-pass path from mhc._LARGE_N tokens (False: mhc_post +
# mhc_pre). Its tiles: tokens per program and the D columns of every stream it combines per step
# (a [BLOCK_N, M, BLOCK_D] tile, mixed as M x BLOCK_D flat columns).
POST_MIX = False
POST_MIX_BLOCK_N = 64
POST_MIX_BLOCK_D = 64


@triton.jit
def _mhc_post_kernel(Y, X, POST, COMB, OUT, IDS, stride_yn, stride_xn, stride_on, M, D, E,
                     BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, TOP_K: tl.constexpr = 0,
                     PDL: tl.constexpr = False):
    """TOP_K > 0: y is an MoE's unsummed pair rows Y [N·TOP_K, D] (pairs with ids outside [0, E)
    count as zero): summed here in fp32 and rounded once, as the fused MoE's _sum_kernel does
    (fused_moe_kernels.py)."""
    pdl_enter(PDL)
    n = tl.program_id(0).to(tl.int64)
    db = tl.program_id(1)
    dt = OUT.dtype.element_ty
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_d = db * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    x = tl.load(X + n * stride_xn + offs_m[:, None] * D + offs_d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)       # [BM(i), BD]
    if TOP_K > 0:
        y = tl.zeros([BLOCK_D], dtype=tl.float32)
        for k in range(0, TOP_K):
            e = tl.load(IDS + n * TOP_K + k)
            routed = (e >= 0) & (e < E)
            y += tl.load(Y + (n * TOP_K + k) * stride_yn + offs_d, mask=d_ok & routed, other=0.0).to(tl.float32)
        y = y.to(dt).to(tl.float32)
    else:
        y = tl.load(Y + n * stride_yn + offs_d, mask=d_ok, other=0.0).to(dt).to(tl.float32)
    post = tl.load(POST + n * M + offs_m, mask=m_ok, other=0.0).to(dt).to(tl.float32)
    cm = m_ok[:, None] & m_ok[None, :]
    comb = tl.load(COMB + n * M * M + offs_m[:, None] * M + offs_m[None, :], mask=cm,
                   other=0.0).to(dt).to(tl.float32)                                  # [BM(i), BM(j)]
    a = (post[:, None] * y[None, :]).to(dt).to(tl.float32)                           # [BM(j), BD]
    b = tl.sum(comb[:, :, None] * x[:, None, :], 0).to(dt).to(tl.float32)           # [BM(j), BD]
    tl.store(OUT + n * stride_on + offs_m[:, None] * D + offs_d[None, :], (a + b).to(dt),
             mask=m_ok[:, None] & d_ok[None, :])


def mhc_post(y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, *,
             out: torch.Tensor | None = None, block_d: int | None = None, ids: torch.Tensor | None = None,
             num_experts: int = 0) -> torch.Tensor:
    """ReferenceOps.mhc_post: y [N, D], streams [N, M, D], post [N, M], comb [N, M, M] ->
    [N, M, D] in streams.dtype. `out` may alias nothing it reads except `streams` itself
    (each program reads its tile of streams before writing the same tile). With `ids` [N, k], y
    is an MoE's unsummed rows [N, k, D] (MoEPartials: ids outside [0, num_experts) count as 0)."""
    n, m, d = streams.shape
    top_k = 0 if ids is None else ids.shape[1]
    assert y.shape == ((n, top_k, d) if top_k else (n, d)) and post.shape == (n, m) and comb.shape == (n, m, m)
    bm = _block_m(m)
    x = streams if streams.is_contiguous() else streams.contiguous()
    y = y.reshape(n * top_k, d) if top_k else y
    y = y if y.stride(-1) == 1 else y.contiguous()
    ids = (ids if ids.is_contiguous() else ids.contiguous()) if top_k else post  # unused when TOP_K = 0
    post = post.contiguous()
    comb = comb.contiguous()
    if out is None:
        out = torch.empty(n, m, d, dtype=streams.dtype, device=streams.device)
    assert out.shape == (n, m, d) and out.dtype == streams.dtype and out.is_contiguous()
    if n == 0:
        return out
    bd = block_d or min(triton.next_power_of_2(d), 4096 // bm)
    _mhc_post_kernel[(n, triton.cdiv(d, bd))](y, x, post, comb, out, ids, y.stride(0), x.stride(0), out.stride(0),
                                              m, d, num_experts, BLOCK_M=bm, BLOCK_D=bd, TOP_K=top_k,
                                              **pdl.launch(x.device), num_warps=4)
    return out


@triton.jit
def _x_tile(X, tok64, stride_xn, dd, nd_ok, D, M, i: tl.constexpr):
    """Stream i's [BLOCK_N, BLOCK_D] tile in fp32 (zeros past M)."""
    return tl.load(X + tok64[:, None] * stride_xn + i * D + dd[None, :], mask=nd_ok & (i < M),
                   other=0.0).to(tl.float32)


@triton.jit
def _comb_w(COMB, tok64, n_ok, M, i: tl.constexpr, j: tl.constexpr, dt: tl.constexpr):
    """C[i, j] of every token as a [BLOCK_N, 1] column, rounded to the model dtype (0 past M)."""
    return tl.load(COMB + tok64 * (M * M) + i * M + j, mask=n_ok & (i < M), other=0.0).to(dt).to(tl.float32)[:, None]


@triton.jit
def _mhc_post_mix_kernel(Y, X, POST, COMB, OUT, IDS, FN, ZP, ZC, SS,
                         N, D, M, E, d_per, stride_yn, stride_xn, stride_on, stride_fn,
                         BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_PP: tl.constexpr, BLOCK_Z: tl.constexpr, TOP_K: tl.constexpr,
                         PRECISION: tl.constexpr, PDL: tl.constexpr = False):
    """_mhc_post_kernel's combine for BLOCK_N tokens over the D columns [s·d_per, (s+1)·d_per) of
    every stream (s = program_id(1)), then _mhc_mix's partials of the streams it just wrote over
    those flat columns (m·D + d): the next mhc_pre's mixing pass without reading them back.
    Partials of split s at rows s·N + token, as _mhc_mix_kernel writes them.

    Every tile is 2-D [BLOCK_N, BLOCK_D], one output stream j at a time from the M input tiles
    (loaded once per step at BLOCK_M 4; past 4 streams again from L1 for each j), so no tile
    changes layout except into the products. The products
    take the pre|post and comb rows of fn as one operand of BLOCK_Z rows (z column c: fn row c
    for c < BLOCK_PP, comb entry c - BLOCK_PP after), so one bf16x3 product per stream and step."""
    pdl_enter(PDL)
    tok = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    s = tl.program_id(1)
    n_ok = tok < N
    tok64 = tok.to(tl.int64)
    dt = OUT.dtype.element_ty
    BMM: tl.constexpr = BLOCK_M * BLOCK_M
    # the z columns' fn rows: pre|post rows, then comb rows 2M + i·M + j (q = i·BLOCK_M + j)
    offs_z = tl.arange(0, BLOCK_Z)
    q = offs_z - BLOCK_PP
    qi = q // BLOCK_M
    qj = q % BLOCK_M
    is_pp = offs_z < BLOCK_PP
    z_ok = tl.where(is_pp, offs_z < 2 * M, (q < BMM) & (qi < M) & (qj < M))
    z_row = tl.where(is_pp, offs_z, 2 * M + qi * M + qj)
    z_row = tl.where(z_ok, z_row, 0)
    z = tl.zeros([BLOCK_N, BLOCK_Z], dtype=tl.float32)
    ss = tl.zeros([BLOCK_N], dtype=tl.float32)
    d_lo = s * d_per
    d_hi = tl.minimum(d_lo + d_per, D)
    for d0 in range(d_lo, d_hi, BLOCK_D):
        dd = d0 + tl.arange(0, BLOCK_D)
        d_ok = dd < d_hi
        nd_ok = n_ok[:, None] & d_ok[None, :]
        if TOP_K > 0:  # the MoE's unsummed pair rows, summed in fp32 and rounded once
            y = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
            for k in range(0, TOP_K):
                pair = tok64 * TOP_K + k
                e = tl.load(IDS + pair, mask=n_ok, other=-1)
                routed = (e >= 0) & (e < E)
                y += tl.load(Y + pair[:, None] * stride_yn + dd[None, :], mask=nd_ok & routed[:, None],
                             other=0.0).to(tl.float32)
            y = y.to(dt).to(tl.float32)
        else:
            y = tl.load(Y + tok64[:, None] * stride_yn + dd[None, :], mask=nd_ok, other=0.0).to(dt).to(tl.float32)
        if BLOCK_M == 4:  # the streams' tiles loaded once per step (the model's M 4, and 1-3 padded)
            x0 = _x_tile(X, tok64, stride_xn, dd, nd_ok, D, M, 0)
            x1 = _x_tile(X, tok64, stride_xn, dd, nd_ok, D, M, 1)
            x2 = _x_tile(X, tok64, stride_xn, dd, nd_ok, D, M, 2)
            x3 = _x_tile(X, tok64, stride_xn, dd, nd_ok, D, M, 3)
        for j in tl.static_range(BLOCK_M):
            if j < M:
                if BLOCK_M == 4:
                    b = _comb_w(COMB, tok64, n_ok, M, 0, j, dt) * x0
                    b += _comb_w(COMB, tok64, n_ok, M, 1, j, dt) * x1
                    b += _comb_w(COMB, tok64, n_ok, M, 2, j, dt) * x2
                    b += _comb_w(COMB, tok64, n_ok, M, 3, j, dt) * x3
                else:  # up to 8 streams: each one's tile again from L1 for every j
                    b = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
                    for i in tl.static_range(BLOCK_M):
                        b += _comb_w(COMB, tok64, n_ok, M, i, j, dt) * _x_tile(X, tok64, stride_xn, dd, nd_ok, D, M, i)
                pj = tl.load(POST + tok64 * M + j, mask=n_ok, other=0.0).to(dt).to(tl.float32)
                a = (pj[:, None] * y).to(dt).to(tl.float32)
                xj = (a + b.to(dt).to(tl.float32)).to(dt)                                     # [BN, BD]
                tl.store(OUT + tok64[:, None] * stride_on + j * D + dd[None, :], xj, mask=nd_ok)
                # the mixing products over flat columns j·D + d (masked columns are 0)
                f = tl.load(FN + z_row[:, None] * stride_fn + j * D + dd[None, :], mask=z_ok[:, None] & d_ok[None, :],
                            other=0.0).to(tl.float32)                                         # [BZ, BD]
                x = xj.to(tl.float32)
                ss += tl.sum(x * x, 1)
                if PRECISION == "bf16x3":
                    z = _dot_bf16x3(xj, f, z)
                else:
                    z += tl.dot(x, tl.trans(f), input_precision=PRECISION)
    row = (s * N + tok).to(tl.int64)
    tl.store(ZP + row[:, None] * BLOCK_PP + offs_z[None, :], z, mask=n_ok[:, None] & is_pp[None, :])
    tl.store(ZC + row[:, None] * BMM + tl.where(is_pp, 0, q)[None, :], z,
             mask=n_ok[:, None] & (~is_pp & (q < BMM))[None, :])
    tl.store(SS + row, ss, mask=n_ok)


def mhc_post_pre(y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                 fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, sinkhorn_iters: int, hc_eps: float,
                 norm_eps: float, *, norm: tuple[torch.Tensor, float] | None = None,
                 ids: torch.Tensor | None = None, num_experts: int = 0, split: int | None = None,
                 block_n: int | None = None, block_d: int | None = None, precision: str | None = None,
                 num_warps: int = 4):
    """ReferenceOps.mhc_post_pre: mhc_post, then the next sublayer's mhc_pre on its streams ->
    (streams', post', comb', collapsed'). One launch combines the streams and mixes what it wrote
    (_mhc_post_mix_kernel), the split epilogue finishes: the new streams are read once (by the
    epilogue's collapse) instead of twice. `ids`/`num_experts`: y is an MoE's unsummed rows, as
    in mhc_post. `split` D ranges per token block (default: pieces of at most mhc.PREFILL_MIX_K flat
    columns, as mhc_pre's prefill mix)."""
    n, m, d = streams.shape
    top_k = 0 if ids is None else ids.shape[1]
    assert y.shape == ((n, top_k, d) if top_k else (n, d)) and post.shape == (n, m) and comb.shape == (n, m, m)
    assert fn.shape == ((2 + m) * m, m * d), (fn.shape, m, d)
    bm = _block_m(m)
    dev = streams.device
    x = streams if streams.is_contiguous() else streams.contiguous()
    y = y.reshape(n * top_k, d) if top_k else y
    y = y if y.stride(-1) == 1 else y.contiguous()
    ids = (ids if ids.is_contiguous() else ids.contiguous()) if top_k else post  # unused when TOP_K = 0
    fn = fn if fn.is_contiguous() else fn.contiguous()
    new = torch.empty(n, m, d, dtype=streams.dtype, device=dev)
    post2 = torch.empty(n, m, dtype=torch.float32, device=dev)
    comb2 = torch.empty(n, m, m, dtype=torch.float32, device=dev)
    u = torch.empty(n, d, dtype=streams.dtype, device=dev)
    if n == 0:
        return new, post2, comb2, u
    block_n, block_d = block_n or POST_MIX_BLOCK_N, block_d or POST_MIX_BLOCK_D
    precision = precision or pre.PREFILL_PRECISION
    if precision == "bf16x3" and streams.dtype != torch.bfloat16:
        precision = "tf32x3"  # the streams must be exact in bf16
    split = split or max(1, triton.cdiv(m * d, pre.PREFILL_MIX_K or m * d))
    d_per = triton.cdiv(triton.cdiv(d, split), block_d) * block_d
    n_split = triton.cdiv(d, d_per)
    partials = _partials(n_split, n, bm, dev)
    _mhc_post_mix_kernel[(triton.cdiv(n, block_n), n_split)](
        y, x, post.contiguous(), comb.contiguous(), new, ids, fn, *partials,
        n, d, m, num_experts, d_per, y.stride(0), x.stride(0), new.stride(0), fn.stride(0),
        BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_M=bm, BLOCK_PP=_BLOCK_PP,
        BLOCK_Z=triton.next_power_of_2(_BLOCK_PP + bm * bm), TOP_K=top_k, PRECISION=precision,
        **pdl.launch(dev), num_warps=num_warps)
    _split_epilogue(new, fn, base.contiguous(), scale.contiguous(), partials, post2, comb2, u,
                    sinkhorn_iters, hc_eps, norm_eps, norm)
    return new, post2, comb2, u
