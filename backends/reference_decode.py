"""The reference ops' short runs, batched over requests.

A short run is up to SHORT_RUN new tokens of a request that has history: a decode token, a
speculative verify run, a rollback's replay. The reference ops loop over requests, which at a
CPU decode step of 100 requests cost ~0.4 ms a request and op: most of the step. Here the
short runs of a batch go through each op at once, with the formulas of the per-request loop's
one-token path: the attention and the indexer's selection take each token as a query row
(padded to the longest, the padding masked out), the convolution and KDA step through the
runs' tokens in turn, batched over the runs of each length. ReferenceOps keeps its loop for
prefill runs (and the indexer's pooling for runs of more than one token).

Every function takes the `ShortRuns` of the batch (`short_runs(meta)`, built once per forward)
and the op's own arguments, and writes its outputs and caches in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import kv_fp8
from .meta import BatchMeta

SHORT_RUN = 8  # the most new tokens of a request (with history) taken as a short run
# Query rows x padded tokens gathered at once by the sparse MLA (its latent rows and scores):
# bounds the memory a batch of long contexts takes, ~128 MB of a 512-wide fp32 latent.
MLA_GROUP_TOKENS = 1 << 16


class ShortRuns:
    """A batch's short runs, their tokens as query rows, and the index tensors the ops build from
    them once per forward (the same in every layer; a decode step's ops are small, and rebuilding
    them per layer cost a one-request step ~15%)."""

    def __init__(self, meta: BatchMeta, device: torch.device):
        cu = meta.cu_seqlens
        self.reqs = {r for r, (p, s) in enumerate(zip(meta.prefix_lens, meta.seq_lens)) if 1 <= s <= SHORT_RUN and p > 0}
        self.decode_reqs = {r for r in self.reqs if meta.seq_lens[r] == 1}
        self.order = order = sorted(self.reqs)
        # one row per token: its flat index, its request, the tokens its query sees (host)
        row_req = [r for r in order for _ in range(meta.seq_lens[r])]
        self.totals = [meta.prefix_lens[r] + i + 1 for r in order for i in range(meta.seq_lens[r])]
        self.req_t = torch.tensor(row_req, dtype=torch.long, device=device)
        self.tok_t = torch.tensor([cu[r] + i for r in order for i in range(meta.seq_lens[r])], dtype=torch.long,
                                  device=device)
        self.slots = meta.slot_ids.to(device)[self.req_t]
        self.is_decode = [meta.seq_lens[r] == 1 for r in row_req]
        self.meta, self.device = meta, device
        self._memo: dict = {}

    def __len__(self) -> int:
        return len(self.totals)

    def memo(self, key, build):
        """build(), once per forward under `key`."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def select(self, keep: list[bool]) -> tuple[torch.Tensor, ...] | None:
        """(token, request, slot) index tensors of the rows where keep; None when none is kept."""
        if not any(keep):
            return None
        if all(keep):
            return self.tok_t, self.req_t, self.slots
        pick = torch.tensor([i for i, k in enumerate(keep) if k], dtype=torch.long, device=self.device)
        return self.tok_t[pick], self.req_t[pick], self.slots[pick]

    def by_length(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The runs grouped by length: ([B, T] flat token indices, [B] state slots) per length."""
        def build():
            meta, cu = self.meta, self.meta.cu_seqlens
            slot_ids = meta.slot_ids.to(self.device)
            out = []
            for n in sorted({meta.seq_lens[r] for r in self.order}):
                reqs = [r for r in self.order if meta.seq_lens[r] == n]
                toks = torch.tensor([[cu[r] + i for i in range(n)] for r in reqs], dtype=torch.long, device=self.device)
                out.append((toks, slot_ids[torch.tensor(reqs, dtype=torch.long, device=self.device)]))
            return out
        return self.memo("by-length", build)


def short_runs(meta: BatchMeta, device: torch.device) -> ShortRuns:
    """The batch's short runs (shared by every layer of the forward, through meta.derived)."""
    key = ("reference-short-runs", str(device))
    if key not in meta.derived:
        meta.derived[key] = ShortRuns(meta, device)
    return meta.derived[key]


def causal_conv(x: torch.Tensor, out: torch.Tensor, conv_state: torch.Tensor, w: torch.Tensor,
                rows: ShortRuns) -> None:
    """out[tok] = SiLU(conv over the slot's K-1 kept inputs and the run's); the slot keeps the last
    K-1. w [K, C] fp32, row j multiplying the input j steps back (ReferenceOps.causal_conv's)."""
    k = w.shape[0]
    for toks, slots in rows.by_length():
        n = toks.shape[1]
        seq = torch.cat([conv_state[slots].float(), x[toks].float()], dim=1)  # [B, K-1+T, C]
        acc = torch.zeros(toks.shape[0], n, x.shape[1], dtype=torch.float32, device=x.device)
        for j in range(k):
            acc += w[j] * seq[:, k - 1 - j:k - 1 - j + n]
        out[toks] = F.silu(acc).to(out.dtype)
        if k > 1:
            conv_state[slots] = seq[:, n:].to(conv_state.dtype)


def kda_steps(q, k, v, g, beta, out: torch.Tensor, state: torch.Tensor, rows: ShortRuns) -> None:
    """The delta rule token by token through each run (q, k normalised, fp32 inputs), in place on
    the slots."""
    for toks, slots in rows.by_length():
        s = state[slots].float()  # [B, H, dk, dv]
        for i in range(toks.shape[1]):
            tok = toks[:, i]
            s = s * g[tok].exp()[..., None]
            kt = k[tok]
            delta = (v[tok] - torch.einsum("bhkv,bhk->bhv", s, kt)) * beta[tok][..., None]
            s = s + kt[..., None] * delta[:, :, None, :]
            out[tok] = torch.einsum("bhkv,bhk->bhv", s, q[tok])
        state[slots] = s.to(state.dtype)


def indexer_update(k: torch.Tensor, g: torch.Tensor, ape32: torch.Tensor, pooled: torch.Tensor,
                   tail_k: torch.Tensor, tail_g: torch.Tensor, kpool: int, rows: ShortRuns) -> None:
    """The one-token runs: each row's key and gate join its slot's tail; a row that completes its
    pool writes the pool's key (softmax over the pool's gates + position embedding, in fp32)."""
    def build():
        one = rows.is_decode
        done = [d and t % kpool == 0 for t, d in zip(rows.totals, one)]
        still = [d and t % kpool != 0 for t, d in zip(rows.totals, one)]
        at = torch.tensor([(t - 1) % kpool for t, o in zip(rows.totals, still) if o], dtype=torch.long,
                          device=rows.device)
        pools_per_page = rows.meta.page_size // kpool
        closed = rows.select(done)
        if closed is not None:
            pool = torch.tensor([t // kpool - 1 for t, d in zip(rows.totals, done) if d], dtype=torch.long,
                                device=rows.device)
            pages = rows.meta.page_table.to(rows.device)[closed[1], pool // pools_per_page]
            closed = (closed[0], closed[2], pages, pool % pools_per_page)
        return rows.select(still), at, closed

    open_, at, closed = rows.memo(("indexer-update", kpool), build)
    if open_ is not None:
        tok, _, slots = open_
        tail_k[slots, at] = k[tok].to(tail_k.dtype)
        tail_g[slots, at] = g[tok].to(tail_g.dtype)
    if closed is not None:
        tok, slots, pages, within = closed
        kk = torch.cat([tail_k[slots, :kpool - 1].to(k.dtype), k[tok][:, None]], dim=1)  # [B, kpool, di]
        gg = torch.cat([tail_g[slots, :kpool - 1].to(g.dtype), g[tok][:, None]], dim=1)
        probs = torch.softmax(gg.float() + ape32, dim=1).to(kk.dtype)
        pooled[pages, within] = ((probs * kk).sum(dim=1)).to(pooled.dtype)


def indexer_select(q: torch.Tensor, w32: torch.Tensor, pooled: torch.Tensor, sel: torch.Tensor,
                   kpool: int, topk_pools: int, rows: ShortRuns) -> None:
    """sel[tok]: every complete pool when there are at most topk_pools (the query sits past all of
    them), else the topk_pools best by the indexer score, ties to the lower index. w32: the
    head weights in fp32 (head_weights)."""
    def build():
        n_pools = [t // kpool for t in rows.totals]
        few = rows.select([n <= topk_pools for n in n_pools])
        if few is not None:
            width = min(topk_pools, max(n_pools))
            ids = torch.arange(width, device=rows.device)
            own = ids[None, :] < torch.tensor([n for n in n_pools if n <= topk_pools], device=rows.device)[:, None]
            few = (few[0], width, torch.where(own, ids[None, :], -1))
        many = rows.select([n > topk_pools for n in n_pools])
        if many is not None:
            n_max = max(n_pools)
            ids = torch.arange(n_max, device=rows.device)
            pools_per_page = rows.meta.page_size // kpool
            pages = rows.meta.page_table.to(rows.device)[many[1]][:, ids // pools_per_page].clamp_min(0)
            beyond = ids[None, :] >= torch.tensor([n for n in n_pools if n > topk_pools], device=rows.device)[:, None]
            # past a row's own pools the keys are whatever its page-table padding points at: masked
            many = (many[0], pages, (ids % pools_per_page)[None, :], beyond)
        return few, many

    few, many = rows.memo(("indexer-select", kpool, topk_pools), build)
    if few is not None:
        tok, width, chosen = few
        sel[tok, :width] = chosen
    if many is not None:
        tok, pages, within, beyond = many
        keys = pooled[pages, within].float()  # [B, n_max, di]
        scores = torch.relu(torch.einsum("bhd,bpd->bhp", q[tok].float(), keys) * q.shape[-1] ** -0.5)
        index = torch.einsum("bh,bhp->bp", w32[tok], scores).masked_fill(beyond, float("-inf"))
        sel[tok] = torch.sort(index, dim=-1, descending=True, stable=True).indices[:, :topk_pools]


def token_mask(sel: torch.Tensor | None, pos: torch.Tensor, total: int, kpool: int,
               with_tail: bool) -> torch.Tensor:
    """[S, T] bool, T = total: token t visible to the query at position pos[s] (t <= pos, and with
    a selection sel [S, K] of pool indices (-1 = none): t in a selected pool, or with_tail in the
    query's incomplete pool)."""
    t = torch.arange(total, device=pos.device)
    causal = t[None, :] <= pos[:, None]
    if sel is None:
        return causal
    pool_of = t // kpool
    chosen = torch.zeros(pos.shape[0], total // kpool + 1, dtype=torch.bool, device=pos.device)
    valid = sel >= 0
    chosen.scatter_(1, torch.where(valid, sel, total // kpool), valid)  # the last column catches -1
    chosen[:, -1] = False
    mask = chosen[:, pool_of] & causal
    if with_tail:
        tail_start = ((pos + 1) // kpool) * kpool
        mask |= (t[None, :] >= tail_start[:, None]) & causal
    return mask


class _MlaGroup:
    """Rows of similar length attended together: their latent tokens' locations, the rows'
    positions, and which tokens lie past each row's own."""

    def __init__(self, rows: ShortRuns, pick: list[int]):
        meta, dev = rows.meta, rows.device
        index = torch.tensor(pick, dtype=torch.long, device=dev)
        self.tok = rows.tok_t[index]
        self.pos = torch.tensor([rows.totals[i] - 1 for i in pick], dtype=torch.long, device=dev)
        self.t_max = max(rows.totals[i] for i in pick)
        ps = meta.page_size
        pages = meta.page_table.to(dev)[rows.req_t[index]][:, :-(-self.t_max // ps)].clamp_min(0)
        self.locs = (pages[:, :, None] * ps + torch.arange(ps, device=dev)).flatten(1)[:, :self.t_max]
        # past a row's own tokens: unwritten slots, zeroed (a zero probability times NaN is NaN)
        self.past = torch.arange(self.t_max, device=dev)[None, :] > self.pos[:, None]


def _mla_groups(rows: ShortRuns) -> list[_MlaGroup]:
    """Rows by length, each group gathering at most MLA_GROUP_TOKENS padded tokens."""
    order = sorted(range(len(rows)), key=lambda i: rows.totals[i])
    groups, start = [], 0
    while start < len(order):
        end = start + 1
        while end < len(order) and (end - start + 1) * rows.totals[order[end]] <= MLA_GROUP_TOKENS:
            end += 1
        groups.append(_MlaGroup(rows, order[start:end]))
        start = end
    return groups


def sparse_mla(q: torch.Tensor, cache: torch.Tensor, w_kc: torch.Tensor, w_vc: torch.Tensor,
               sel: torch.Tensor | None, out: torch.Tensor, kpool: int, scale: float, with_tail: bool,
               rows: ShortRuns) -> None:
    """out[tok]: each row's query over its visible latent tokens in the absorbed form (scores
    against the latent, values read back through w_vc)."""
    w_k, w_v = w_kc.to(q.dtype), w_vc.to(q.dtype)
    flat = cache.view(-1, cache.shape[-1])
    for grp in rows.memo("mla-groups", lambda: _mla_groups(rows)):
        c = flat[grp.locs]
        c = kv_fp8.dequantize_rows(c, w_kc.shape[-1], q.dtype) if c.dtype == torch.uint8 else c.to(q.dtype)
        c = c.masked_fill(grp.past[..., None], 0)
        mask = token_mask(sel[grp.tok] if sel is not None else None, grp.pos, grp.t_max, kpool, with_tail)
        q_abs = torch.einsum("bhd,hdr->bhr", q[grp.tok], w_k)
        scores = (torch.einsum("bhr,btr->bht", q_abs, c) * scale).float().masked_fill(~mask[:, None], float("-inf"))
        p = torch.softmax(scores, dim=-1).to(q.dtype)
        out[grp.tok] = torch.einsum("bhr,hvr->bhv", torch.einsum("bht,btr->bhr", p, c), w_v)
