"""Decode CUDA graphs: one captured forward per (batch bucket, context bucket).

A decode step launches a few hundred small kernels; replaying a captured graph launches
them all with one call, so the step costs the GPU time plus a handful of copies. Every op
on the decode path of a graph-safe kernel set (`ops.decode_graph_safe`) reads per-request
values only from device tensors of the BatchMeta; Python values in it are used for sizes,
so the capture meta carries the bucket's upper bounds:

    batch bucket   bs     the batch is padded to bs rows; pad rows decode position 0 of a
                          reserved pad slot and pad page (never handed out by the managers)
    context bucket pages  page_table is [bs, pages]; Python lengths say "pages * page_size"
                          so the indexer scores up to that many pools (-inf past a
                          request's own count, so the result is the same)

Static inputs live in one device buffer that the runner fills with a single host-to-device
copy from pinned memory per step. Graphs share one memory pool and are captured on first
use (largest first when warmed up explicitly).
"""

from __future__ import annotations

import numpy as np
import torch

from backends.meta import BatchMeta

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)
_FIELDS = ("ids", "positions", "slot_ids", "out_loc", "prefix", "src")  # one row each in the host buffer


def batch_buckets(max_bs: int) -> list[int]:
    out = [b for b in DEFAULT_BATCH_BUCKETS if b < max_bs]
    return out + [max_bs]


def page_buckets(max_pages: int, smallest: int = 16, factor: int = 4) -> list[int]:
    """Context buckets in pages: 16, 64, 256, ... (x4: few graphs; a request in a larger
    bucket only makes the indexer score more (-inf) pool slots, which costs little)."""
    out, p = [], smallest
    while p < max_pages:
        out.append(p)
        p *= factor
    return out + [max_pages]


def _bucket(value: int, buckets: list[int]) -> int | None:
    for b in buckets:
        if value <= b:
            return b
    return None


