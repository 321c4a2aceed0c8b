"""CUDA graphs of a speculating engine's decode step: the draft chain and the verify in one graph,
the rollback in a second (one rank; every request of the step greedy and drafting K tokens).

Eager, a speculative cycle launches the draft layer K times and the whole model once with Python
in between every kernel; on a small model that host time is the cycle (bench/RESULTS.md). Here
one replay runs, per request b of a batch bucket (bs, pages):

    draft   K steps of the MTP layer, each from the previous step's hidden state and argmax token
            (step 0 from the slot's kept hidden state and the request's next input token x_c)
    verify  snapshot of the slot into its rollback slot; the model over x_c, d_1..d_K at positions
            c..c+K (T = K + 1 rows per request, every row with logits), keeping the stateful ops'
            inputs (glmrt.engine.rollback.Capture); the draft layer over the same positions; the
            kept hidden state; the model's argmax at every row

and the host reads [bs, T + K] token ids once (the model's tokens, then the drafts). It keeps the
run the model agreed with, cut by stop tokens and max_tokens as the eager path does, and when any
request keeps n < T tokens a second replay restores every snapshot and replays the stateful ops
over each request's first n rows (n from a device buffer; rows past n are laid out but not
computed), so the state is the eager rollback's.

Every per-request value lives in device buffers filled by one host-to-device copy per replay
(as glmrt.engine.cuda_graphs does for decode); the Python lengths of the metas are the bucket's
upper bounds. Pad rows decode the reserved pad slot and page at position 1 (their snapshot slot is
the pad slot). Greedy only: a sampled request needs its draws from its own generator in order,
and rejection sampling on the host; such steps run eager.
"""

from __future__ import annotations

import numpy as np
import torch

from backends.meta import BatchMeta
from glmrt.engine.cuda_graphs import batch_buckets, page_buckets
from glmrt.engine.rollback import Capture, replay

_FIELDS = ("tok", "pre", "slot", "snap")  # one row each in the host buffer, then the page table


def _bucket(value: int, buckets: list[int]) -> int | None:
    return next((b for b in buckets if value <= b), None)


