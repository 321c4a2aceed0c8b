"""DSA k-pool indexer for decode (and, one row per token, prefill) queries (docs/MODEL.md §3.3) as a
Triton kernel + a tie-broken top-k.

Score of pool p for the query of request b (fp32):
    I(b, p) = Σ_h w[b, h] · relu(q[b, h] · K_p · di^-0.5)
where K_p is the cached pooled key of pool p, found at pooled[page_table[b, p // ppp], p % ppp]
(ppp = page_size // kpool pools per page). One program scores BLOCK_P pools of one request
against all Hi index heads as one matrix product (keys as the M side, so the tensor cores
see M = BLOCK_P), then mixes the heads in registers: every pooled key is read once.

Decode queries sit at the last position of their request, so every complete pool is
eligible; pools past n_pools[b] score -inf. Selection matches ReferenceOps.indexer_select
exactly: requests with at most topk pools take all of them in index order; the others take
the topk best in descending score, ties to the lower pool index (a total order through an
int64 key, so torch.topk's unspecified tie order never matters).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..meta import BatchMeta
from ..reference import ReferenceOps
from . import pdl
from .pdl import pdl_enter
from .interpreter import patch_interpreter
from .conv import device_lens
from .sparse_mla_rows import is_decode_batch

patch_interpreter()


@triton.jit
def _indexer_scores_kernel(
    Q, W, POOLED, TABLE, NPOOLS, OUT, REQ,
    stride_qb, stride_qh,
    stride_wb,
    stride_pool,
    stride_tb,
    stride_ob,
    HI, DI, P_OUT, ppp,
    scale, w_scale,
    BLOCK_HI: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, PRECISION: tl.constexpr,
    HAS_REQ: tl.constexpr, KEYS: tl.constexpr = False, POS_KPOOL: tl.constexpr = 0, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    b = tl.program_id(0)
    pb = tl.program_id(1)
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_h = tl.arange(0, BLOCK_HI)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = offs_h < HI
    d_ok = offs_d < DI

    n = tl.load(NPOOLS + b)
    if POS_KPOOL > 0:  # NPOOLS holds the rows' positions: the pools complete at each
        n = (n + 1) // POS_KPOOL
    p_ok = offs_p < n
    if HAS_REQ:  # per-token rows (prefill): the page-table row of the row's request
        trow = tl.load(REQ + b).to(tl.int64)
    else:
        trow = b.to(tl.int64)
    page = tl.load(TABLE + trow * stride_tb + offs_p // ppp, mask=p_ok, other=0)
    ok = p_ok & (page >= 0)
    row = tl.where(ok, page * ppp + offs_p % ppp, 0).to(tl.int64)
    keys = tl.load(POOLED + row[:, None] * stride_pool + offs_d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
    q = tl.load(Q + b.to(tl.int64) * stride_qb + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    q = q.to(keys.dtype)
    s = tl.dot(keys, tl.trans(q), input_precision=PRECISION)  # [BLOCK_P, BLOCK_HI]
    s = tl.maximum(s * scale, 0.0)
    w = tl.load(W + b.to(tl.int64) * stride_wb + offs_h, mask=h_ok, other=0.0).to(tl.float32) * w_scale
    score = tl.sum(s * w[None, :], 1)
    score = tl.where(ok, score, float("-inf"))
    if KEYS:  # topk_lower_index_ties's int64 key, so one torch.topk selects (no key launches)
        bits = tl.where(score == 0.0, 0.0, score).to(tl.int32, bitcast=True)  # -0.0 counts as 0.0
        ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
        key = (ordered << 32) | (P_OUT - 1 - offs_p).to(tl.int64)
        tl.store(OUT + b.to(tl.int64) * stride_ob + offs_p, key, mask=offs_p < P_OUT)
    else:
        tl.store(OUT + b.to(tl.int64) * stride_ob + offs_p, score, mask=offs_p < P_OUT)


@triton.jit
def _decode_select_kernel(POS, TOP, OUT, PRE, CU, REQ, stride_top, stride_ob, TOPK, kpool,
                          HAS_TOP: tl.constexpr, HAS_REQ: tl.constexpr, BLOCK: tl.constexpr,
                          PDL: tl.constexpr = False):
    """sel[b, j] = j if pool j is complete at row b's position, else -1 (a request with at most
    TOPK pools takes them all, in order); with TOP, a request with more takes TOP[b]. HAS_REQ: row
    b is one query token of request REQ[b], whose pools at the end of the batch,
    (PRE[r] + CU[r+1] - CU[r]) // kpool, decide, and of TOP[b] only the pools complete at the
    row's own position count (the rest -1)."""
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    n = (tl.load(POS + b).to(tl.int64) + 1) // kpool
    sel = tl.where(j < n, j, -1).to(tl.int64)
    if HAS_TOP:
        top = tl.load(TOP + b * stride_top + j, mask=j < TOPK, other=-1)
        if HAS_REQ:
            r = tl.load(REQ + b).to(tl.int64)
            req_pools = (tl.load(PRE + r) + tl.load(CU + r + 1) - tl.load(CU + r)).to(tl.int64) // kpool
            sel = tl.where(req_pools > TOPK, tl.where(top < n, top, -1), sel)
        else:
            sel = tl.where(n > TOPK, top, sel)
    tl.store(OUT + b * stride_ob + j, sel, mask=j < TOPK)


