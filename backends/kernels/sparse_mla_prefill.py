"""Sparse absorbed-MLA prefill and mixed batches (docs/MODEL.md §3.3): every query token is a
row of the decode kernel (sparse_mla.py), with its own position, its own selected pools and its
request's page-table row, or on a Hopper GPU the kernel of sparse_mla_sm90.py where it fits.
`sparse_mla.sparse_mla` hands these batches here; the module switches below are what the tests
and `bench.prefill_model` set.
"""

from __future__ import annotations

import torch

from ..meta import BatchMeta
from ..reference import ReferenceOps
from .sparse_mla import _num_sms, choose_num_splits, sparse_mla_decode, sparse_mla_rows_sel
from .sparse_mla_rows import build_prefill_token_idx

PREFILL_CHUNK_ROWS = 2048  # query tokens per absorbed-prefill launch (bounds the [rows, H, R] temporaries)
# How a prefill row finds its latent rows: "precomputed" builds packed flat row lists first
# (build_prefill_token_idx, 4 bytes per row; 3 ms for 16K tokens when torch ops built them, one
# launch since) and the kernel reads those;
# "kernel" derives them inside the attention kernel from the pool ids and the page table. On
# the H200 at 16K tokens the in-kernel derivation spilled registers (255 regs, 20 spills) and
# took 84.5 ms against 23.0 ms on the lists (234 regs, no spills); bench/RESULTS.md.
PREFILL_TOKEN_LIST = "precomputed"
# Prefill rows (one per query token, ~1900 latent rows each at 16K tokens) stream 64 rows per
# step with a 16-bit cache: `bench.prefill_h200 --mla-sweep` on an H200 (1 x 16K tokens, 64
# heads x 512): 16.97 ms (244 TFLOP/s, 255 regs, no spills) against 22.97 at decode's 32.
# A lazy rescale (keep the running max until a block's exceeds it by 8) spilled there and lost:
# 18.24 ms at 64, 23.51 at 32; removed.
PREFILL_CONFIG = dict(BLOCK_N=64)
# Which kernel attends the prefill rows on a Hopper GPU where sparse_mla_sm90 fits (bf16, 64 heads
# x 512, enough rows to fill the chip without K splits): "sm90" (two warpgroups splitting the
# tiles, sparse_mla_sm90.py) or "triton" (sparse_mla.py's kernel, whose score tile both
# warpgroups compute whole).
PREFILL_KERNEL = "sm90"


def sparse_mla_prefill(q: torch.Tensor, cache: torch.Tensor, w_kc: torch.Tensor, w_vc: torch.Tensor,
                       sel: torch.Tensor | None, meta: BatchMeta, kpool: int, scale: float, with_tail: bool = True,
                       *, reference: ReferenceOps | None = None, chunk_rows: int | None = None) -> torch.Tensor:
    """ReferenceOps.sparse_mla for a batch that is not all decode: the kernels with a selection,
    the reference without one (dense causal prefill) or with no tokens."""
    fp32_math = torch.float32 in (q.dtype, cache.dtype)
    if sel is None or meta.num_tokens == 0 or (fp32_math and cache.is_cuda and PREFILL_TOKEN_LIST == "kernel"):
        # dense causal prefill stays on the reference, and so does fp32 with the in-kernel token
        # list on the GPU (Triton 3.6 fails to compile it for an fp32 cache on sm90: a
        # layout-conversion pass error); fp32 rows on a built list take the kernel (ieee
        # products), which a speculative verify inside a CUDA graph needs: the reference builds
        # its row indices on the host
        return (reference or ReferenceOps()).sparse_mla(q, cache, w_kc, w_vc, sel, meta, kpool, scale, with_tail)
    return _rows(q, cache, w_kc, w_vc, sel, meta, kpool, scale, with_tail, chunk_rows or PREFILL_CHUNK_ROWS)


