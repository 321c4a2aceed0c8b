"""The model runner: executes a StepPlan on the model and its pools, then samples.

Order inside one step: restores (checkpoint -> live slot, partial page copies) ->
one forward over every work item that computes tokens (a flat varlen batch) -> saves and
forks (state and partial page copies, taken from the state the forward just produced; a
prompt-end save also keeps the prompt's last final hidden state) -> sampling of every request
whose last uncomputed token was computed, plus each n>1 child from its parent's row. A full
hit (a work item of 0 tokens) samples from the hidden state its restore brought into its slot.

A plan is first turned into `ForwardInputs` (glmrt.engine.ranks: host values only), which
`run` executes: the copies, the forward (eager or a decode graph), the copies after. On an
engine of several ranks rank 0 builds them and `run` publishes them before executing; the
other ranks execute what they receive with the same `run` (`follow`). Sampling is rank 0's.
The host tier's copies are issued by rank 0's tier as its scheduler decides them; the next
published step carries them (`host_ops`), and the other ranks perform them first.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import torch

from backends.meta import BatchMeta, host_to_device
from glmrt.cache.pools import ModelCache
from glmrt.engine.request import Request
from glmrt.engine.rollback import Capture, roll_back
from glmrt.engine.ranks import ForwardInputs, PlanLink, RankReport, RankWrite, StateCopy
from glmrt.engine.sampler import Sampler, SamplerRow, advance_generator
from glmrt.engine.scheduler import StepPlan
from glmrt.parallel import Parallel


_encoder = msgspec.msgpack.Encoder()
_reports = msgspec.msgpack.Decoder(list[RankReport])  # a rank's answer to op handoff_poll

PLACEHOLDER = -1
"""An output token sampled on the device whose value the host has not read yet (overlap)."""


@dataclass
class InFlight:
    """A decode step launched ahead of its predecessor's results (the overlap schedule)."""

    plan: StepPlan
    reqs: list[Request]          # sampled rows, in order
    tokens: torch.Tensor         # [len(reqs)] on the device
    row_of: dict[int, int]       # id(req) -> row
    placeholder_at: list[int | None] = None  # index of the row's PLACEHOLDER in output_ids


@dataclass
class StepOutput:
    req: Request
    token: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None


