"""Where each query of the sparse-MLA kernel reads: the flat latent rows (page * page_size +
offset) of the pools the DSA indexer selected for it, packed first, -1 after (docs/MODEL.md
§3.3). One small launch per batch (`build_decode_rows`; `build_prefill_token_idx` with one row
per query token), and the torch form (`build_decode_token_idx`) that also lists the dense causal
set. The token set is exactly ReferenceOps._token_mask's: the selected complete pools (a
repeated pool counts once), then the visible tail of the incomplete one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..meta import BatchMeta
from . import pdl
from .interpreter import patch_interpreter
from .pdl import pdl_enter

patch_interpreter()


# the page-table width unspecialised: an eager step's width follows its longest request, and a
# width that was a multiple of 16 or not compiled a variant mid-traffic
@triton.jit(do_not_specialize=["stride_tb", "n_pages"])
def _decode_rows_kernel(SEL, POS, TABLE, IDX, NTOK, REQ, stride_sb, stride_tb, stride_ib, NSEL, n_pages, page_size,
                        KPOOL: tl.constexpr, BLOCK_SEL: tl.constexpr, WITH_TAIL: tl.constexpr,
                        HAS_REQ: tl.constexpr, PDL: tl.constexpr = False):
    """One program per query: the flat latent rows of its selected complete pools (a set: a
    repeated pool counts once), packed pool by pool in selection order, then the visible tail of
    its incomplete pool; NTOK = how many entries were written (-1 = a token with no page). Query b
    reads page-table row REQ[b] with HAS_REQ (one row per query token), else row b."""
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    pos = tl.load(POS + b).to(tl.int64)
    trow = tl.load(REQ + b).to(tl.int64) if HAS_REQ else b
    complete = (pos + 1) // KPOOL  # pools whose last token is <= pos
    offs_s = tl.arange(0, BLOCK_SEL)
    s_ok = offs_s < NSEL
    sel = tl.load(SEL + b * stride_sb + offs_s, mask=s_ok, other=-1).to(tl.int64)
    dup = tl.max(((sel[None, :] == sel[:, None]) & (offs_s[None, :] < offs_s[:, None])).to(tl.int32), 1)
    keep = s_ok & (sel >= 0) & (sel < complete) & (dup == 0)
    slot = tl.cumsum(keep.to(tl.int32), 0) - 1
    n = tl.sum(keep.to(tl.int32), 0) * KPOOL
    t = tl.arange(0, KPOOL)
    tok = tl.where(keep[:, None], sel[:, None] * KPOOL + t[None, :], 0)               # [BLOCK_SEL, KPOOL]
    pg = tok // page_size
    page = tl.load(TABLE + trow * stride_tb + pg, mask=keep[:, None] & (pg < n_pages), other=-1)
    row = tl.where(keep[:, None] & (page >= 0), page * page_size + tok % page_size, -1)
    tl.store(IDX + b * stride_ib + slot[:, None] * KPOOL + t[None, :], row.to(tl.int32), mask=keep[:, None])
    if WITH_TAIL:  # tokens complete*KPOOL .. pos: a prefix of t
        tt = complete * KPOOL + t
        t_ok = (t < KPOOL - 1) & (tt <= pos)
        pg_t = tt // page_size
        page_t = tl.load(TABLE + trow * stride_tb + pg_t, mask=t_ok & (pg_t < n_pages), other=-1)
        row_t = tl.where(t_ok & (page_t >= 0), page_t * page_size + tt % page_size, -1)
        tl.store(IDX + b * stride_ib + n + t, row_t.to(tl.int32), mask=t_ok)
        n += tl.sum(t_ok.to(tl.int32), 0)
    tl.store(NTOK + b, n.to(tl.int32))


def build_decode_rows(sel: torch.Tensor, positions: torch.Tensor, page_table: torch.Tensor, page_size: int,
                      kpool: int, with_tail: bool = True,
                      req_index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """build_decode_token_idx's token set in one launch -> (token_idx [B, K] int32, num_tokens [B] int32).

    Row b (position positions[b], pages page_table[b], or page_table[req_index[b]] with one row
    per query token) lists its selected complete pools' rows pool by pool in selection order (not
    position order: the attention is a sum, so only fp rounding sees the order), then its visible
    tail; entries at or past num_tokens[b] are not written, and a token without a page is -1.
    K = sel.shape[1]*kpool (+ kpool-1 with the tail).
    """
    b, nsel = sel.shape
    k = nsel * kpool + (kpool - 1 if with_tail else 0)
    dev = sel.device
    idx = torch.empty(b, max(k, 1), dtype=torch.int32, device=dev)
    ntok = torch.empty(b, dtype=torch.int32, device=dev)
    if b == 0:
        return idx[:, :k], ntok
    sel = sel if sel.stride(-1) == 1 else sel.contiguous()
    table = page_table if page_table.stride(-1) == 1 else page_table.contiguous()
    if positions.stride(0) != 1:
        positions = positions.contiguous()
    if req_index is not None and req_index.stride(0) != 1:
        req_index = req_index.contiguous()
    _decode_rows_kernel[(b,)](sel, positions, table, idx, ntok, req_index if req_index is not None else positions,
                              sel.stride(0), table.stride(0), idx.stride(0),
                              nsel, table.shape[1], page_size, KPOOL=kpool,
                              BLOCK_SEL=max(16, triton.next_power_of_2(nsel)), WITH_TAIL=with_tail,
                              HAS_REQ=req_index is not None, **pdl.launch(dev), num_warps=4)
    return idx[:, :k], ntok


def is_decode_batch(meta: BatchMeta) -> bool:
    """One new token for every request (what the decode kernels handle)."""
    return meta.num_reqs > 0 and all(s == 1 for s in meta.seq_lens)


def build_decode_token_idx(sel: torch.Tensor | None, meta: BatchMeta, kpool: int,
                           with_tail: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat latent rows each decode query attends to -> (token_idx [B, K] int32, num_tokens [B] int32).

    The token set is exactly ReferenceOps._token_mask's: the selected complete pools (a set:
    repeats count once; -1 and pools that are not complete are ignored) expanded to their
    tokens, plus (with_tail) the visible tail of the incomplete pool; sel None means dense
    causal. Valid tokens are packed first in increasing position order, -1 after. K is static
    (sel.shape[1]*kpool + kpool-1, or the longest request when dense), so nothing here waits
    on the GPU.
    """
    if meta.positions.shape[0] != meta.num_reqs:
        raise ValueError("build_decode_token_idx needs exactly one query per request")
    return _token_rows(sel, meta.positions, meta.page_table, meta.page_size, kpool, with_tail,
                       max(meta.total_lens) if sel is None else 0)


