"""The reference ops' decode rows, batched over requests.

A decode row is one new token of a request that has history (seq_len 1, prefix_len > 0). The
reference ops loop over requests, which at a CPU decode step of 100 requests cost ~0.4 ms a
request and op: most of the step. Here the decode rows of a batch go through each op at once,
with the same formulas as the per-request loop (padded to the longest request where lengths
differ, the padding masked out); ReferenceOps keeps its loop for prefill runs.

Every function takes the `DecodeRows` of the batch (`decode_rows(meta)`, built once per forward)
and the op's own arguments, and writes its outputs and caches in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import kv_fp8
from .meta import BatchMeta

# Requests x padded tokens gathered at once by the sparse-MLA decode (its latent rows and
# scores): bounds the memory a batch of long contexts takes, ~128 MB of a 512-wide fp32 latent.
MLA_GROUP_TOKENS = 1 << 16


@dataclass(frozen=True)
class DecodeRows:
    reqs: list[int]           # request index of each decode row (host)
    req_t: torch.Tensor       # the same, on the ops' device
    tok_t: torch.Tensor       # flat token index of each decode row
    totals: list[int]         # prefix_len + 1 of each row (host)

    def __len__(self) -> int:
        return len(self.reqs)


def decode_rows(meta: BatchMeta, device: torch.device) -> DecodeRows:
    """The batch's decode rows (shared by every layer of the forward, through meta.derived)."""
    key = ("reference-decode-rows", str(device))
    rows = meta.derived.get(key)
    if rows is None:
        cu = meta.cu_seqlens
        reqs = [r for r, (p, s) in enumerate(zip(meta.prefix_lens, meta.seq_lens)) if s == 1 and p > 0]
        rows = DecodeRows(reqs, torch.tensor(reqs, dtype=torch.long, device=device),
                          torch.tensor([cu[r] for r in reqs], dtype=torch.long, device=device),
                          [meta.prefix_lens[r] + 1 for r in reqs])
        meta.derived[key] = rows
    return rows


def causal_conv(x: torch.Tensor, out: torch.Tensor, conv_state: torch.Tensor, w: torch.Tensor,
                meta: BatchMeta, rows: DecodeRows) -> None:
    """out[tok] = SiLU(conv over the slot's K-1 kept inputs and this one); the slot keeps the last
    K-1. w [K, C] fp32, row j multiplying the input j steps back (ReferenceOps.causal_conv's)."""
    k = w.shape[0]
    slots = meta.slot_ids.to(x.device)[rows.req_t]
    seq = torch.cat([conv_state[slots].float(), x[rows.tok_t].float()[:, None]], dim=1)  # [B, K, C]
    acc = torch.zeros(len(rows), x.shape[1], dtype=torch.float32, device=x.device)
    for j in range(k):
        acc += w[j] * seq[:, k - 1 - j]
    out[rows.tok_t] = F.silu(acc).to(out.dtype)
    if k > 1:
        conv_state[slots] = seq[:, 1:].to(conv_state.dtype)


def kda_step(q, k, v, g, beta, out: torch.Tensor, state: torch.Tensor, meta: BatchMeta, rows: DecodeRows) -> None:
    """One delta-rule step per decode row (q, k normalised, fp32 inputs), in place on the slots."""
    tok = rows.tok_t
    slots = meta.slot_ids.to(q.device)[rows.req_t]
    s = state[slots].float() * g[tok].exp()[..., None]  # [B, H, dk, dv]
    kt = k[tok]
    delta = (v[tok] - torch.einsum("bhkv,bhk->bhv", s, kt)) * beta[tok][..., None]
    s = s + kt[..., None] * delta[:, :, None, :]
    out[tok] = torch.einsum("bhkv,bhk->bhv", s, q[tok])
    state[slots] = s.to(state.dtype)


