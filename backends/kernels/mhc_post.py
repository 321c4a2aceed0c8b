"""mHC post (docs/MODEL.md §2.2) as a Triton kernel: the combine of a sublayer's output into the
streams (mhc.py has the pre block).

mhc_post: X'[j] = post[j]·y + Σ_i C[i, j]·X[i] with post and C rounded to the model dtype
first and both terms rounded to the model dtype before their sum (HF / ReferenceOps order;
the i-sum runs in fp32, one rounding, like torch's bf16 matmul).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .mhc import _block_m
from .pdl import pdl_enter
from .interpreter import patch_interpreter

patch_interpreter()


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
