"""Sparse absorbed-MLA decode (docs/MODEL.md §3.1, §3.3) as a Triton kernel.

Decode is one query per request. In the absorbed form every head scores the same cached
latent rows, `score_h,s = q̃_h · c_s * scale` and `õ_h = Σ_s p_h,s c_s`, so one program
takes ALL heads of a request (BLOCK_H = 64 at full size) and streams the request's selected
latent rows through them: each row is read from memory once per request, and both products
(`Q·Cᵀ` and `P·C`) are tensor-core matrix products with M = heads. Online softmax in fp32
over blocks of BLOCK_N selected tokens (exp2 with the scale folded in).

Small batches do not fill the chip with one program per request, so the token list is split
into NUM_SPLITS contiguous chunks (flash-decoding): each split writes its normalised partial
output and log-sum-exp, and a second small kernel merges them. With one split the first
kernel writes the final output directly. The split count follows the static list width K; with
num_tokens, each request's own count is what its splits share.

Prefill and mixed batches use the same kernel with one row per query TOKEN (its own
position, its own selected pools; HAS_REQ reads the page-table row of the token's request):
see `sparse_mla_rows_sel` and sparse_mla_prefill.py. On a Hopper GPU, rows enough to fill the
chip at 64 heads x 512 with bf16 latents take `sparse_mla_sm90.py` instead.

Inputs of the kernel:
  q_abs      [B, H, R]   query already multiplied by W_kc (R = kv_lora_rank)
  latent     [num_pages, page_size, R] (or any [..., R] contiguous view) bf16/fp16/fp32
  token_idx  [B, K] int32 flat token indices (page * page_size + offset), -1 = padding
  num_tokens [B] int32 (optional): only token_idx[b, :num_tokens[b]] is looked at; the
             builders in sparse_mla_rows.py pack the valid tokens first so padding costs nothing.

Precision: with a bf16/fp16 cache, q is rounded to the cache dtype and both products run on
the tensor cores with fp32 accumulation (P is rounded to the cache dtype for P·C, as every
flash kernel does); with an fp32 cache both products are plain fp32 (`ieee`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import kv_fp8
from ..meta import BatchMeta
from ..reference import ReferenceOps
from ..side_work import INLINE
from . import pdl
from .pdl import pdl_enter
from .interpreter import patch_interpreter
from .sparse_mla_rows import build_decode_rows, build_decode_token_idx, build_prefill_token_idx, is_decode_batch

patch_interpreter()

_LOG2E = 1.4426950408889634
_LAST_COMPILED: dict = {}  # the attention kernel's last compiled variant (benches read n_regs / n_spills)


# ---------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------
@triton.jit
def _sparse_mla_decode_kernel(
    Q, KV, IDX, NTOK, O, OPART, LSE, SEL, POS, TABLE, SC, REQ,
    stride_qb, stride_qh,
    stride_kv,
    stride_ib,
    stride_ob, stride_oh,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_sb, stride_tb, stride_sc, sc_off,
    H, R, K, chunk,
    qk_scale,
    NSEL, page_size,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    SPLIT: tl.constexpr, HAS_NTOK: tl.constexpr, PRECISION: tl.constexpr,
    FROM_SEL: tl.constexpr, KPOOL: tl.constexpr, WITH_TAIL: tl.constexpr, BLOCK_SEL: tl.constexpr,
    KV_FP8: tl.constexpr, HAS_REQ: tl.constexpr, SPLIT_BY_COUNT: tl.constexpr = False, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    b = tl.program_id(0)
    hb = tl.program_id(1)
    sp = tl.program_id(2)

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = tl.arange(0, BLOCK_N)
    h_ok = offs_h < H
    r_ok = offs_r < R

    q = tl.load(Q + b.to(tl.int64) * stride_qb + offs_h[:, None] * stride_qh + offs_r[None, :],
                mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    if not KV_FP8:  # fp8 rows are widened to q's dtype after the load
        q = q.to(KV.dtype.element_ty)

    n_b = K
    per = chunk
    if HAS_NTOK:
        n_b = tl.minimum(tl.load(NTOK + b), K)
        if SPLIT_BY_COUNT:  # this request's own rows over the splits (SPLIT_BY_COUNT below)
            per = tl.cdiv(tl.cdiv(n_b, tl.num_programs(2)), BLOCK_N) * BLOCK_N
    start = sp * per
    end = tl.minimum(start + per, n_b)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    idx_row = IDX + b.to(tl.int64) * stride_ib
    if FROM_SEL:  # the token list is derived here from the selected pools (no glue kernels)
        pos = tl.load(POS + b)
        complete = (pos + 1) // KPOOL  # pools whose last token is <= pos
        sel_row = SEL + b.to(tl.int64) * stride_sb
        offs_sel = tl.arange(0, BLOCK_SEL)
        sel_all = tl.load(sel_row + offs_sel, mask=offs_sel < NSEL, other=-1)
        if HAS_REQ:  # per-token rows (prefill): the page-table row of the row's request
            table_row = TABLE + tl.load(REQ + b).to(tl.int64) * stride_tb
        else:
            table_row = TABLE + b.to(tl.int64) * stride_tb
    for n0 in range(start, end, BLOCK_N):
        offs = n0 + offs_n
        if FROM_SEL:
            in_pools = offs < NSEL * KPOOL
            j = offs // KPOOL
            pool = tl.load(sel_row + j, mask=in_pools & (offs < end), other=-1)
            # a set, as in the reference: a pool repeated in the row counts once (first entry)
            dup = tl.max(((sel_all[None, :] == pool[:, None]) & (offs_sel[None, :] < j[:, None])).to(tl.int32), 1)
            tok_pool = pool * KPOOL + offs % KPOOL
            ok = in_pools & (pool >= 0) & (pool < complete) & (dup == 0)
            if WITH_TAIL:
                tok_tail = complete * KPOOL + (offs - NSEL * KPOOL)
                ok_tail = (~in_pools) & (tok_tail <= pos)
                tok = tl.where(in_pools, tok_pool, tok_tail)
                ok = ok | ok_tail
            else:
                tok = tok_pool
            ok = ok & (offs < end)
            tok = tl.where(ok, tok, 0)
            page = tl.load(table_row + tok // page_size, mask=ok, other=-1)
            idx = tl.where(ok & (page >= 0), page.to(tl.int64) * page_size + tok % page_size, -1)
        else:
            idx = tl.load(idx_row + offs, mask=offs < end, other=-1)
        valid = idx >= 0
        # max, not where(valid, idx, 0): the same rows, and Triton 3.6's layout pass fails on that
        # select in the FROM_SEL loop for some tiles (fp32 at BLOCK_N 16: compile_check)
        rows = tl.maximum(idx, 0).to(tl.int64)
        kv = tl.load(KV + rows[:, None] * stride_kv + offs_r[None, :],
                     mask=valid[:, None] & r_ok[None, :], other=0.0)
        if KV_FP8:  # e4m3 bytes x the fp32 scale of their 128-value group (backends/kv_fp8.py)
            sc = tl.load(SC + rows[:, None] * stride_sc + sc_off + offs_r[None, :] // 128,
                         mask=valid[:, None] & r_ok[None, :], other=0.0)
            kv = (kv.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc).to(q.dtype)
        s = tl.dot(q, tl.trans(kv), input_precision=PRECISION) * qk_scale  # [BLOCK_H, BLOCK_N], log2 units
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no token yet
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(kv.dtype), kv, acc, input_precision=PRECISION)  # accumulate in place
        m_i = m_new

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    hr_ok = h_ok[:, None] & r_ok[None, :]
    if SPLIT:
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        tl.store(OPART + b.to(tl.int64) * stride_pb + offs_h[:, None] * stride_ph + sp * stride_ps + offs_r[None, :],
                 out, mask=hr_ok)
        tl.store(LSE + b * stride_lb + offs_h * stride_lh + sp, lse, mask=h_ok)
    else:
        tl.store(O + b.to(tl.int64) * stride_ob + offs_h[:, None] * stride_oh + offs_r[None, :],
                 out.to(O.dtype.element_ty), mask=hr_ok)


# NUM_SPLITS a plain argument, unspecialised: the split count follows the batch, and an eager
# mixed step's decode rows (any count) compiled a variant per count mid-traffic.
# Grid (B, H, R tiles): each program loads its [splits, BLOCK_R] partials as one tile; a loop
# over the splits issued one dependent load after another (at batch 1, 32 splits: ~20 µs).
@triton.jit(do_not_specialize=["NUM_SPLITS"])
def _merge_splits_kernel(
    OPART, LSE, O,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    R, NUM_SPLITS,
    BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    s_ok = offs_s < NUM_SPLITS
    r_ok = offs_r < R
    lse = tl.load(LSE + b * stride_lb + h * stride_lh + offs_s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # 0 for empty splits and the padding
    denom = tl.sum(w, 0)
    part = OPART + b.to(tl.int64) * stride_pb + h * stride_ph
    p = tl.load(part + offs_s[:, None] * stride_ps + offs_r[None, :], mask=s_ok[:, None] & r_ok[None, :], other=0.0)
    out = tl.sum(w[:, None] * p, 0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(O + b.to(tl.int64) * stride_ob + h * stride_oh + offs_r, out.to(O.dtype.element_ty), mask=r_ok)


# ---------------------------------------------------------------------------------------
# launch helpers
# ---------------------------------------------------------------------------------------
_SM_COUNT: dict[int, int] = {}
_MERGE_BLOCK_R = 128  # latent columns per merge program (32 splits x 128 fp32: 32 registers a thread)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter: a few splits, so the merge path is exercised too
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


# Up to this many requests a decode launch takes 16 heads per program: at batch 1 the four head
# blocks x splits fill the chip with programs that each hold a quarter of the accumulator.
# `bench.decode_ops --only mla` on the H200 (batch 1, 64 heads x 512, bf16 latent, row list +
# attention + merge in a PDL graph chain): 20.7 µs at 16 heads x 32 rows, 4 warps, against
# 26.3-26.5 µs for all 64 heads in one program (contexts 1024 and 4096).
FEW_ROWS_BATCH = 2
# With num_tokens, how a request's rows are shared by its splits: True, its own count in equal
# chunks; False, chunks of the static list width K (a context shorter than the selection, K =
# 2063 rows at full size, then left its rows in the first splits and the rest empty: at batch 1
# and 1024 tokens, 11 of 29 splits held them, 3 blocks each). bench.decode_profile --mla-split.
SPLIT_BY_COUNT = True


def default_config(h: int, r: int, cache_dtype: torch.dtype, batch: int | None = None) -> dict:
    """Block shapes per problem; the bench sweeps alternatives (bench/kernels_h200.py,
    bench/decode_ops.py). `batch` (requests of the launch) picks the few-row shape."""
    block_r = max(16, triton.next_power_of_2(r))
    block_h = min(64, max(16, triton.next_power_of_2(h)))
    if cache_dtype == torch.float32:
        # fp32 is the parity/test path (FMA dots): keep the tiles small.
        return dict(BLOCK_H=min(block_h, 32), BLOCK_N=16, num_warps=4 if block_r <= 128 else 8, num_stages=1)
    if batch is not None and batch <= FEW_ROWS_BATCH:
        return dict(BLOCK_H=16, BLOCK_N=32, num_warps=4, num_stages=2)
    big = block_h * block_r >= 64 * 256  # e.g. 64 heads x 512: split the accumulator over 8 warps
    return dict(BLOCK_H=block_h, BLOCK_N=32, num_warps=8 if big else 4, num_stages=2)


def choose_num_splits(batch: int, head_blocks: int, k: int, block_n: int, num_sms: int,
                      max_splits: int = 32) -> int:
    """Fewest splits that fill the chip to >= 85% in whole waves (else the best found)."""
    base = batch * head_blocks
    limit = max(1, min(max_splits, triton.cdiv(k, block_n)))
    best, best_eff = 1, 0.0
    for s in range(1, limit + 1):
        n = base * s
        eff = n / (triton.cdiv(n, num_sms) * num_sms)
        if eff >= 0.85:
            return s
        if eff > best_eff + 1e-9:
            best, best_eff = s, eff
    return best


def sparse_mla_decode(q_abs: torch.Tensor, latent_cache: torch.Tensor, token_idx: torch.Tensor, scale: float,
                      num_tokens: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
                      out_dtype: torch.dtype | None = None, num_splits: int | None = None,
                      config: dict | None = None) -> torch.Tensor:
    """o_latent[b, h] = Σ_k softmax_k(q_abs[b,h]·c_k * scale) c_k over the rows token_idx[b, k] >= 0.

    q_abs [B, H, R]; latent_cache [..., R] contiguous (a flat token index addresses row
    `idx` of `latent_cache.view(-1, R)`); token_idx [B, K] int32/int64 (-1 = padding,
    anywhere); num_tokens [B] optional bound per request. Returns [B, H, R] in `out_dtype`
    (default q_abs.dtype). A request with no valid token gets zeros (the reference gives NaN).
    """
    b = q_abs.shape[0]
    if token_idx.dim() != 2 or token_idx.shape[0] != b:
        raise ValueError(f"token_idx must be [B={b}, K], got {tuple(token_idx.shape)}")
    q_abs, flat = _query_and_rows(q_abs, latent_cache)
    if token_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError("token_idx must be int32 or int64")
    if token_idx.stride(-1) != 1:
        token_idx = token_idx.contiguous()
    if num_tokens is not None and num_tokens.dtype not in (torch.int32, torch.int64):
        raise ValueError("num_tokens must be int32 or int64")
    return _launch(q_abs, flat, token_idx.shape[1], scale, out, out_dtype, num_splits, config,
                   idx=token_idx, num_tokens=num_tokens)


def sparse_mla_decode_sel(q_abs: torch.Tensor, latent_cache: torch.Tensor, sel: torch.Tensor, meta: BatchMeta,
                          kpool: int, scale: float, with_tail: bool = True, *, out: torch.Tensor | None = None,
                          out_dtype: torch.dtype | None = None, num_splits: int | None = None,
                          config: dict | None = None) -> torch.Tensor:
    """sparse_mla_decode over the token set of `sel` (what build_decode_token_idx would list),
    derived inside the kernel from the pool ids, positions and page table: no glue launches.

    sel [B, P] pool ids (-1 none; a repeated pool counts once, pools not complete at the
    query are ignored); with_tail adds the visible tail of the incomplete pool.
    """
    b = q_abs.shape[0]
    if sel.dim() != 2 or sel.shape[0] != b:
        raise ValueError(f"sel must be [B={b}, P], got {tuple(sel.shape)}")
    q_abs, flat = _query_and_rows(q_abs, latent_cache)
    sel = sel if sel.stride(-1) == 1 else sel.contiguous()
    table = meta.page_table if meta.page_table.stride(-1) == 1 else meta.page_table.contiguous()
    nsel = sel.shape[1]
    k = nsel * kpool + (kpool - 1 if with_tail else 0)
    return _launch(q_abs, flat, k, scale, out, out_dtype, num_splits, config,
                   sel=sel, positions=meta.positions, table=table, page_size=meta.page_size, kpool=kpool,
                   with_tail=with_tail)


def sparse_mla_rows_sel(q_abs: torch.Tensor, latent_cache: torch.Tensor, sel: torch.Tensor,
                       positions: torch.Tensor, req_index: torch.Tensor, page_table: torch.Tensor, page_size: int,
                       kpool: int, scale: float, with_tail: bool = True, *, out: torch.Tensor | None = None,
                       out_dtype: torch.dtype | None = None, num_splits: int | None = None,
                       config: dict | None = None) -> torch.Tensor:
    """sparse_mla_decode_sel with one row per query TOKEN (prefill / mixed batches).

    Row b is a query at position positions[b] of request req_index[b]: its token set is that
    of its own selection sel[b] under the positional causal rules (a pool counts iff it is
    complete at the token, the tail is the tokens <= positions[b] of its incomplete pool),
    and its pages are page_table[req_index[b]] (read in the kernel: no [N, max_pages] gather).
    """
    b = q_abs.shape[0]
    if sel.dim() != 2 or sel.shape[0] != b:
        raise ValueError(f"sel must be [B={b}, P], got {tuple(sel.shape)}")
    if positions.shape != (b,) or req_index.shape != (b,):
        raise ValueError("positions and req_index must be [B]")
    q_abs, flat = _query_and_rows(q_abs, latent_cache)
    sel = sel if sel.stride(-1) == 1 else sel.contiguous()
    table = page_table if page_table.stride(-1) == 1 else page_table.contiguous()
    nsel = sel.shape[1]
    k = nsel * kpool + (kpool - 1 if with_tail else 0)
    return _launch(q_abs, flat, k, scale, out, out_dtype, num_splits, config,
                   sel=sel, positions=positions.contiguous(), table=table, page_size=page_size, kpool=kpool,
                   with_tail=with_tail, req=req_index.contiguous())


def _query_and_rows(q_abs: torch.Tensor, latent_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked kernel operands: q_abs with unit stride in R, the cache as flat rows (R values,
    or fp8 rows of R bytes + scales)."""
    r = q_abs.shape[-1]
    if latent_cache.shape[-1] != r and not kv_fp8.is_fp8_rows(latent_cache, r):
        raise ValueError(f"latent rank {latent_cache.shape[-1]} != q_abs rank {r}")
    if not latent_cache.is_contiguous():
        raise ValueError("latent_cache must be contiguous")
    return (q_abs if q_abs.stride(-1) == 1 else q_abs.contiguous()), latent_cache.view(-1, latent_cache.shape[-1])