class SpecGraphs:
    def __init__(self, model, cache, steps: int, *, max_bs: int, max_pages: int, pad_slot: int, pad_page: int,
                 capture: bool = True):
        self.model, self.cache = model, cache
        self.k, self.t = steps, steps + 1
        self.page_size = cache.page_size
        if self.t + 1 > self.page_size:
            raise ValueError(f"speculative CUDA graphs need page_size > K + 1 (pad rows), got {self.page_size}")
        self.device = model.device
        self.max_bs = max(1, min(max_bs, 512 // self.t))  # bs * (K + 1) rows per verify
        self.max_pages = max_pages
        self.pad_slot, self.pad_page = pad_slot, pad_page
        self.bs_buckets = batch_buckets(self.max_bs)
        self.page_buckets = page_buckets(max_pages)
        self.capture_graphs = capture  # False: every run executes the bodies eagerly (CPU tests)
        self.graphs: dict[tuple[int, int], tuple] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        nf, mb = len(_FIELDS), self.max_bs
        self._width = nf * mb + mb * max_pages
        pin = capture and torch.cuda.is_available()
        self._host = torch.empty(self._width, dtype=torch.long, pin_memory=pin)
        self._host_n = torch.empty(mb, dtype=torch.long, pin_memory=pin)
        self.dev = torch.zeros(self._width, dtype=torch.long, device=self.device)
        self.n_dev = torch.zeros(mb, dtype=torch.long, device=self.device)
        self.buf = dict(zip(_FIELDS, self.dev[: nf * mb].view(nf, mb)))
        self.table = self.dev[nf * mb:].view(mb, max_pages)
        rows = mb * self.t
        self.arange = torch.arange(rows + 1, dtype=torch.long, device=self.device)
        self.req_of = self.arange[:rows] // self.t   # verify row -> its request
        self.pos_of = self.arange[:rows] % self.t    # verify row -> its offset j
        self.replays = 0

    # ---- eligibility -----------------------------------------------------------------------
    def key(self, num_reqs: int, last_position: int) -> tuple[int, int] | None:
        """The bucket of a step of `num_reqs` drafting requests whose furthest verified position is
        `last_position` (None: too large, eager)."""
        bs = _bucket(num_reqs, self.bs_buckets)
        pages = _bucket(last_position // self.page_size + 1, self.page_buckets)
        return None if bs is None or pages is None else (bs, pages)

    # ---- the bodies ------------------------------------------------------------------------
    def _meta(self, bs: int, pages: int, positions, req, prefix, cu, seq: int) -> BatchMeta:
        ps = self.page_size
        table = self.table[:bs, :pages]
        out_loc = table[req, positions // ps] * ps + positions % ps
        return BatchMeta(prefix_lens=[pages * ps - seq] * bs, seq_lens=[seq] * bs, positions=positions,
                         req_index=req, slot_ids=self.buf["slot"][:bs], page_table=table, out_loc=out_loc,
                         page_size=ps, prefix_lens_t=prefix, cu_seqlens_t=cu)

    def _cycle(self, bs: int, pages: int) -> tuple[torch.Tensor, Capture]:
        """Draft and verify -> ([bs, T + K] the model's argmax at each verified row, then the
        drafts; the verify's capture)."""
        drafts = self.draft_chain(bs, pages)
        verified, cap = self.verify(bs, pages, drafts)
        return torch.cat([verified, drafts], dim=1), cap

    def draft_chain(self, bs: int, pages: int) -> torch.Tensor:
        """K steps of the draft layer -> [bs, K] draft tokens (argmax)."""
        m, c = self.model, self.cache
        tok, pre, slot = (self.buf[f][:bs] for f in ("tok", "pre", "slot"))
        ar = self.arange
        hidden = c.state.last_hidden[0][slot].to(m.dtype)
        chain = c.draft_chain(slot)
        ids, drafts = tok, []
        for i in range(self.k):
            pos = pre - 1 + i
            meta = self._meta(bs, pages, pos, ar[:bs], pos, ar[: bs + 1], 1)
            hidden = m.mtp(m.model.embed(ids), hidden, meta, chain)
            ids = m.compute_logits(hidden).argmax(dim=-1)
            drafts.append(ids)
            chain = c.draft_chain(None)
        return torch.stack(drafts, dim=1)

    def verify(self, bs: int, pages: int, drafts: torch.Tensor) -> tuple[torch.Tensor, Capture]:
        """The model over each request's next token and its drafts, the draft layer over the same
        positions -> ([bs, T] the model's argmax at each row, the capture the rollback replays)."""
        m, c = self.model, self.cache
        t = self.t
        tok, pre, slot, snap = (self.buf[f][:bs] for f in _FIELDS)
        ar = self.arange
        last = c.state.last_hidden[0]
        ids = torch.cat([tok[:, None], drafts], dim=1).reshape(-1)
        n = bs * t
        req, j = self.req_of[:n], self.pos_of[:n]
        c.state.copy_slots(slot, snap)
        cu = ar[: bs + 1] * t
        meta = self._meta(bs, pages, pre[req] + j, req, pre, cu, t)
        cap = Capture(None, [t] * bs)  # every row drafts: the inputs are kept as they are, not gathered
        c.capture = cap
        try:
            logits, hid = m(ids, meta, c, logits_indices=None)
            cap.hidden = cap.select(hid)
            # the draft layer over the same positions, shifted back by one (runner._draft_extend)
            src = torch.cat([hid, last[slot].to(hid.dtype)])
            h_rows = torch.where(j == 0, n + req, ar[:n] - 1)
            dmeta = self._meta(bs, pages, pre[req] + j - 1, req, pre - 1, cu, t)
            m.mtp(m.model.embed(ids), src[h_rows], dmeta, c)
        finally:
            c.capture = None
        last[slot] = hid[ar[:bs] * t + t - 1].to(last.dtype)
        return logits.argmax(dim=-1).view(bs, t), cap

    def rollback(self, bs: int, pages: int, cap: Capture) -> None:
        """Every snapshot back into its slot, then the stateful ops over each request's first n rows."""
        t = self.t
        pre, slot, snap = (self.buf[f][:bs] for f in ("pre", "slot", "snap"))
        n = self.n_dev[:bs]
        rows = bs * t
        ar = self.arange
        cu = torch.cat([ar[:1], torch.cumsum(n, 0)])
        req = torch.searchsorted(cu[1:], ar[:rows], right=True).clamp_(max=bs - 1)
        j = ar[:rows] - cu[req]
        sel = torch.where(ar[:rows] < cu[bs], req * t + j, 0)  # rows past the kept ones: any row, unused
        self.cache.state.copy_slots(snap, slot)
        meta = self._meta(bs, pages, pre[req] + j, req, pre, cu, t)
        dmeta = self._meta(bs, pages, pre[req] + j - 1, req, pre - 1, cu, t)
        replay(self.model, self.cache, cap, sel, meta, dmeta, ar[:bs] * t + n - 1, slot)

    # ---- capture ---------------------------------------------------------------------------
    def _fill_pad(self, bs: int, pages: int) -> None:
        b = self.buf
        b["tok"][:bs].zero_()
        b["pre"][:bs].fill_(1)
        b["slot"][:bs].fill_(self.pad_slot)
        b["snap"][:bs].fill_(self.pad_slot)
        self.table[:bs, :pages].fill_(-1)
        self.table[:bs, 0] = self.pad_page
        self.n_dev[:bs].fill_(self.t)

    @torch.no_grad()
    def capture(self, bs: int, pages: int) -> None:
        if (bs, pages) in self.graphs:
            return
        self._fill_pad(bs, pages)
        if not self.capture_graphs:
            self.graphs[(bs, pages)] = (None, None, None, None)
            return
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile and autotune outside the capture
                _, cap = self._cycle(bs, pages)
                self.rollback(bs, pages, cap)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        cycle, rollback = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(cycle, pool=self.pool):
            out, cap = self._cycle(bs, pages)
        with torch.cuda.graph(rollback, pool=self.pool):
            self.rollback(bs, pages, cap)
        self.graphs[(bs, pages)] = (cycle, rollback, out, cap)

    def warmup_keys(self, upto_tokens: int = 4096) -> list[tuple[int, int]]:
        keys = [(bs, p) for bs in self.bs_buckets for p in self.page_buckets
                if p * self.page_size <= max(upto_tokens, self.page_buckets[0] * self.page_size)]
        return sorted(keys, reverse=True)

    def warmup(self, keys: list[tuple[int, int]] | None = None, *, upto_tokens: int = 4096) -> int:
        keys = self.warmup_keys(upto_tokens) if keys is None else [tuple(k) for k in keys]
        for bs, pages in keys:
            self.capture(bs, pages)
        return len(keys)

    # ---- replay ----------------------------------------------------------------------------
    @torch.no_grad()
    def run(self, key: tuple[int, int], tokens: list[int], starts: list[int], slots: list[int], snaps: list[int],
            page_tables: list[list[int]]) -> np.ndarray:
        """Draft and verify the requests (request r: next input token tokens[r] at position
        starts[r]) -> [n, T + K] int64 on the host: the model's token at each verified row, then
        the drafts. Waits for the GPU (the host needs the tokens)."""
        bs, pages = key
        if key not in self.graphs:
            self.capture(bs, pages)
        n = len(tokens)
        nf, mb = len(_FIELDS), self.max_bs
        hn = self._host.numpy()
        h = hn[: nf * mb].reshape(nf, mb)
        table = hn[nf * mb:].reshape(mb, self.max_pages)
        h[0, :n], h[1, :n], h[2, :n], h[3, :n] = tokens, starts, slots, snaps
        h[0, n:bs], h[1, n:bs], h[2, n:bs], h[3, n:bs] = 0, 1, self.pad_slot, self.pad_slot
        table[:bs, :pages] = -1
        for r, pt in enumerate(page_tables):
            k = min(len(pt), pages)
            table[r, :k] = pt[:k]
        table[n:bs, 0] = self.pad_page
        end = nf * mb + bs * self.max_pages
        self.dev[:end].copy_(self._host[:end], non_blocking=True)
        cycle, _, out, cap = self.graphs[key]
        if cycle is None:
            out, cap = self._cycle(bs, pages)
            self.graphs[key] = (None, None, out, cap)
        else:
            cycle.replay()
        self.replays += 1
        return out[:n].cpu().numpy()

    @torch.no_grad()
    def roll_back(self, key: tuple[int, int], kept: list[int]) -> None:
        """After `run` on the same key: request r keeps its first kept[r] verified tokens."""
        bs, pages = key
        n = len(kept)
        self._host_n[:n] = torch.tensor(kept, dtype=torch.long)
        self._host_n[n:bs] = self.t
        self.n_dev[:bs].copy_(self._host_n[:bs], non_blocking=True)
        _, rollback, _, cap = self.graphs[key]
        if rollback is None:
            self.rollback(bs, pages, cap)
        else:
            rollback.replay()