class DecodeGraphs:
    def __init__(self, model, cache, *, max_bs: int, max_pages: int, pad_slot: int, pad_page: int):
        self.model, self.cache = model, cache
        self.device = model.device
        self.page_size = cache.page_size
        self.max_bs, self.max_pages = max_bs, max_pages
        self.pad_slot, self.pad_page = pad_slot, pad_page
        self.bs_buckets = batch_buckets(max_bs)
        self.page_buckets = page_buckets(max_pages)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        nf = len(_FIELDS)
        # [fields..., page table] in one flat int64 buffer: one H2D copy per step
        self._width = nf * max_bs + max_bs * max_pages
        self._host = [torch.empty(self._width, dtype=torch.long).pin_memory() for _ in range(2)]
        self._host_ready = [None, None]
        self._flip = 0
        self.dev = torch.zeros(self._width, dtype=torch.long, device=self.device)
        rows = self.dev[: nf * max_bs].view(nf, max_bs)
        self.buf = dict(zip(_FIELDS, rows))
        self.table = self.dev[nf * max_bs:].view(max_bs, max_pages)
        self.arange = torch.arange(max_bs + 1, dtype=torch.long, device=self.device)
        self.replays = 0

    # ---- eligibility ---------------------------------------------------------------------
    def key(self, num_reqs: int, pages_needed: int) -> tuple[int, int] | None:
        bs = _bucket(num_reqs, self.bs_buckets)
        pages = _bucket(max(pages_needed, 1), self.page_buckets)
        if bs is None or pages is None:
            return None
        return bs, pages

    # ---- capture -------------------------------------------------------------------------
    def _meta(self, bs: int, pages: int) -> BatchMeta:
        b = self.buf
        return BatchMeta(prefix_lens=[pages * self.page_size - 1] * bs, seq_lens=[1] * bs,
                         positions=b["positions"][:bs], req_index=self.arange[:bs], slot_ids=b["slot_ids"][:bs],
                         page_table=self.table[:bs, :pages], out_loc=b["out_loc"][:bs], page_size=self.page_size,
                         prefix_lens_t=b["prefix"][:bs], cu_seqlens_t=self.arange[: bs + 1])

    def _fill_pad(self, bs: int, pages: int) -> None:
        b = self.buf
        b["ids"][:bs].zero_()
        b["positions"][:bs].zero_()
        b["prefix"][:bs].zero_()
        b["slot_ids"][:bs].fill_(self.pad_slot)
        b["out_loc"][:bs].fill_(self.pad_page * self.page_size)
        self.table[:bs, :pages].fill_(-1)
        self.table[:bs, 0] = self.pad_page

    def capture(self, bs: int, pages: int) -> None:
        if (bs, pages) in self.graphs:
            return
        self._fill_pad(bs, pages)
        meta = self._meta(bs, pages)
        ids = self.buf["ids"][:bs]
        # every row is a request's last token: logits for all rows, with no gather launch
        idx = None
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), torch.no_grad():
            for _ in range(2):  # compile and autotune outside the capture
                self.model(ids, meta, self.cache, logits_indices=idx)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool), torch.no_grad():
            logits, _ = self.model(ids, meta, self.cache, logits_indices=idx)
        self.graphs[(bs, pages)] = (graph, logits)

    def warmup_keys(self, upto_tokens: int = 4096) -> list[tuple[int, int]]:
        """Every batch bucket at the context buckets up to `upto_tokens`, largest first (later
        captures reuse its pool)."""
        keys = [(bs, p) for bs in self.bs_buckets for p in self.page_buckets
                if p * self.page_size <= max(upto_tokens, self.page_buckets[0] * self.page_size)]
        return sorted(keys, reverse=True)

    def warmup(self, keys: list[tuple[int, int]] | None = None, *, upto_tokens: int = 4096) -> int:
        """Capture ahead of traffic (a first-use capture stalls every running request): `keys`
        in their order (every rank of an engine captures the same ones in the same order), by
        default warmup_keys(upto_tokens)."""
        keys = self.warmup_keys(upto_tokens) if keys is None else [tuple(k) for k in keys]
        for bs, pages in keys:
            self.capture(bs, pages)
        return len(keys)

    # ---- replay --------------------------------------------------------------------------
    def run(self, key: tuple[int, int], ids: list[int], prefix_lens: list[int],
            slot_ids: list[int], page_tables: list[list[int]], *, src_rows: list[int] | None = None,
            prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Decode one token for each request -> logits [B, V], with no host synchronisation.

        ids are host values; where src_rows[r] >= 0 the input of row r is instead
        prev_tokens[src_rows[r]], a token the previous step sampled on the device and the host
        has not seen yet (the overlap schedule). The returned tensor is the graph's static
        output: consume it (in stream order) before the next run.
        """
        bs, pages = key
        if key not in self.graphs:
            self.capture(bs, pages)
        n = len(prefix_lens)
        ps = self.page_size
        host = self._host[self._flip]
        if self._host_ready[self._flip] is not None:
            self._host_ready[self._flip].synchronize()  # the copy that last read this buffer is done
        nf = len(_FIELDS)
        mb = self.max_bs
        hn = host.numpy()
        h = hn[: nf * mb].reshape(nf, mb)
        table = hn[nf * mb:].reshape(mb, self.max_pages)
        pos = np.asarray(prefix_lens, dtype=np.int64)
        h[:, n:bs] = 0
        h[1, :n] = pos
        h[4, :n] = pos
        h[2, :n] = slot_ids
        h[2, n:bs] = self.pad_slot
        table[:bs, :pages] = -1
        for r, pt in enumerate(page_tables):
            k = min(len(pt), pages)
            table[r, :k] = pt[:k]
        table[n:bs, 0] = self.pad_page
        page_of = table[np.arange(n), pos // ps]
        h[3, :n] = page_of * ps + pos % ps
        h[3, n:bs] = self.pad_page * ps
        h[0, :n] = ids
        h[5, :n] = src_rows if src_rows is not None else -1
        # one copy: the field rows (whole width: fixed layout) and the first bs table rows
        end = nf * mb + bs * self.max_pages
        self.dev[:end].copy_(host[:end], non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self._host_ready[self._flip] = ev
        self._flip ^= 1
        if prev_tokens is not None:
            src = self.buf["src"][:n]
            ids_dev = self.buf["ids"][:n]
            fed = prev_tokens.to(torch.long)[src.clamp(min=0)]
            ids_dev.copy_(torch.where(src >= 0, fed, ids_dev))
        graph, logits = self.graphs[key]
        graph.replay()
        self.replays += 1
        return logits[:n]