def _launch(q_abs, flat, k, scale, out, out_dtype, num_splits, config, *, idx=None, num_tokens=None,
            sel=None, positions=None, table=None, page_size=1, kpool=1, with_tail=False, req=None):
    b, h, r = q_abs.shape
    fp8 = flat.dtype == torch.uint8
    sc = flat.view(torch.float32) if fp8 else flat  # the rows' scales, read as fp32 (R % 4 == 0)
    out_dtype = out_dtype or q_abs.dtype
    if out is None:
        out = torch.empty(b, h, r, dtype=out_dtype, device=q_abs.device)
    elif out.shape != (b, h, r) or out.stride(-1) != 1:
        raise ValueError("out must be [B, H, R] with unit stride in R")
    if b == 0 or h == 0:
        return out

    compute = q_abs.dtype if fp8 else flat.dtype
    cfg = dict(default_config(h, r, compute, None if fp8 else b))  # few-row shape: timed on 16-bit rows
    if config:
        cfg.update(config)
    block_h, block_n = cfg["BLOCK_H"], cfg["BLOCK_N"]
    block_r = max(16, triton.next_power_of_2(r))
    head_blocks = triton.cdiv(h, block_h)
    if num_splits is None:
        num_splits = cfg.get("num_splits") or choose_num_splits(b, head_blocks, max(k, 1), block_n,
                                                                _num_sms(q_abs.device))
    num_splits = max(1, min(int(num_splits), max(1, triton.cdiv(k, block_n))))
    chunk = triton.cdiv(triton.cdiv(max(k, 1), num_splits), block_n) * block_n
    precision = "ieee" if compute == torch.float32 else "tf32"  # tf32 is moot for 16-bit operands
    split = num_splits > 1
    if split:
        opart = torch.empty(b, h, num_splits, r, dtype=torch.float32, device=q_abs.device)
        lse = torch.empty(b, h, num_splits, dtype=torch.float32, device=q_abs.device)
    else:
        opart = lse = out  # unused
    from_sel = sel is not None
    dummy = sel if from_sel else idx  # pointers the kernel never reads in this mode
    ntok = num_tokens if num_tokens is not None else dummy
    grid = (b, head_blocks, num_splits)
    _LAST_COMPILED["attention"] = _sparse_mla_decode_kernel[grid](
        q_abs, flat, idx if idx is not None else dummy, ntok, out, opart, lse,
        sel if from_sel else dummy, positions if from_sel else dummy, table if from_sel else dummy, sc,
        req if req is not None else dummy,
        q_abs.stride(0), q_abs.stride(1),
        flat.stride(0),
        idx.stride(0) if idx is not None else 0,
        out.stride(0), out.stride(1),
        opart.stride(0) if split else 0, opart.stride(1) if split else 0, opart.stride(2) if split else 0,
        lse.stride(0) if split else 0, lse.stride(1) if split else 0,
        sel.stride(0) if from_sel else 0, table.stride(0) if from_sel else 0,
        sc.stride(0) if fp8 else 0, r // 4 if fp8 else 0,
        h, r, k, chunk,
        float(scale) * _LOG2E,
        sel.shape[1] if from_sel else 0, page_size,
        BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_R=block_r,
        SPLIT=split, HAS_NTOK=num_tokens is not None, PRECISION=precision,
        FROM_SEL=from_sel, KPOOL=kpool, WITH_TAIL=with_tail, KV_FP8=fp8, HAS_REQ=req is not None,
        SPLIT_BY_COUNT=SPLIT_BY_COUNT,
        BLOCK_SEL=max(16, triton.next_power_of_2(sel.shape[1])) if from_sel else 16,
        **pdl.launch(q_abs.device), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if split:
        merge_r = min(block_r, _MERGE_BLOCK_R)
        _merge_splits_kernel[(b, h, triton.cdiv(r, merge_r))](
            opart, lse, out,
            opart.stride(0), opart.stride(1), opart.stride(2),
            lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            r, num_splits,
            BLOCK_S=max(32, triton.next_power_of_2(num_splits)), BLOCK_R=merge_r,
            **pdl.launch(out.device), num_warps=4,
        )
    return out


# How a decode query finds its latent rows: "rows-kernel" lists them first in one small launch
# (build_decode_rows, packed: a context shorter than the selection attends only to what exists)
# and the attention kernel reads the list; "in-kernel" derives them inside the attention kernel
# (sparse_mla_decode_sel). H200, context 1024, µs per call in a CUDA graph: the attention on a
# list took 18.8 µs at batch 1 and 38.4 at 16, the in-kernel derivation 46.5 and 109.5.
DECODE_TOKEN_LIST = "rows-kernel"


def sparse_mla(q: torch.Tensor, cache: torch.Tensor, w_kc: torch.Tensor, w_vc: torch.Tensor,
               sel: torch.Tensor | None, meta: BatchMeta, kpool: int, scale: float,
               with_tail: bool = True, *, reference: ReferenceOps | None = None,
               chunk_rows: int | None = None, side=INLINE) -> torch.Tensor:
    """ReferenceOps.sparse_mla on the kernel: decode batches here, and prefill / mixed batches with
    a selection (every query token is a row, like a decode query: sparse_mla_prefill.py); the rest
    go to the reference.

    Decode: q̃ = q·W_kc per head (one batched matmul), the kernel over the selected latent
    rows, then o = õ·W_vcᵀ per head, all in q's dtype like the reference. `side`
    (backends/side_work.py): where the row list is built, beside the matmul.
    """
    dt = q.dtype
    if not is_decode_batch(meta):
        from .sparse_mla_prefill import sparse_mla_prefill  # here: that module builds on this one
        return sparse_mla_prefill(q, cache, w_kc, w_vc, sel, meta, kpool, scale, with_tail, reference=reference,
                                  chunk_rows=chunk_rows)
    # Triton 3.6 fails to compile the in-kernel token list for an fp32 cache on sm90 (a
    # layout-conversion pass error); fp32 is the parity path, so it builds the list instead.
    fp32_math = torch.float32 in (q.dtype, cache.dtype)
    rows = None
    if sel is not None and DECODE_TOKEN_LIST == "rows-kernel":
        with side:  # the row list, from the selection alone, beside the absorbed queries
            rows = build_decode_rows(sel, meta.positions, meta.page_table, meta.page_size, kpool, with_tail)
    q_abs = torch.bmm(q.transpose(0, 1), w_kc.to(dt)).transpose(0, 1)  # [N, H, R]
    if rows is not None:
        side.join()
        idx, ntok = rows
        o_lat = sparse_mla_decode(q_abs, cache, idx, scale, ntok, out_dtype=dt)
    elif sel is not None and (not fp32_math or not cache.is_cuda):
        o_lat = sparse_mla_decode_sel(q_abs, cache, sel, meta, kpool, scale, with_tail, out_dtype=dt)
    else:  # dense causal: the token list is every cached token
        token_idx, num_tokens = build_decode_token_idx(sel, meta, kpool, with_tail)
        o_lat = sparse_mla_decode(q_abs, cache, token_idx, scale, num_tokens, out_dtype=dt)
    return torch.bmm(o_lat.transpose(0, 1), w_vc.to(dt).transpose(1, 2)).transpose(0, 1).contiguous()


__all__ = ["sparse_mla_decode", "sparse_mla_decode_sel", "build_decode_rows", "sparse_mla_rows_sel", "sparse_mla",
           "build_decode_token_idx", "build_prefill_token_idx", "is_decode_batch", "default_config",
           "choose_num_splits"]