def indexer_update(k: torch.Tensor, g: torch.Tensor, ape32: torch.Tensor, pooled: torch.Tensor,
                   tail_k: torch.Tensor, tail_g: torch.Tensor, meta: BatchMeta, kpool: int,
                   rows: DecodeRows) -> None:
    """Each row's key and gate join its slot's tail; a row that completes its pool writes the
    pool's key (softmax over the pool's gates + position embedding, in fp32) instead."""
    dev = k.device
    at = torch.tensor([p % kpool for p in (t - 1 for t in rows.totals)], dtype=torch.long, device=dev)
    slots = meta.slot_ids.to(dev)[rows.req_t]
    done = at == kpool - 1
    open_ = ~done
    if bool(open_.any()):
        s, a, tok = slots[open_], at[open_], rows.tok_t[open_]
        tail_k[s, a] = k[tok].to(tail_k.dtype)
        tail_g[s, a] = g[tok].to(tail_g.dtype)
    if bool(done.any()):
        s, tok, req = slots[done], rows.tok_t[done], rows.req_t[done]
        kk = torch.cat([tail_k[s, :kpool - 1].to(k.dtype), k[tok][:, None]], dim=1)  # [B, kpool, di]
        gg = torch.cat([tail_g[s, :kpool - 1].to(g.dtype), g[tok][:, None]], dim=1)
        probs = torch.softmax(gg.float() + ape32, dim=1).to(kk.dtype)
        keys = (probs * kk).sum(dim=1)
        pool = torch.tensor([t // kpool - 1 for t in rows.totals], dtype=torch.long, device=dev)[done]
        pools_per_page = meta.page_size // kpool
        pages = meta.page_table.to(dev)[req, pool // pools_per_page]
        pooled[pages, pool % pools_per_page] = keys.to(pooled.dtype)


def _pool_keys(pooled: torch.Tensor, meta: BatchMeta, req: torch.Tensor, n_max: int, kpool: int) -> torch.Tensor:
    """[B, n_max, di] fp32: the pooled keys of each row's first n_max pools (past a row's own
    pools: whatever its page-table padding points at; the caller masks those)."""
    pools_per_page = meta.page_size // kpool
    ids = torch.arange(n_max, device=pooled.device)
    pages = meta.page_table.to(pooled.device)[req][:, ids // pools_per_page].clamp_min(0)
    return pooled[pages, (ids % pools_per_page)[None, :]].float()


def indexer_select(q: torch.Tensor, w32: torch.Tensor, pooled: torch.Tensor, sel: torch.Tensor,
                   meta: BatchMeta, kpool: int, topk_pools: int, rows: DecodeRows) -> None:
    """sel[tok]: every complete pool when there are at most topk_pools (the query sits past all of
    them), else the topk_pools best by the indexer score, ties to the lower index. w32: the
    head weights in fp32 (head_weights)."""
    dev = q.device
    n_pools = torch.tensor([t // kpool for t in rows.totals], dtype=torch.long, device=dev)
    ids = torch.arange(max(max(rows.totals) // kpool, 1), device=dev)
    few = n_pools <= topk_pools
    if bool(few.any()):
        width = min(topk_pools, ids.numel())
        own = ids[None, :width] < n_pools[few][:, None]
        sel[rows.tok_t[few], :width] = torch.where(own, ids[None, :width], -1)
    many = ~few
    if bool(many.any()):
        tok, req, n = rows.tok_t[many], rows.req_t[many], n_pools[many]
        keys = _pool_keys(pooled, meta, req, ids.numel(), kpool)
        scores = torch.relu(torch.einsum("bhd,bpd->bhp", q[tok].float(), keys) * q.shape[-1] ** -0.5)
        index = torch.einsum("bh,bhp->bp", w32[tok], scores)
        index = index.masked_fill(ids[None, :] >= n[:, None], float("-inf"))
        sel[tok] = torch.sort(index, dim=-1, descending=True, stable=True).indices[:, :topk_pools]


def _latent(cache: torch.Tensor, meta: BatchMeta, req: torch.Tensor, totals: torch.Tensor, t_max: int,
            rank: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, t_max, R]: each row's cached latent tokens, zero past its own (unwritten slots may hold
    anything, NaN included, and a zero probability times NaN is NaN)."""
    ps = meta.page_size
    n_pages = -(-t_max // ps)
    pages = meta.page_table.to(cache.device)[req][:, :n_pages].clamp_min(0)
    locs = (pages[:, :, None] * ps + torch.arange(ps, device=cache.device)).flatten(1)[:, :t_max]
    c = cache.view(-1, cache.shape[-1])[locs]
    c = kv_fp8.dequantize_rows(c, rank, dtype) if c.dtype == torch.uint8 else c.to(dtype)
    past = torch.arange(t_max, device=cache.device)[None, :] >= totals[:, None]
    return c.masked_fill(past[..., None], 0)


def _visible(sel: torch.Tensor | None, totals: torch.Tensor, t_max: int, kpool: int, with_tail: bool) -> torch.Tensor:
    """[B, t_max] bool: the tokens each row's query (at position total - 1) attends to: its
    selected pools and its incomplete pool's tail (every earlier token without a selection)."""
    t = torch.arange(t_max, device=totals.device)
    causal = t[None, :] < totals[:, None]
    if sel is None:
        return causal
    n_cols = t_max // kpool + 1  # the last column catches unused (-1) entries
    chosen = torch.zeros(sel.shape[0], n_cols, dtype=torch.bool, device=sel.device)
    valid = sel >= 0
    chosen.scatter_(1, torch.where(valid, sel, n_cols - 1), valid)
    chosen[:, -1] = False
    mask = chosen[:, t // kpool] & causal
    if with_tail:
        mask |= (t[None, :] >= (totals // kpool * kpool)[:, None]) & causal
    return mask


def sparse_mla(q: torch.Tensor, cache: torch.Tensor, w_kc: torch.Tensor, w_vc: torch.Tensor,
               sel: torch.Tensor | None, out: torch.Tensor, meta: BatchMeta, kpool: int, scale: float,
               with_tail: bool, rows: DecodeRows) -> None:
    """out[tok]: each row's query over its visible latent tokens in the absorbed form (scores
    against the latent, values read back through w_vc), rows grouped by length so that a group
    gathers at most MLA_GROUP_TOKENS padded tokens."""
    order = sorted(range(len(rows)), key=lambda i: rows.totals[i])
    w_k, w_v = w_kc.to(q.dtype), w_vc.to(q.dtype)
    start = 0
    while start < len(order):
        end = start + 1
        while end < len(order) and (end - start + 1) * rows.totals[order[end]] <= MLA_GROUP_TOKENS:
            end += 1
        pick = torch.tensor(order[start:end], dtype=torch.long, device=q.device)
        tok, req = rows.tok_t[pick], rows.req_t[pick]
        totals = torch.tensor([rows.totals[i] for i in order[start:end]], dtype=torch.long, device=q.device)
        t_max = rows.totals[order[end - 1]]
        c = _latent(cache, meta, req, totals, t_max, w_kc.shape[-1], q.dtype)
        mask = _visible(sel[tok] if sel is not None else None, totals, t_max, kpool, with_tail)
        q_abs = torch.einsum("bhd,hdr->bhr", q[tok], w_k)
        scores = (torch.einsum("bhr,btr->bht", q_abs, c) * scale).float().masked_fill(~mask[:, None], float("-inf"))
        p = torch.softmax(scores, dim=-1).to(q.dtype)
        out[tok] = torch.einsum("bhr,hvr->bhv", torch.einsum("bht,btr->bhr", p, c), w_v)
        start = end