def _takes_hopper_kernel(hopper, q_abs, cache, token_idx) -> bool:
    """The Hopper kernel takes these rows when it fits them (sparse_mla_sm90.supported) and they
    fill the chip without K splits, which it has not: rows too few for that (a speculative
    verify's K + 1 per request at small batches, a short mixed step) keep the Triton kernel's
    split launch."""
    return (cache.is_contiguous() and hopper.supported(q_abs, cache.view(-1, cache.shape[-1]))
            and choose_num_splits(q_abs.shape[0], 1, token_idx.shape[1], hopper.BLOCK_N, _num_sms(q_abs.device)) == 1)


def _rows(q, cache, w_kc, w_vc, sel, meta, kpool, scale, with_tail, chunk_rows):
    """Prefill / mixed batch, absorbed MQA form per query token: q̃ = q·W_kc, the decode kernel
    with one row per token (own position, own selection, page-table row via req_index), then
    õ·W_vcᵀ; tokens in chunks of `chunk_rows` to bound the [rows, H, R] temporaries.

    FLOPs: the absorbed form costs 4·H·R per (query, selected token) against 2·H·(dn + dv)
    when K/V are expanded per request (the reference's prefill form), i.e. ~2x more at the
    flash shapes (2R = 1024 vs dn + dv = 512), but it reads each selected latent row once for all heads
    and needs no per-request [T, H, dn + dv] expansion; with a sparse selection (topk pools,
    not the whole prefix) it is the form SGLang / DeepSeek's sparse (DSA) prefill uses too.
    """
    n, h, _ = q.shape
    dt = q.dtype
    if PREFILL_KERNEL not in ("sm90", "triton"):
        raise ValueError(f"sparse_mla_prefill.PREFILL_KERNEL must be 'sm90' or 'triton', got {PREFILL_KERNEL!r}")
    hopper = None
    if PREFILL_KERNEL == "sm90" and q.is_cuda and torch.version.hip is None and dt == torch.bfloat16:
        from . import sparse_mla_sm90 as hopper  # Gluon's NVIDIA modules, only where they can run
    wk = w_kc.to(dt)
    wvt = w_vc.to(dt).transpose(1, 2)  # [H, R, dv]
    out = torch.empty(n, h, w_vc.shape[1], dtype=dt, device=q.device)
    table = meta.page_table if meta.page_table.stride(-1) == 1 else meta.page_table.contiguous()
    for c0 in range(0, n, chunk_rows):
        c1 = min(c0 + chunk_rows, n)
        q_abs = torch.bmm(q[c0:c1].transpose(0, 1), wk).transpose(0, 1)  # [rows, H, R]
        pos, req = meta.positions[c0:c1], meta.req_index[c0:c1]
        if PREFILL_TOKEN_LIST == "precomputed":
            token_idx, ntok = build_prefill_token_idx(sel[c0:c1], pos, req, table, meta.page_size, kpool, with_tail)
            if hopper is not None and _takes_hopper_kernel(hopper, q_abs, cache, token_idx):
                o_lat = hopper.sparse_mla_rows_sm90(q_abs, cache.view(-1, cache.shape[-1]), token_idx, ntok, scale,
                                                    torch.empty_like(q_abs))
            else:
                cfg = PREFILL_CONFIG if cache.dtype in (torch.bfloat16, torch.float16) else None
                o_lat = sparse_mla_decode(q_abs, cache, token_idx, scale, ntok, out_dtype=dt, config=cfg)
        else:
            o_lat = sparse_mla_rows_sel(q_abs, cache, sel[c0:c1], pos, req, table, meta.page_size, kpool, scale,
                                        with_tail, out_dtype=dt)
        # the product lands in out's rows directly ([H, rows, dv] view of them: the GEMM writes with
        # ldc = H·dv and a batch stride of dv), not in a head-major temporary copied over with a
        # transposing elementwise copy (2 x 64 MiB per 2048-row chunk at the flash shapes)
        torch.bmm(o_lat.transpose(0, 1), wvt, out=out[c0:c1].transpose(0, 1))
    return out