def decode_select(positions: torch.Tensor, kpool: int, topk_pools: int,
                  top: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
                  requests: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """[B, topk_pools] long selection of queries at `positions` (one launch): every complete pool in
    index order, or `top`'s row where the request has more than topk_pools pools.

    requests = (prefix_lens_t, cu_seqlens_t, req_index): one row per query token (prefill, a
    verify's rows); a request's pools at the end of the batch decide, and its rows keep only the
    pools of `top` complete at their own position (the reference's rule). Writes `out` if given."""
    b = positions.shape[0]
    if out is None:
        out = torch.empty(b, topk_pools, dtype=torch.long, device=positions.device)
    if b == 0 or topk_pools == 0:
        return out
    if positions.stride(0) != 1:
        positions = positions.contiguous()
    if top is not None and top.stride(-1) != 1:
        top = top.contiguous()
    pre, cu, req = requests if requests is not None else (positions, positions, positions)
    _decode_select_kernel[(b,)](
        positions, top if top is not None else out, out, pre, cu, req.contiguous(),
        top.stride(0) if top is not None else 0, out.stride(0), topk_pools, kpool,
        HAS_TOP=top is not None, HAS_REQ=requests is not None, BLOCK=max(16, triton.next_power_of_2(topk_pools)),
        **pdl.launch(positions.device), num_warps=1)
    return out


def default_config(hi: int, di: int) -> dict:
    return dict(BLOCK_P=128 if di <= 128 else 64, num_warps=4, num_stages=1)


def indexer_scores(q: torch.Tensor, w: torch.Tensor, pooled: torch.Tensor, page_table: torch.Tensor,
                   n_pools: torch.Tensor, pools_per_page: int, max_pools: int, *,
                   out: torch.Tensor | None = None, config: dict | None = None,
                   req_index: torch.Tensor | None = None, keys: bool = False,
                   positions_kpool: int = 0) -> torch.Tensor:
    """Scores [B, max_pools] fp32 of the decode queries; -inf past n_pools[b] (or on a -1 page).
    keys=True: topk_lower_index_ties's int64 keys of those scores instead (topk_keys selects).

    req_index [B] (optional): row b reads page_table[req_index[b]] instead of page_table[b]
    (one row per prefill token; n_pools[b] is then that token's visible pools).

    q [B, Hi, di] (any float dtype); w [B, Hi] head weights as the weights projection gives them
    (any float dtype; the kernel takes them to fp32 and scales by Hi^-0.5, as head_weights does);
    pooled [num_pages, pools_per_page, di] contiguous; page_table [B, max_pages] (-1 = none);
    n_pools [B] int (complete pools per request, all eligible); with positions_kpool = kpool > 0
    it holds the rows' positions instead, and a row's pools are the (position + 1) // kpool
    complete at it (no launches to divide them out). With q and pooled both
    bf16/fp16 the product runs on the tensor cores (exact products, fp32 sums); otherwise in
    fp32.
    """
    b, hi, di = q.shape
    if pooled.shape[-1] != di:
        raise ValueError(f"pooled key dim {pooled.shape[-1]} != q dim {di}")
    if not pooled.is_contiguous():
        raise ValueError("pooled must be contiguous")
    flat = pooled.view(-1, di)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if w.stride(-1) != 1:
        w = w.contiguous()
    if page_table.stride(-1) != 1:
        page_table = page_table.contiguous()
    out_dtype = torch.int64 if keys else torch.float32
    if out is None:
        out = torch.empty(b, max_pools, dtype=out_dtype, device=q.device)
    elif out.shape != (b, max_pools) or out.dtype != out_dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {out_dtype} [B, max_pools] with unit stride")
    if b == 0 or max_pools == 0:
        return out
    if q.dtype == flat.dtype and q.dtype in (torch.bfloat16, torch.float16):
        precision = "tf32"  # moot for 16-bit operands
    else:
        precision = "ieee"
        if flat.dtype != torch.float32:
            flat = flat.float()  # rare path (mixed dtypes): upcast the pool once
        if q.dtype != torch.float32:
            q = q.float()
    cfg = dict(default_config(hi, di))
    if config:
        cfg.update(config)
    grid = (b, triton.cdiv(max_pools, cfg["BLOCK_P"]))
    _indexer_scores_kernel[grid](
        q, w, flat, page_table, n_pools, out, req_index if req_index is not None else n_pools,
        q.stride(0), q.stride(1),
        w.stride(0),
        flat.stride(0),
        page_table.stride(0),
        out.stride(0),
        hi, di, max_pools, pools_per_page,
        float(di ** -0.5), float(hi ** -0.5),
        BLOCK_HI=max(16, triton.next_power_of_2(hi)), BLOCK_D=max(16, triton.next_power_of_2(di)),
        BLOCK_P=cfg["BLOCK_P"], PRECISION=precision, HAS_REQ=req_index is not None, KEYS=keys,
        POS_KPOOL=positions_kpool,
        **pdl.launch(q.device), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out


def topk_lower_index_ties(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores per row, in descending order, ties to the lower index.

    = torch.sort(scores, descending=True, stable=True).indices[:, :k] (-0.0 counts as 0.0),
    through one torch.topk on a unique int64 key: the order-preserving integer image of the
    fp32 score in the high word, (P-1-index) in the low word.
    """
    p = scores.shape[-1]
    s = torch.where(scores == 0, torch.zeros_like(scores), scores).float().contiguous()
    bits = s.view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    low = (p - 1) - torch.arange(p, device=scores.device, dtype=torch.int64)
    key = (ordered << 32) | low
    return topk_keys(key, k)


def topk_keys(keys: torch.Tensor, k: int) -> torch.Tensor:
    """topk_lower_index_ties on the keys it builds (indexer_scores(..., keys=True) writes them)."""
    return torch.topk(keys, k, dim=-1, largest=True, sorted=True).indices


def indexer_select(q: torch.Tensor, w: torch.Tensor, pooled: torch.Tensor, meta: BatchMeta, kpool: int,
                   topk_pools: int, *, reference: ReferenceOps | None = None,
                   max_score_bytes: int = 256 << 20) -> torch.Tensor:
    """ReferenceOps.indexer_select on the kernel: decode batches, and prefill / mixed batches
    with one row per query token.

    Returns [N, topk_pools] long pool indices, -1 = none, identical to the reference.
    """
    if meta.num_reqs == 0:
        return (reference or ReferenceOps()).indexer_select(q, w, pooled, meta, kpool, topk_pools)
    if not is_decode_batch(meta):
        return _indexer_select_rows(q, w, pooled, meta, kpool, topk_pools, max_score_bytes)
    max_pools = max(t // kpool for t in meta.total_lens)
    if max_pools <= topk_pools:  # decode: every complete pool is visible, and all are taken
        return decode_select(meta.positions, kpool, topk_pools)
    keys = indexer_scores(q, w, pooled, meta.page_table, meta.positions, meta.page_size // kpool, max_pools,
                          keys=True, positions_kpool=kpool)
    return decode_select(meta.positions, kpool, topk_pools, topk_keys(keys, topk_pools))


def _indexer_select_rows(q, w, pooled, meta, kpool, topk_pools, max_score_bytes):
    """Prefill / mixed batch: every query token is a row, scored against the pools complete at
    its position (n = (pos+1)//kpool; the rest -inf), page-table row via req_index.

    As in the reference, the "take all in index order" rule is per REQUEST (its pools at the end
    of the batch, total_len // kpool <= topk), not per token; otherwise the token takes its
    topk best (ties to the lower pool) and the entries that are not visible to it become -1.
    Rows go in chunks so the [rows, max_pools] top-k keys stay bounded. Three launches a chunk
    (the keys, torch.topk, the select). max_pools comes from the Python lengths of meta (in the
    speculative graphs, the bucket's bound).
    """
    n = q.shape[0]
    if n == 0 or topk_pools == 0:
        return torch.full((n, topk_pools), -1, dtype=torch.long, device=q.device)
    max_pools = max(t // kpool for t in meta.total_lens)
    if max_pools <= topk_pools:  # every request takes all its pools visible at the row
        return decode_select(meta.positions, kpool, topk_pools)
    # each token's request's total_len // kpool from meta's device lengths: no blocking H2D copy
    pre_t, cu_t = device_lens(meta, q.device)
    pos = meta.positions
    table = meta.page_table if meta.page_table.stride(-1) == 1 else meta.page_table.contiguous()
    req = meta.req_index.contiguous()
    sel = torch.empty(n, topk_pools, dtype=torch.long, device=q.device)
    chunk = max(1, min(n, max_score_bytes // (8 * max_pools)))
    for c0 in range(0, n, chunk):
        c1 = min(c0 + chunk, n)
        keys = indexer_scores(q[c0:c1], w[c0:c1], pooled, table, pos[c0:c1], meta.page_size // kpool, max_pools,
                              req_index=req[c0:c1], keys=True, positions_kpool=kpool)
        # eligible pools sort first; the rest become -1 in the select launch
        decode_select(meta.positions[c0:c1], kpool, topk_pools, topk_keys(keys, topk_pools), out=sel[c0:c1],
                      requests=(pre_t, cu_t, req[c0:c1]))
    return sel


# ---------------------------------------------------------------------------------------
# pooled-key update: decode batches (one new token per request), short rows (a few each), and
# any batch (prefill and mixed: the pools launch, then the tails launch)
# ---------------------------------------------------------------------------------------
@triton.jit
def _pooled_key(kk, gg, APE, stride_ape, rows, offs_d, d_ok, KPOOL: tl.constexpr):
    """The pooled key of one complete pool, like the reference: softmax over the pool of gate +
    ape per channel (fp32), the probabilities and their products with the keys rounded to the
    model dtype (that of kk / gg before the fp32 cast), the sum in fp32."""
    row_ok = (rows < KPOOL)[:, None] & d_ok[None, :]
    ape = tl.load(APE + rows[:, None] * stride_ape + offs_d[None, :], mask=row_ok, other=0.0).to(tl.float32)
    logits = tl.where(row_ok, gg.to(tl.float32) + ape, float("-inf"))
    mx = tl.max(logits, 0)
    e = tl.exp(logits - mx[None, :])
    e = tl.where(row_ok, e, 0.0)
    probs = (e / tl.sum(e, 0)[None, :]).to(kk.dtype).to(tl.float32)  # HF: probs in the model dtype
    prod = (probs * kk.to(tl.float32)).to(kk.dtype).to(tl.float32)
    return tl.sum(tl.where(row_ok, prod, 0.0), 0)


# the page-table width unspecialised: widths that are a multiple of 16 or not each compiled a
# variant mid-traffic
@triton.jit(do_not_specialize=["stride_tb"])
def _indexer_update_decode_kernel(
    K, G, APE, POOLED, TAIL_K, TAIL_G, PREFIX, SLOTS, TABLE, CU,
    stride_kn, stride_gn, stride_ape,
    stride_pool, stride_tslot, stride_trow, stride_tb,
    DI, ppp,
    KPOOL: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    """The one new token of each request b (row CU[b], position PREFIX[b])."""
    pdl_enter(PDL)
    b = tl.program_id(0)
    row = tl.load(CU + b)
    p0 = tl.load(PREFIX + b)
    slot = tl.load(SLOTS + b).to(tl.int64)
    t0 = p0 % KPOOL
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < DI
    k_new = tl.load(K + row.to(tl.int64) * stride_kn + offs_d, mask=d_ok, other=0.0)
    g_new = tl.load(G + row.to(tl.int64) * stride_gn + offs_d, mask=d_ok, other=0.0)
    tail = slot * stride_tslot
    if t0 < KPOOL - 1:  # the pool stays incomplete: the token joins the tail
        tl.store(TAIL_K + tail + t0 * stride_trow + offs_d, k_new.to(TAIL_K.dtype.element_ty), mask=d_ok)
        tl.store(TAIL_G + tail + t0 * stride_trow + offs_d, g_new.to(TAIL_G.dtype.element_ty), mask=d_ok)
    else:  # the token completes pool p0 // KPOOL: its pooled key is computed once, here
        rows = tl.arange(0, BLOCK_K)
        old = (rows < KPOOL - 1)[:, None] & d_ok[None, :]
        ptr = tail + rows[:, None] * stride_trow + offs_d[None, :]
        # like the reference: the tail is read back in the model dtype (that of k and g)
        kk = tl.load(TAIL_K + ptr, mask=old, other=0.0).to(k_new.dtype)
        gg = tl.load(TAIL_G + ptr, mask=old, other=0.0).to(g_new.dtype)
        last = (rows == KPOOL - 1)[:, None]
        kk = tl.where(last, k_new[None, :], kk)
        gg = tl.where(last, g_new[None, :], gg)
        key = _pooled_key(kk, gg, APE, stride_ape, rows, offs_d, d_ok, KPOOL)
        pool = p0 // KPOOL
        page = tl.load(TABLE + b.to(tl.int64) * stride_tb + pool // ppp).to(tl.int64)
        dst = (page * ppp + pool % ppp) * stride_pool
        tl.store(POOLED + dst + offs_d, key.to(k_new.dtype).to(POOLED.dtype.element_ty), mask=d_ok & (page >= 0))


@triton.jit
def _indexer_update_pools_kernel(
    K, G, APE, POOLED, TAIL_K, TAIL_G, PREFIX, SLOTS, TABLE, CU,
    stride_kn, stride_gn, stride_ape,
    stride_pool, stride_tslot, stride_trow, stride_tb,
    DI, ppp,
    KPOOL: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (b, i): the i-th pool that request b's new tokens complete. Its tokens before the
    request's first new position come from the tail (only the first pool has any), the rest from
    this batch's rows. The tails are rewritten by the next launch, after every read here."""
    b = tl.program_id(0)
    i = tl.program_id(1)
    r0 = tl.load(CU + b)
    n = tl.load(CU + b + 1) - r0
    p0 = tl.load(PREFIX + b)
    base = p0 - p0 % KPOOL
    pool = base // KPOOL + i
    first = pool * KPOOL
    if first + KPOOL > p0 + n:  # this pool is not complete after the batch
        return
    rows = tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < DI
    pos = first + rows
    from_tail = (pos < p0)[:, None] & d_ok[None, :]
    from_new = (pos >= p0)[:, None] & (rows < KPOOL)[:, None] & d_ok[None, :]
    tail = tl.load(SLOTS + b).to(tl.int64) * stride_tslot
    t_ptr = tail + (pos - base)[:, None] * stride_trow + offs_d[None, :]
    n_rows = (r0 + pos - p0).to(tl.int64)[:, None]
    k_new = tl.load(K + n_rows * stride_kn + offs_d[None, :], mask=from_new, other=0.0)
    g_new = tl.load(G + n_rows * stride_gn + offs_d[None, :], mask=from_new, other=0.0)
    # like the reference: the tail is read back in the model dtype (that of k and g)
    kk = tl.load(TAIL_K + t_ptr, mask=from_tail, other=0.0).to(k_new.dtype)
    gg = tl.load(TAIL_G + t_ptr, mask=from_tail, other=0.0).to(g_new.dtype)
    kk = tl.where(from_new, k_new, kk)
    gg = tl.where(from_new, g_new, gg)
    key = _pooled_key(kk, gg, APE, stride_ape, rows, offs_d, d_ok, KPOOL)
    page = tl.load(TABLE + b.to(tl.int64) * stride_tb + pool // ppp).to(tl.int64)
    dst = (page * ppp + pool % ppp) * stride_pool
    tl.store(POOLED + dst + offs_d, key.to(k_new.dtype).to(POOLED.dtype.element_ty), mask=d_ok & (page >= 0))


@triton.jit
def _indexer_update_tails_kernel(
    K, G, TAIL_K, TAIL_G, PREFIX, SLOTS, CU,
    stride_kn, stride_gn, stride_tslot, stride_trow, DI,
    KPOOL: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program b: request b's new tokens of its last, incomplete pool -> their tail rows."""
    b = tl.program_id(0)
    r0 = tl.load(CU + b)
    p0 = tl.load(PREFIX + b)
    end = p0 + tl.load(CU + b + 1) - r0
    rows = tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, BLOCK_D)
    pos = end - end % KPOOL + rows
    ok = ((pos >= p0) & (pos < end))[:, None] & (offs_d < DI)[None, :]
    n_rows = (r0 + pos - p0).to(tl.int64)[:, None]
    k_new = tl.load(K + n_rows * stride_kn + offs_d[None, :], mask=ok, other=0.0)
    g_new = tl.load(G + n_rows * stride_gn + offs_d[None, :], mask=ok, other=0.0)
    t_ptr = tl.load(SLOTS + b).to(tl.int64) * stride_tslot + rows[:, None] * stride_trow + offs_d[None, :]
    tl.store(TAIL_K + t_ptr, k_new.to(TAIL_K.dtype.element_ty), mask=ok)
    tl.store(TAIL_G + t_ptr, g_new.to(TAIL_G.dtype.element_ty), mask=ok)


# Batches whose requests all have 1..8 new tokens (a verify, a rollback): the pools launch's grid
# is bounded by the row count alone, so it reads no Python prefix length (the speculative graphs'
# metas carry bucket bounds there); two launches where a launch per token took K + 1.
SHORT_ROWS_MAX = 8


def update_takes(meta: BatchMeta, pooled: torch.Tensor, tail_k: torch.Tensor, tail_g: torch.Tensor) -> bool:
    """Whether indexer_update's kernels take this batch (else it runs the reference)."""
    return (meta.num_reqs > 0 and meta.prefix_lens_t is not None and meta.cu_seqlens_t is not None
            and pooled.is_contiguous() and tail_k.stride() == tail_g.stride() and tail_k.stride(-1) == 1)


def indexer_update(k: torch.Tensor, g: torch.Tensor, ape: torch.Tensor, pooled: torch.Tensor,
                   tail_k: torch.Tensor, tail_g: torch.Tensor, meta: BatchMeta, kpool: int, *,
                   reference: ReferenceOps | None = None) -> None:
    """ReferenceOps.indexer_update on kernels: decode batches in one launch, any other batch in
    two: every pool the batch completes, then the tails.

    The decode kernel: one program per request; the new key/gate joins its slot's tail, or, when
    it completes the pool, the pooled key (softmax over the pool of gate + ape, per channel) is
    written to its page. Every kernel reads only device tensors (prefix_lens_t, cu_seqlens_t,
    slot_ids, page_table); for decode and short rows (every request 1..SHORT_ROWS_MAX new tokens:
    speculative decoding's verify and rollback) the launch shapes need no Python prefix length
    either, so those paths are safe inside a CUDA graph.
    """
    if not update_takes(meta, pooled, tail_k, tail_g):
        return (reference or ReferenceOps()).indexer_update(k, g, ape, pooled, tail_k, tail_g, meta, kpool)
    b, di = meta.num_reqs, k.shape[1]
    seq = meta.seq_lens
    k = k if k.stride(-1) == 1 else k.contiguous()
    g = g if g.stride(-1) == 1 else g.contiguous()
    ape = ape.contiguous()
    table = meta.page_table if meta.page_table.stride(-1) == 1 else meta.page_table.contiguous()
    flat = pooled.view(-1, di)
    blocks = {"KPOOL": kpool, "BLOCK_K": triton.next_power_of_2(kpool),
              "BLOCK_D": max(16, triton.next_power_of_2(di))}
    if all(s == 1 for s in seq):
        _indexer_update_decode_kernel[(b,)](
            k, g, ape, flat, tail_k, tail_g, meta.prefix_lens_t, meta.slot_ids, table, meta.cu_seqlens_t,
            k.stride(0), g.stride(0), ape.stride(0),
            flat.stride(0), tail_k.stride(0), tail_k.stride(1), table.stride(0),
            di, meta.page_size // kpool, **blocks, **pdl.launch(k.device), num_warps=4,
        )
        return None
    if all(1 <= s <= SHORT_ROWS_MAX for s in seq):
        pools = (kpool - 1 + max(seq)) // kpool  # the most any start inside a pool can complete
    else:
        pools = max((p % kpool + s) // kpool for p, s in zip(meta.prefix_lens, seq))
    if pools:
        _indexer_update_pools_kernel[(b, pools)](
            k, g, ape, flat, tail_k, tail_g, meta.prefix_lens_t, meta.slot_ids, table, meta.cu_seqlens_t,
            k.stride(0), g.stride(0), ape.stride(0),
            flat.stride(0), tail_k.stride(0), tail_k.stride(1), table.stride(0),
            di, meta.page_size // kpool, **blocks, num_warps=4,
        )
    _indexer_update_tails_kernel[(b,)](
        k, g, tail_k, tail_g, meta.prefix_lens_t, meta.slot_ids, meta.cu_seqlens_t,
        k.stride(0), g.stride(0), tail_k.stride(0), tail_k.stride(1), di, **blocks, num_warps=4,
    )
    return None


__all__ = ["indexer_scores", "indexer_select", "decode_select", "indexer_update", "topk_lower_index_ties", "topk_keys",
           "default_config"]