def build_prefill_token_idx(sel: torch.Tensor, positions: torch.Tensor, req_index: torch.Tensor,
                            page_table: torch.Tensor, page_size: int, kpool: int,
                            with_tail: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """build_decode_rows for one row per query token (prefill, a verify's K + 1 rows per request):
    row b is the query at positions[b] of request req_index[b], whose pages are
    page_table[req_index[b]]. One launch (the same set as build_decode_token_idx lists, which takes
    ~35 torch launches)."""
    return build_decode_rows(sel, positions, page_table, page_size, kpool, with_tail, req_index=req_index)


def _token_rows(sel, pos, table, ps, kpool, with_tail, dense_len):
    """The packed token lists of build_decode_token_idx; `table` holds row b's pages in row b."""
    dev = pos.device
    b = pos.shape[0]
    if sel is None:
        t = torch.arange(dense_len, device=dev)
        tok = t[None, :].expand(b, -1)
        ok = tok <= pos[:, None]
    else:
        s = torch.sort(sel.to(torch.long), dim=1).values
        dup = torch.zeros_like(s, dtype=torch.bool)
        dup[:, 1:] = s[:, 1:] == s[:, :-1]
        s = s.masked_fill(dup, -1)
        j = torch.arange(kpool, device=dev)
        complete = torch.div(pos + 1, kpool, rounding_mode="floor")  # pools whose last token is <= pos
        tok = (s[:, :, None] * kpool + j).flatten(1)
        # like the reference, only complete pools count (so pool tokens never overlap the tail)
        ok = ((s >= 0) & (s < complete[:, None]))[:, :, None].expand(-1, -1, kpool).flatten(1)
        if with_tail:
            tail = (complete * kpool)[:, None] + j[: kpool - 1]
            tok = torch.cat([tok, tail], dim=1)
            ok = torch.cat([ok, tail <= pos[:, None]], dim=1)
    width = tok.shape[1]
    page_idx = torch.div(tok, ps, rounding_mode="floor").clamp(0, table.shape[1] - 1)
    page = torch.gather(table, 1, page_idx)
    ok &= page >= 0
    flat = page * ps + tok % ps
    dest = torch.where(ok, torch.cumsum(ok, dim=1) - 1, width)
    token_idx = torch.full((b, width + 1), -1, dtype=torch.int32, device=dev)
    token_idx.scatter_(1, dest, torch.where(ok, flat, -1).to(torch.int32))
    return token_idx[:, :width], ok.sum(dim=1, dtype=torch.int32)