class ModelRunner:
    def __init__(self, model, cache: ModelCache, eos_ids: list[int], *, parallel: Parallel | None = None,
                 link: PlanLink | None = None):
        self.model = model
        self.cache = cache
        self.device = model.device
        self.eos_ids = list(eos_ids)
        self.parallel = parallel or Parallel.single()
        self.link = link if self.parallel.active else None  # None: one rank, nothing is published
        self.sampler = Sampler()
        self._generators: dict[str, torch.Generator] = {}
        self.mm: dict = {}  # rid -> glmrt.engine.mm.MMState
        self.graphs = None  # glmrt.engine.cuda_graphs.DecodeGraphs when enabled
        self.spec_graphs = None  # glmrt.engine.spec_graphs.SpecGraphs (a speculating engine on one rank)
        self.structured = None  # glmrt.engine.structured.StructuredOutput, set by the engine
        # A PD engine's rank > 0: what posts its part of a handoff's writes and reports them
        # (actors/rank_handoff.py: RankTransfers; `info`, `write`, `poll`), set by the rank
        self.rank_transfers = None
        self.host_pool = None  # glmrt.cache.host_pool.HostPool: this rank's host tier rows, or None
        # Tests: run the overlap schedule's bookkeeping with an eager forward (on the CPU,
        # where "launched" work has in fact already run).
        self.eager_async = False
        self._chain_hidden = None  # the draft chain's last hidden states (speculative decoding)
        self._captured = None      # the last verify forward's kept inputs (glmrt.engine.rollback)

    def enable_graphs(self, *, max_bs: int, max_pages: int, pad_slot: int, pad_page: int) -> None:
        from glmrt.engine.cuda_graphs import DecodeGraphs
        self.graphs = DecodeGraphs(self.model, self.cache, max_bs=max_bs, max_pages=max_pages,
                                   pad_slot=pad_slot, pad_page=pad_page)

    def capture_graphs(self, upto_tokens: int) -> int:
        """Capture the decode graphs ahead of traffic, on every rank in one order (their
        collectives are captured with them), or a speculating rank's graphs -> how many buckets."""
        if self.spec_graphs is not None:
            return self.spec_graphs.warmup(upto_tokens=upto_tokens)
        keys = self.graphs.warmup_keys(upto_tokens)
        self.run(ForwardInputs(op="capture", graphs=keys))
        return len(keys)

    def graph_key(self, work) -> tuple[int, int] | None:
        """The graph that can run this batch: decode only (one sampled token each, no images)."""
        if self.graphs is None or not work:
            return None
        for w in work:
            if w.num != 1 or not w.sample or (w.req.rid in self.mm and w.start < len(w.req.prompt_ids)):
                return None
        ps = self.cache.page_size
        return self.graphs.key(len(work), max(w.start // ps + 1 for w in work))

    # ---- copies --------------------------------------------------------------------------
    def copy_page(self, src: int, dst: int) -> None:
        kv = self.cache.kv
        kv.latent[:, dst] = kv.latent[:, src]
        kv.pooled[:, dst] = kv.pooled[:, src]

    def copy_state(self, src: int, dst: int) -> None:
        self.cache.state.copy_slot(src, dst)

    def generator(self, req: Request) -> torch.Generator | None:
        if req.params.seed is None:
            return None
        g = self._generators.get(req.rid)
        if g is None:
            g = torch.Generator(device=self.device).manual_seed(int(req.params.seed))
            if req.output_ids and not req.params.is_greedy:  # tokens sampled by another engine
                advance_generator(g, self.model.lm_head.out_features, len(req.output_ids))
            self._generators[req.rid] = g
        return g

    def forget(self, req: Request) -> None:
        self._generators.pop(req.rid, None)
        self.mm.pop(req.rid, None)
        if self.structured is not None:
            self.structured.forget(req)

    def _encode(self, st) -> torch.Tensor:
        """Vision tower over all of a request's items (once; kept across retractions)."""
        visual = self.model.visual
        dtype = next(visual.parameters()).dtype
        pixels = torch.cat([it.pixel_values for it in st.items]).to(self.device, dtype)
        grid = torch.tensor([list(it.grid_thw) for it in st.items], dtype=torch.long, device=self.device)
        st.embeds = visual(pixels, grid)
        st.positions = st.positions.to(self.device)
        return st.embeds

    def _vision_rows(self, work) -> tuple[list[int], torch.Tensor | None]:
        """Rank 0: the flat-batch rows whose input embedding is a vision feature, and those
        features (the tower runs here, once per request; kept across retractions)."""
        if not any(w.req.rid in self.mm for w in work):
            return [], None
        rows, feats, offset = [], [], 0
        for w in work:
            st = self.mm.get(w.req.rid)
            if st is not None and w.start < len(w.req.prompt_ids):
                embeds = st.embeds if st.embeds is not None else self._encode(st)
                st.positions = st.positions.to(embeds.device)
                inside = ((st.positions >= w.start) & (st.positions < w.start + w.num)).nonzero().flatten()
                if inside.numel():
                    rows += (offset + st.positions[inside] - w.start).tolist()
                    feats.append(embeds[inside])
            offset += w.num
        return rows, (torch.cat(feats) if feats else None)

    def _input_embeds(self, step: ForwardInputs, ids: torch.Tensor, feats: torch.Tensor | None):
        """The token embeddings with the vision features of `step.embed_rows` in place (rank 0's
        features, broadcast to the other ranks)."""
        if not step.embed_rows:
            return None
        embeds = self.model.model.embed(ids).clone()
        if self.parallel.active:
            if self.parallel.rank != 0:
                feats = torch.empty((len(step.embed_rows), embeds.shape[-1]), dtype=embeds.dtype, device=embeds.device)
            feats = self.parallel.broadcast(feats.to(embeds.dtype).contiguous())
        rows = torch.tensor(step.embed_rows, dtype=torch.long, device=embeds.device)
        embeds[rows] = feats.to(embeds.dtype)
        return embeds

    # ---- one step's inputs, on every rank ----------------------------------------------------
    @torch.no_grad()
    def run(self, step: ForwardInputs, feats: torch.Tensor | None = None,
            prev_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """Execute `step` (after publishing it, on rank 0 of several) -> the logits of its
        `logits_rows` (None for a command). `feats`: rank 0's vision features of
        `step.embed_rows`; `prev_tokens`: the previous shared tokens `step.src_rows` index."""
        self._exchange(step)
        if step.op == "capture":
            self.graphs.warmup(step.graphs)
            return None
        if step.op == "draft":
            return self._draft_step(step)
        if step.op == "rollback":
            for c in step.before:
                self._copy(c)
            roll_back(self.model, self.cache, self._captured, step.capture, step.prefix_lens, step.seq_lens,
                      step.slot_ids, step.page_tables)
            return None
        for c in step.before:
            self._copy(c)
        logits = hidden = None
        if step.graph is not None:
            logits = self.graphs.run(step.graph, step.ids, step.prefix_lens, step.slot_ids, step.page_tables,
                                     src_rows=step.src_rows, prev_tokens=prev_tokens)
        elif step.ids:
            meta = BatchMeta.build(step.prefix_lens, step.seq_lens, step.slot_ids, step.page_tables,
                                   self.cache.page_size, self.device)
            host = [torch.tensor(step.ids, dtype=torch.long), torch.tensor(step.logits_rows, dtype=torch.long)]
            if step.src_rows is not None and prev_tokens is not None:
                host.append(torch.tensor(step.src_rows, dtype=torch.long))
            ids, idx, *src = host_to_device(self.device, *host)  # one non-blocking copy, no host wait
            if src:  # the previous step's tokens, still on the device (the overlap schedule)
                ids = torch.where(src[0] >= 0, prev_tokens.to(torch.long)[src[0].clamp(min=0)], ids)
            embeds = self._input_embeds(step, ids, feats)
            capture = self._start_capture(step)
            logits, hidden = self.model(ids, meta, self.cache, input_embeds=embeds, logits_indices=idx)
            if capture is not None:
                capture.hidden = capture.select(hidden)
            if step.draft_extend:
                self._draft_extend(step, self.model.model.embed(ids) if embeds is None else embeds, hidden)
            self.cache.capture = None
            if step.keep_hidden:
                hidden = hidden[idx]
        logits = self._full_hit_logits(step, logits, hidden)
        for c in step.after:
            self._copy(c)
        return logits

    # ---- the MTP draft layer (speculative decoding) ------------------------------------------
    def _start_capture(self, step: ForwardInputs) -> Capture | None:
        """A verify forward: keep its drafting requests' stateful-op inputs (glmrt.engine.rollback)."""
        if not step.capture:
            return None
        starts = [0]
        for s in step.seq_lens:
            starts.append(starts[-1] + s)
        rows = [i for r in step.capture for i in range(starts[r], starts[r + 1])]
        self.cache.capture = self._captured = Capture(torch.tensor(rows, dtype=torch.long, device=self.device),
                                                      [step.seq_lens[r] for r in step.capture])
        return self._captured

    def _draft_extend(self, step: ForwardInputs, embeds: torch.Tensor, hidden: torch.Tensor) -> None:
        """The draft layer over the positions the forward computed, so its KV covers what the model
        has: draft position j takes the final hidden state at j and the embedding of token j + 1
        (docs/MODEL.md §6), so a request's rows are its positions shifted back by one — the first
        takes the hidden state its slot kept from the step before (none at position 0), the last
        forward row's hidden state is kept for the next step. Runs on every rank alike."""
        last = self.cache.state.last_hidden[0]
        n = hidden.shape[0]
        h_rows, e_rows, pre, seq, slots, tables, keep = [], [], [], [], [], [], []
        at = 0
        draft_at = {}  # request -> its first row in the draft pass
        for r, (p, s) in enumerate(zip(step.prefix_lens, step.seq_lens)):
            if s == 0:
                continue
            rows = list(range(at, at + s))
            at += s
            keep.append((rows[-1], step.slot_ids[r]))
            draft_at[r] = len(e_rows)
            if p > 0:
                h_rows += [n + r] + rows[:-1]
                e_rows += rows
                pre.append(p - 1)
                seq.append(s)
            elif s > 1:
                h_rows += rows[:-1]
                e_rows += rows[1:]
                pre.append(0)
                seq.append(s - 1)
            else:
                continue
            slots.append(step.slot_ids[r])
            tables.append(step.page_tables[r])
        if seq:
            dev = hidden.device
            all_slots = torch.tensor(step.slot_ids, dtype=torch.long, device=dev)
            src = torch.cat([hidden, last[all_slots].to(hidden.dtype)])
            meta = BatchMeta.build(pre, seq, slots, tables, self.cache.page_size, self.device)
            h_idx, e_idx = (torch.tensor(x, dtype=torch.long, device=dev) for x in (h_rows, e_rows))
            if self.cache.capture is not None:  # the drafting requests' rows of this pass (all at a prefix > 0)
                self.cache.capture.rows = torch.tensor(
                    [draft_at[r] + i for r in step.capture for i in range(step.seq_lens[r])], dtype=torch.long,
                    device=dev)
            self.model.mtp(embeds[e_idx], src[h_idx], meta, self.cache)
        if keep:
            rows, kslots = zip(*keep)
            last[torch.tensor(kslots, device=last.device)] = \
                hidden[torch.tensor(rows, device=hidden.device)].to(last.dtype)

    def _draft_step(self, step: ForwardInputs) -> torch.Tensor:
        """One step of the draft chain -> its logits, one row per request. The first step starts
        from each slot's kept hidden state, later ones from the draft hidden state of the row they
        continue; all run on the chain's own indexer tail (ModelCache.draft_chain)."""
        n = len(step.ids)
        dev = self.device
        ids = torch.tensor(step.ids, dtype=torch.long, device=dev)
        meta = BatchMeta.build(step.prefix_lens, [1] * n, step.slot_ids, step.page_tables, self.cache.page_size, dev)
        if step.chain_rows is None:
            slots = torch.tensor(step.slot_ids, dtype=torch.long, device=dev)
            hidden = self.cache.state.last_hidden[0][slots].to(self.model.dtype)
            cache = self.cache.draft_chain(slots, self.model.ops)
        else:
            hidden = self._chain_hidden[torch.tensor(step.chain_rows, dtype=torch.long, device=dev)]
            cache = self.cache.draft_chain(None, self.model.ops)
        self._chain_hidden = self.model.mtp(self.model.model.embed(ids), hidden, meta, cache)
        return self.model.compute_logits(self._chain_hidden)

    def _full_hit_logits(self, step: ForwardInputs, logits, hidden):
        """A prompt end's save keeps its row's final hidden state (written into the live slot,
        which the save then copies); a full hit's logits come from the hidden state its restore
        brought into its slot (the LM head only, on every rank: it is vocab-parallel). -> the
        logits of every sampled row, in plan order."""
        if not (step.keep_hidden or step.hit_slots):
            return logits
        last = self.cache.state.last_hidden[0]
        # the indices in one pinned copy: a copy from pageable memory would wait here for the
        # whole forward, and the host's sampling set-up would then run with the GPU idle
        rows, slots = zip(*step.keep_hidden) if step.keep_hidden else ((), ())
        rows, slots, hits, order = host_to_device(last.device, *(torch.tensor(x, dtype=torch.long) for x in (
            rows, slots, step.hit_slots, step.sample_order if step.hit_slots else ())))
        if step.keep_hidden:  # one indexed copy for every save of the step (each a distinct live slot)
            last[slots] = hidden[rows].to(last.dtype)
        if not step.hit_slots:
            return logits
        kept = self.model.compute_logits(last[hits])
        if logits is None:
            return kept
        return torch.cat([logits, kept])[order]

    def share_tokens(self, tokens: torch.Tensor | None, n: int) -> torch.Tensor:
        """Rank 0's sampled tokens [n] (int64, on the device) on every rank, in stream order."""
        if self.parallel.rank != 0:
            tokens = torch.empty(n, dtype=torch.long, device=self.device)
        return self.parallel.broadcast(tokens)

    def _exchange(self, step: ForwardInputs) -> None:
        """Rank 0 of several: publish `step` with the host tier's operations since the last one;
        the other ranks: perform those operations (before anything else of the step)."""
        if self.link is not None and self.parallel.rank == 0:
            if self.host_pool is not None:
                step.host_ops, step.host_ready = self.host_pool.take_journal()
            self.link.publish(step)
        elif step.host_ops or step.host_ready:
            self.host_pool.replay(step.host_ops, step.host_ready)

    def follow(self) -> None:
        """A rank other than 0: run each step rank 0 publishes, until it says stop."""
        prev = None
        while True:
            step = self.link.receive()
            if step.op == "stop":
                self._exchange(step)  # what rank 0's tier did last (its disk files are every rank's)
                return
            if step.op.startswith("handoff_"):
                self._follow_handoff(step)
                continue
            self.run(step, prev_tokens=prev)
            if step.share_tokens:
                prev = self.share_tokens(None, len(step.slot_ids))

    # ---- a PD handoff on every rank (rank 0 drives, glmrt.engine.ranks) ---------------------
    def _follow_handoff(self, step: ForwardInputs) -> None:
        """A rank > 0 executes its part of a handoff op that rank 0 published."""
        xfer = self.rank_transfers
        if step.op == "handoff_info":
            self.link.gather_bytes(xfer.info() if xfer is not None else b"")
        elif step.op == "handoff_write":
            if xfer is not None:
                xfer.write(step.writes, self.parallel.rank)
        elif step.op == "handoff_poll":
            reports = xfer.poll() if xfer is not None else []
            self.link.gather_bytes(_encoder.encode(reports))
        else:
            raise ValueError(f"unknown op {step.op!r}")

    def gather_transfer_info(self, info: bytes) -> list[bytes]:
        """Rank 0: every rank's transfer-engine peer info, by rank (`info` is rank 0's own)."""
        if self.link is None:
            return [info]
        self.link.publish(ForwardInputs(op="handoff_info"))
        return self.link.gather_bytes(info)

    def publish_writes(self, writes: list[RankWrite]) -> None:
        """Rank 0: ranks > 0 post their parts of these handoffs' writes."""
        if self.link is not None and writes:
            self.link.publish(ForwardInputs(op="handoff_write", writes=writes))

    def poll_writes(self) -> list[RankReport]:
        """Rank 0: the writes ranks > 0 finished (or failed) since the last poll."""
        if self.link is None:
            return []
        self.link.publish(ForwardInputs(op="handoff_poll"))
        return [r for data in self.link.gather_bytes(b"")[1:] for r in _reports.decode(data)]

    def stop_followers(self) -> None:
        """Rank 0, when the engine ends: the other ranks leave their `follow` loop."""
        if self.link is not None:
            self._exchange(ForwardInputs(op="stop"))

    def _copy(self, c: StateCopy) -> None:
        self.copy_state(c.src_slot, c.dst_slot)
        if c.src_page is not None:
            self.copy_page(c.src_page, c.dst_page)

    # ---- the overlapped decode step -------------------------------------------------------
    def async_key(self, plan: StepPlan) -> tuple[int, int] | tuple[()] | None:
        """For decode work that a graph replays and the device sampler finishes with no host
        sync: its graph key (() for the tests' eager launch); None for any other plan."""
        if plan.restores or plan.saves or plan.forks or plan.retracted:
            return None
        # NOTE: a constrained row's mask needs the matcher advanced by the previous token,
        # which the overlapped path has not read yet: batches holding one run synchronously
        so = self.structured
        if so is not None and so.constraints and any(so.constrained(w.req) for w in plan.work):
            return None
        if not all(self.sampler.can_sample_async(w.req.params, len(w.req.output_ids)) for w in plan.work):
            return None
        key = self.graph_key(plan.work)
        if key is None and self.eager_async and all(w.num == 1 and w.sample for w in plan.work):
            return ()
        return key

    @torch.no_grad()
    def launch(self, plan: StepPlan, prev: InFlight | None, key: tuple[int, int] | tuple[()]) -> InFlight:
        """Enqueue the forward and sampling of a decode plan (`key` from async_key); nothing
        here waits for the GPU. An input token that is still a PLACEHOLDER is fed from
        `prev.tokens` on the device.
        """
        work = plan.work
        ids, src = [], []
        for w in work:
            tok = w.req.token_slice(w.start, w.start + 1)[0]
            if tok == PLACEHOLDER:
                src.append(prev.row_of[id(w.req)])
                ids.append(0)
            else:
                src.append(-1)
                ids.append(tok)
        n = len(work)
        step = ForwardInputs(ids=ids, prefix_lens=[w.start for w in work], seq_lens=[1] * n,
                             slot_ids=[w.req.slot for w in work], page_tables=[w.req.pages for w in work],
                             logits_rows=list(range(n)), src_rows=src if prev is not None else None,
                             graph=key or None, share_tokens=self.link is not None)
        logits = self.run(step, prev_tokens=prev.tokens if prev is not None else None)
        reqs = [w.req for w in work]
        rows_in = [SamplerRow(r.params, r.prompt_ids, r.output_ids, self.generator(r), self.eos_ids) for r in reqs]
        tokens = self.sampler.sample_async(logits, rows_in)
        if step.share_tokens:  # the other ranks feed them to the next step's inputs
            tokens = self.share_tokens(tokens.to(torch.long), n)
        return InFlight(plan, reqs, tokens, {id(r): i for i, r in enumerate(reqs)})

    # ---- the step ------------------------------------------------------------------------
    def forward_inputs(self, plan: StepPlan) -> tuple[ForwardInputs, torch.Tensor | None]:
        """What every rank runs for a synchronous plan, and rank 0's vision features for it."""
        work = plan.work
        restores = [StateCopy(r.src_slot, r.dst_slot, r.src_page, r.dst_page) for r in plan.restores]
        after = ([StateCopy(s.src_slot, s.dst_slot, s.src_page, s.dst_page) for s in plan.saves]
                 + [StateCopy(f.parent.slot, f.dst_slot, f.src_page, f.dst_page) for f in plan.forks])
        common = dict(prefix_lens=[w.start for w in work], seq_lens=[w.num for w in work],
                      slot_ids=[w.req.slot for w in work], page_tables=[w.req.pages for w in work],
                      before=restores, after=after)
        hits = [w for w in work if w.sample and w.num == 0]
        keep = [s for s in plan.saves if s.with_output]  # the final hidden states are needed
        key = self.graph_key(work) if not (hits or keep) else None
        if key is not None:
            return ForwardInputs(ids=[w.req.token_slice(w.start, w.start + 1)[0] for w in work], graph=key,
                                 **common), None
        computed = [w for w in work if w.num > 0]
        common.update(prefix_lens=[w.start for w in computed], seq_lens=[w.num for w in computed],
                      slot_ids=[w.req.slot for w in computed], page_tables=[w.req.pages for w in computed])
        ids = [t for w in computed for t in w.req.token_slice(w.start, w.start + w.num)]
        ends = torch.tensor([w.num for w in computed], dtype=torch.long).cumsum(0).tolist()
        sampled = [i for i, w in enumerate(computed) if w.sample]
        row_of = {id(computed[i].req): k for k, i in enumerate(sampled)}
        order = None
        if hits:  # the sampled rows in plan order: the forward's rows, then the full hits'
            order, k_hit = [], len(sampled)
            for w in work:
                if w.sample:
                    order.append(row_of[id(w.req)] if w.num else k_hit)
                    k_hit += 0 if w.num else 1
        rows, feats = self._vision_rows(computed)
        return ForwardInputs(ids=ids, logits_rows=[ends[i] - 1 for i in sampled], embed_rows=rows,
                             keep_hidden=[(row_of[id(s.req)], s.src_slot) for s in keep],
                             hit_slots=[w.req.slot for w in hits], sample_order=order, **common), feats

    @torch.no_grad()
    def execute(self, plan: StepPlan) -> list[StepOutput]:
        step, feats = self.forward_inputs(plan)
        logits = self.run(step, feats)
        # the forward is enqueued: the grammar masks are filled on the host while it runs
        reqs = self._sampled(plan)
        mask = self.structured.fill(reqs) if self.structured is not None and reqs else None
        return self._sample(plan, logits, reqs, mask)

    @staticmethod
    def _sampled(plan: StepPlan) -> list[Request]:
        """The requests sampled this step, in row order: the rows whose last token was
        computed, then each n>1 child forked from one of them (it samples from its parent's row)."""
        sampled = [w.req for w in plan.work if w.sample]
        ids = {id(r) for r in sampled}
        return sampled + [f.child for f in plan.forks if id(f.parent) in ids]

    def _sample(self, plan: StepPlan, logits: torch.Tensor, reqs: list[Request], mask) -> list[StepOutput]:
        work = plan.work
        rows = [i for i, w in enumerate(work) if w.sample]
        sampled = [work[i].req for i in rows]
        row_of = {id(r): k for k, r in enumerate(sampled)}
        if not reqs:
            return []
        if plan.forks:  # n > 1: each child samples from its parent's row (pinned: no wait for the forward)
            sel, = host_to_device(logits.device, torch.tensor(
                list(range(len(sampled))) + [row_of[id(f.parent)] for f in plan.forks if id(f.parent) in row_of]))
            logits = logits[sel]
        else:
            logits = logits[:len(sampled)]
        rows_in = [SamplerRow(r.params, r.prompt_ids, r.output_ids, self.generator(r), self.eos_ids) for r in reqs]
        if mask is not None:  # after the model, before penalties and the draw (as vLLM and SGLang order it)
            bits, mask_rows = mask.to(logits.device)
            self.model.ops.apply_token_bitmask(logits, bits, mask_rows)
        res = self.sampler.sample(logits, rows_in)
        return [StepOutput(r, res.tokens[i], res.logprobs[i], res.top_logprobs[i]) for i, r in enumerate(reqs)]
