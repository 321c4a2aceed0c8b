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
upper bounds. The per-row layouts of every meta a replay uses (positions, latent slots, the draft
layer's source rows; the rollback's from the kept counts) are computed on the host beside them:
on a small model each launch of index arithmetic in the graph costs as much as a layer's kernel.
Pad rows decode the reserved pad slot and page at position 1 (their snapshot slot is the pad
slot). Greedy only: a sampled request needs its draws from its own generator in order,
and rejection sampling on the host; such steps run eager.
"""

from __future__ import annotations

import numpy as np
import torch

from backends.meta import BatchMeta
from glmrt.engine.cuda_graphs import batch_buckets, page_buckets
from glmrt.engine.rollback import Capture, replay


class HostFields:
    """Named int64 fields of one flat buffer: the host fills a pinned copy through numpy views (`h`),
    one copy refreshes the device buffer whose views (`d`) the graphs read."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], device: torch.device, pin: bool):
        self.offsets, at = {}, 0
        for name, shape in shapes.items():  # each field 16-byte aligned (backends.meta.host_to_device)
            self.offsets[name] = at
            at += -(-int(np.prod(shape)) // 2) * 2
        self.host = torch.zeros(at, dtype=torch.long, pin_memory=pin)
        self.dev = torch.zeros(at, dtype=torch.long, device=device)
        flat = self.host.numpy()
        at = self.offsets
        self.h = {k: flat[at[k]: at[k] + int(np.prod(s))].reshape(s) for k, s in shapes.items()}
        self.d = {k: self.dev[at[k]: at[k] + int(np.prod(s))].view(s) for k, s in shapes.items()}

    def upload(self, end: int | None = None) -> None:
        """The host copy's first `end` values (all by default) to the device, queued (pinned)."""
        end = self.host.numel() if end is None else end
        self.dev[:end].copy_(self.host[:end], non_blocking=True)


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
        mb, rows, k = self.max_bs, self.max_bs * self.t, self.k
        even = -(-mb // 2) * 2  # each draft step's row of dpos / dloc 16-byte aligned too
        pin = capture and torch.cuda.is_available()
        # per replay: the requests, each draft step's row per request, each verify row (the model's
        # and the draft layer's, one position back), the page table last (copied up to bs rows)
        self.buf = HostFields(dict(tok=(mb,), pre=(mb,), pre1=(mb,), slot=(mb,), snap=(mb,), dpos=(k, even),
                                   dloc=(k, even), vpos=(rows,), vloc=(rows,), xpos=(rows,), xloc=(rows,),
                                   hrow=(rows,), table=(mb, max_pages)), self.device, pin)
        # per rollback: the kept rows' layout
        self.back = HostFields(dict(cu=(mb + 1,), req=(rows,), pos=(rows,), loc=(rows,), xpos=(rows,), xloc=(rows,),
                                    sel=(rows,), last=(mb,)), self.device, pin)
        self.table = self.buf.d["table"]
        self.arange = torch.arange(rows + 1, dtype=torch.long, device=self.device)
        self.req_of = self.arange[:rows] // self.t   # verify row -> its request
        self.verify_cu = self.arange[: mb + 1] * self.t  # 0, T, 2T, ...: every request verifies T rows
        self.last_rows = self.arange[:mb] * self.t + self.t - 1  # each request's last verify row
        self._layouts: dict[int, tuple[np.ndarray, ...]] = {}
        self.replays = 0

    # ---- eligibility -----------------------------------------------------------------------
    def key(self, num_reqs: int, last_position: int) -> tuple[int, int] | None:
        """The bucket of a step of `num_reqs` drafting requests whose furthest verified position is
        `last_position` (None: too large, eager)."""
        bs = _bucket(num_reqs, self.bs_buckets)
        pages = _bucket(last_position // self.page_size + 1, self.page_buckets)
        return None if bs is None or pages is None else (bs, pages)

    # ---- the bodies ------------------------------------------------------------------------
    def _meta(self, bs: int, pages: int, positions, out_loc, req, prefix, cu, seq: int) -> BatchMeta:
        ps = self.page_size
        return BatchMeta(prefix_lens=[pages * ps - seq] * bs, seq_lens=[seq] * bs, positions=positions,
                         req_index=req, slot_ids=self.buf.d["slot"][:bs], page_table=self.table[:bs, :pages],
                         out_loc=out_loc, page_size=ps, prefix_lens_t=prefix, cu_seqlens_t=cu)

    def _cycle(self, bs: int, pages: int) -> tuple[torch.Tensor, Capture]:
        """Draft and verify -> ([bs, T + K] the model's argmax at each verified row, then the
        drafts; the verify's capture)."""
        drafts = self.draft_chain(bs, pages)
        verified, cap = self.verify(bs, pages, drafts)
        return torch.cat([verified, drafts], dim=1), cap

    def draft_chain(self, bs: int, pages: int) -> torch.Tensor:
        """K steps of the draft layer -> [bs, K] draft tokens (argmax)."""
        m, c, d = self.model, self.cache, self.buf.d
        tok, slot = d["tok"][:bs], d["slot"][:bs]
        ar = self.arange
        hidden = c.state.last_hidden[0][slot].to(m.dtype)
        chain = c.draft_chain(slot, m.ops)
        ids, drafts = tok, []
        for i in range(self.k):
            pos = d["dpos"][i, :bs]
            meta = self._meta(bs, pages, pos, d["dloc"][i, :bs], ar[:bs], pos, ar[: bs + 1], 1)
            hidden = m.mtp(m.model.embed(ids), hidden, meta, chain)
            ids = m.compute_logits(hidden).argmax(dim=-1)
            drafts.append(ids)
            chain = c.draft_chain(None, m.ops)
        return torch.stack(drafts, dim=1)

    def verify(self, bs: int, pages: int, drafts: torch.Tensor) -> tuple[torch.Tensor, Capture]:
        """The model over each request's next token and its drafts, the draft layer over the same
        positions -> ([bs, T] the model's argmax at each row, the capture the rollback replays)."""
        m, c, d = self.model, self.cache, self.buf.d
        t = self.t
        tok, pre, slot, snap = (d[f][:bs] for f in ("tok", "pre", "slot", "snap"))
        last = c.state.last_hidden[0]
        ids = torch.cat([tok[:, None], drafts], dim=1).reshape(-1)
        n = bs * t
        req = self.req_of[:n]
        m.ops.copy_slots(c.state.tensors, slot, snap)
        cu = self.verify_cu[: bs + 1]
        meta = self._meta(bs, pages, d["vpos"][:n], d["vloc"][:n], req, pre, cu, t)
        cap = Capture(None, [t] * bs)  # every row drafts: the inputs are kept as they are, not gathered
        c.capture = cap
        try:
            logits, hid = m(ids, meta, c, logits_indices=None)
            cap.hidden = cap.select(hid)
            # the draft layer over the same positions, shifted back by one (runner._draft_extend): a
            # request's first row takes the slot's kept hidden state, the others the previous row's
            src = torch.cat([hid, last[slot].to(hid.dtype)])
            dmeta = self._meta(bs, pages, d["xpos"][:n], d["xloc"][:n], req, d["pre1"][:bs], cu, t)
            m.mtp(m.model.embed(ids), src[d["hrow"][:n]], dmeta, c)
        finally:
            c.capture = None
        last[slot] = hid[self.last_rows[:bs]].to(last.dtype)
        return logits.argmax(dim=-1).view(bs, t), cap

    def rollback(self, bs: int, pages: int, cap: Capture) -> None:
        """Every snapshot back into its slot, then the stateful ops over each request's first n rows."""
        t, d, b = self.t, self.buf.d, self.back.d
        pre, pre1, slot, snap = (d[f][:bs] for f in ("pre", "pre1", "slot", "snap"))
        rows = bs * t
        cu, req = b["cu"][: bs + 1], b["req"][:rows]
        self.model.ops.copy_slots(self.cache.state.tensors, snap, slot)
        meta = self._meta(bs, pages, b["pos"][:rows], b["loc"][:rows], req, pre, cu, t)
        dmeta = self._meta(bs, pages, b["xpos"][:rows], b["xloc"][:rows], req, pre1, cu, t)
        replay(self.model, self.cache, cap, b["sel"][:rows], meta, dmeta, b["last"][:bs], slot)

    # ---- capture ---------------------------------------------------------------------------
    def _fill_pad(self, bs: int, pages: int) -> None:
        self._set_requests(bs, pages, [], [], [], [], [])
        self._set_kept(bs, [])

    def _set_requests(self, bs: int, pages: int, tokens: list[int], starts: list[int], slots: list[int],
                      snaps: list[int], page_tables: list[list[int]]) -> None:
        """The host buffer for a replay of bucket (bs, pages): request r < len(tokens) as given, the
        rest pad rows; every meta's rows from them; then the copy to the device."""
        h, n, t, ps = self.buf.h, len(tokens), self.t, self.page_size
        h["tok"][:n], h["pre"][:n], h["slot"][:n], h["snap"][:n] = tokens, starts, slots, snaps
        h["tok"][n:bs], h["pre"][n:bs], h["slot"][n:bs], h["snap"][n:bs] = 0, 1, self.pad_slot, self.pad_slot
        table = h["table"]
        table[:bs, :pages] = -1
        for r, pt in enumerate(page_tables):
            k = min(len(pt), pages)
            table[r, :k] = pt[:k]
        table[n:bs, 0] = self.pad_page
        req, j, hrow = self._layout(bs)
        pre = h["pre"][:bs]
        h["pre1"][:bs] = pre - 1
        # every meta's rows in one table lookup: the K draft steps' (request b at pre - 1 + i),
        # the verify's (pre + j) and the draft layer's over them (pre + j - 1)
        pos = pre[req] + j
        loc = table[req, pos // ps] * ps + pos % ps
        k, rows = self.k * bs, bs * t
        h["dpos"][:, :bs], h["dloc"][:, :bs] = pos[:k].reshape(self.k, bs), loc[:k].reshape(self.k, bs)
        h["vpos"][:rows], h["vloc"][:rows] = pos[k: k + rows], loc[k: k + rows]
        h["xpos"][:rows], h["xloc"][:rows] = pos[k + rows:], loc[k + rows:]
        h["hrow"][:rows] = hrow
        self.buf.upload(self.buf.offsets["table"] + bs * self.max_pages)

    def _set_kept(self, bs: int, kept: list[int]) -> None:
        """The rollback's host buffer: request r keeps its first kept[r] rows (pad rows all T), then
        the copy to the device. Rows past the kept ones are laid out as the last kept row (the
        ops bound their rows by cu and leave them alone)."""
        h, t = self.back.h, self.t
        n = np.full(bs, t, dtype=np.int64)
        n[: len(kept)] = kept
        cu = h["cu"][: bs + 1]
        cu[0] = 0
        np.cumsum(n, out=cu[1:])
        rows = bs * t
        req = np.repeat(np.arange(bs), n)
        j = np.arange(cu[bs]) - cu[req]
        pad = rows - int(cu[bs])
        req, j = np.concatenate([req, np.full(pad, bs - 1)]), np.concatenate([j, np.full(pad, n[-1] - 1)])
        h["req"][:rows] = req
        h["sel"][:rows] = req * t + j
        req = np.concatenate([req, req])  # the model's rows, then the draft layer's one position back
        pos = self.buf.h["pre"][req] + np.concatenate([j, j - 1])
        loc = self.buf.h["table"][req, pos // self.page_size] * self.page_size + pos % self.page_size
        h["pos"][:rows], h["loc"][:rows] = pos[:rows], loc[:rows]
        h["xpos"][:rows], h["xloc"][:rows] = pos[rows:], loc[rows:]
        h["last"][:bs] = np.arange(bs) * t + n - 1
        self.back.upload()

    def _layout(self, bs: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Bucket bs's static row layout: (request, offset from pre) of each draft-step row, verify
        row and draft-layer row in that order, and each draft-layer row's source hidden row."""
        if bs not in self._layouts:
            t, rows = self.t, bs * self.t
            vreq, vj = np.arange(rows) // t, np.arange(rows) % t
            req = np.concatenate([np.tile(np.arange(bs), self.k), vreq, vreq])
            j = np.concatenate([np.repeat(np.arange(self.k) - 1, bs), vj, vj - 1])
            self._layouts[bs] = req, j, np.where(vj == 0, rows + vreq, np.arange(rows) - 1)
        return self._layouts[bs]

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
        self._set_requests(bs, pages, tokens, starts, slots, snaps, page_tables)
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
        self._set_kept(bs, kept)
        _, rollback, _, cap = self.graphs[key]
        if rollback is None:
            self.rollback(bs, pages, cap)
        else:
            rollback.replay()
