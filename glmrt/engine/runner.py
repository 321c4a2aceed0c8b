"""The model runner: executes a StepPlan on the model and its pools, then samples.

Order inside one step: restores (checkpoint -> live slot, partial page copies) ->
one forward over every work item (a flat varlen batch) -> saves and forks (state and
partial page copies, taken from the state the forward just produced) -> sampling of every
request whose last uncomputed token was computed, plus each n>1 child from its parent's row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backends.meta import BatchMeta, host_to_device
from glmrt.cache.pools import ModelCache
from glmrt.engine.request import Request
from glmrt.engine.sampler import Sampler, SamplerRow, advance_generator
from glmrt.engine.scheduler import StepPlan


# Token counts warm_prefill runs (up to the chunked-prefill size): both sides of each fused-MoE
# tile bucket (32, 256, 1024, 4096), multiples of 16 and not, and mhc's one-launch size (1024+).
PREFILL_WARMUP_SIZES = (1, 31, 32, 255, 256, 1023, 1024, 1100, 4095, 4096, 4097, 8192)

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
    def __init__(self, model, cache: ModelCache, eos_ids: list[int]):
        self.model = model
        self.cache = cache
        self.device = model.device
        self.eos_ids = list(eos_ids)
        self.sampler = Sampler()
        self._generators: dict[str, torch.Generator] = {}
        self.mm: dict = {}  # rid -> glmrt.engine.mm.MMState
        self.graphs = None  # glmrt.engine.cuda_graphs.DecodeGraphs when enabled
        self.structured = None  # glmrt.engine.structured.StructuredOutput, set by the engine
        # Tests: run the overlap schedule's bookkeeping with an eager forward (on the CPU,
        # where "launched" work has in fact already run).
        self.eager_async = False

    def warm_prefill(self, pages, slots, max_tokens: int, max_batch_tokens: int | None = None,
                     max_reqs: int | None = None) -> list[int]:
        """Run the prefill / mixed-batch forward once per shape class before traffic -> the
        token counts run. Triton compiles a kernel per tile config (the fused MoE's token-count
        buckets) and per integer specialisation (a multiple of 16 or not), and fla's chunked KDA
        picks kernels by the batch's sequences; compiled mid-traffic, each variant stalls every
        running request for seconds (the H200 serving sweep: 10-15 s stalls). So: one request at
        each size up to `max_tokens` (the chunk size), a mixed batch, and batches of many
        prefills (and a decode row) up to `max_batch_tokens` (the prefill token budget) and
        `max_reqs` requests, as a loaded server schedules them. Pages and slots come from the
        managers and go back; prefix-0 rows ignore a slot's old state, so nothing a later
        request reads is left behind."""
        ps = self.cache.page_size
        sizes = [n for n in PREFILL_WARMUP_SIZES if n <= max_tokens]
        if not sizes:
            return []
        batch_cap = max(max_batch_tokens or max_tokens, max_tokens)
        longest = max(sizes)
        held_pages: list[int] = []
        held_slots: list[int] = []

        def take(tokens: int) -> tuple[list[int], int] | None:
            need = -(-tokens // ps)
            if not pages.can_allocate(need) or slots.num_free < 1:
                return None
            got = pages.allocate(need), slots.allocate()
            held_pages.extend(got[0])
            held_slots.append(got[1])
            return got

        ran = []

        def forward(prefix, seq, slot_ids, tables):
            meta = BatchMeta.build(prefix, seq, slot_ids, tables, ps, self.device)
            ids = torch.randint(10, 1000, (sum(seq),), device=self.device)
            last = torch.tensor([e - 1 for e in meta.cu_seqlens[1:]], device=self.device)
            with torch.no_grad():
                self.model(ids, meta, self.cache, logits_indices=last)
            ran.append(sum(seq))

        try:
            a, b, c = take(longest + 64), take(64), take(64)
            if a is None or b is None or c is None:
                return []
            (pa, sa), (pb, sb), (pc, sc) = a, b, c
            for n in sizes:                      # one request, prefix 0, n tokens
                forward([0], [n], [sa], [pa])
            forward([0], [40], [sc], [pc])       # c gets a prefix for the mixed batch below
            # mixed: an extension after a cached prefix, a new request, a decode row
            forward([longest, 0, 40], [min(33, 64), 17, 1], [sa, sb, sc], [pa, pb, pc])
            forward([0, 0], [min(longest, 64), min(longest, 128) - 1], [sb, sa], [pb, pa])  # two prefills
            # many prefills in one batch (the request count reaches fla's varlen kernels and
            # ours as an integer argument: 3 and 17 are neither 1 nor a multiple of 16, 32 and
            # 64 are), chunks of up to 1024 tokens within the batch budget; c adds a decode row
            for n_req, decode in ((3, False), (8, True), (17, False), (32, True), (64, False)):
                if max_reqs is not None and n_req + decode > max_reqs:
                    break
                per = min(1024, max_tokens, (batch_cap - decode) // n_req)
                if per < 2:
                    break
                got = [take(per) for _ in range(n_req)]
                if any(g is None for g in got):
                    break
                rows = [(0, per, s, p) for p, s in got] + ([(40, 1, sc, pc)] if decode else [])
                forward(*(list(col) for col in zip(*rows)))
        finally:
            pages.release(held_pages)
            for sl in held_slots:
                slots.free(sl)
        return ran

    def enable_graphs(self, *, max_bs: int, max_pages: int, pad_slot: int, pad_page: int) -> None:
        from glmrt.engine.cuda_graphs import DecodeGraphs
        self.graphs = DecodeGraphs(self.model, self.cache, max_bs=max_bs, max_pages=max_pages,
                                   pad_slot=pad_slot, pad_page=pad_page)

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

    def _input_embeds(self, work, ids: torch.Tensor) -> torch.Tensor | None:
        if not any(w.req.rid in self.mm for w in work):
            return None
        embeds = self.model.model.embed(ids).clone()
        offset = 0
        for w in work:
            st = self.mm.get(w.req.rid)
            if st is not None and w.start < len(w.req.prompt_ids):
                feats = st.embeds if st.embeds is not None else self._encode(st)
                st.positions = st.positions.to(feats.device)
                inside = ((st.positions >= w.start) & (st.positions < w.start + w.num)).nonzero().flatten()
                if inside.numel():
                    embeds[offset + st.positions[inside] - w.start] = feats[inside].to(embeds.dtype)
            offset += w.num
        return embeds

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
        if key:
            logits = self.graphs.run(key, ids, [w.start for w in work], [w.req.slot for w in work],
                                     [w.req.pages for w in work], src_rows=src,
                                     prev_tokens=prev.tokens if prev is not None else None)
        else:  # eager_async
            ids_t = torch.tensor(ids, dtype=torch.long, device=self.device)
            if prev is not None:
                src_t = torch.tensor(src, dtype=torch.long, device=self.device)
                ids_t = torch.where(src_t >= 0, prev.tokens.to(torch.long)[src_t.clamp(min=0)], ids_t)
            meta = BatchMeta.build([w.start for w in work], [1] * len(work), [w.req.slot for w in work],
                                   [w.req.pages for w in work], self.cache.page_size, self.device)
            logits, _ = self.model(ids_t, meta, self.cache,
                                   logits_indices=torch.arange(len(work), device=self.device))
        reqs = [w.req for w in work]
        rows_in = [SamplerRow(r.params, r.prompt_ids, r.output_ids, self.generator(r), self.eos_ids) for r in reqs]
        tokens = self.sampler.sample_async(logits, rows_in)
        return InFlight(plan, reqs, tokens, {id(r): i for i, r in enumerate(reqs)})

    # ---- the step ------------------------------------------------------------------------
    @torch.no_grad()
    def execute(self, plan: StepPlan) -> list[StepOutput]:
        for r in plan.restores:
            self.copy_state(r.src_slot, r.dst_slot)
            if r.src_page is not None:
                self.copy_page(r.src_page, r.dst_page)
        work = plan.work
        key = self.graph_key(work)
        if key is not None:
            logits = self.graphs.run(key, [w.req.token_slice(w.start, w.start + 1)[0] for w in work],
                                     [w.start for w in work], [w.req.slot for w in work],
                                     [w.req.pages for w in work])
        else:
            logits = self._forward(work)
        # the forward is enqueued: the grammar masks are filled on the host while it runs
        reqs = self._sampled(plan, work)
        mask = self.structured.fill(reqs) if self.structured is not None and reqs else None
        return self._after_forward(plan, work, logits, reqs, mask)

    @staticmethod
    def _sampled(plan: StepPlan, work) -> list[Request]:
        """The requests sampled this step, in row order: the rows whose last token was
        computed, then each n>1 child forked from one of them (it samples from its parent's row)."""
        sampled = [w.req for w in work if w.sample]
        ids = {id(r) for r in sampled}
        return sampled + [f.child for f in plan.forks if id(f.parent) in ids]

    def _forward(self, work) -> torch.Tensor:
        meta = BatchMeta.build([w.start for w in work], [w.num for w in work], [w.req.slot for w in work],
                               [w.req.pages for w in work], self.cache.page_size, self.device)
        ids = torch.tensor([t for w in work for t in w.req.token_slice(w.start, w.start + w.num)], dtype=torch.long)
        rows = [i for i, w in enumerate(work) if w.sample]
        ends = meta.cu_seqlens
        idx = torch.tensor([ends[i + 1] - 1 for i in rows], dtype=torch.long)
        ids, idx = host_to_device(self.device, ids, idx)  # one non-blocking copy, no host wait
        logits, _ = self.model(ids, meta, self.cache, input_embeds=self._input_embeds(work, ids),
                               logits_indices=idx)
        return logits

    def _after_forward(self, plan: StepPlan, work, logits: torch.Tensor, reqs: list[Request],
                       mask) -> list[StepOutput]:
        rows = [i for i, w in enumerate(work) if w.sample]
        for s in plan.saves:
            self.copy_state(s.src_slot, s.dst_slot)
            if s.src_page is not None:
                self.copy_page(s.src_page, s.dst_page)
        for f in plan.forks:
            self.copy_state(f.parent.slot, f.dst_slot)
            if f.src_page is not None:
                self.copy_page(f.src_page, f.dst_page)
        sampled = [work[i].req for i in rows]
        row_of = {id(r): k for k, r in enumerate(sampled)}
        if not reqs:
            return []
        sel = torch.tensor(list(range(len(sampled))) + [row_of[id(f.parent)] for f in plan.forks
                                                        if id(f.parent) in row_of], device=logits.device)
        rows_in = [SamplerRow(r.params, r.prompt_ids, r.output_ids, self.generator(r), self.eos_ids) for r in reqs]
        logits = logits[sel]
        if mask is not None:  # after the model, before penalties and the draw (as vLLM and SGLang order it)
            bits, mask_rows = mask.to(logits.device)
            self.model.ops.apply_token_bitmask(logits, bits, mask_rows)
        res = self.sampler.sample(logits, rows_in)
        return [StepOutput(r, res.tokens[i], res.logprobs[i], res.top_logprobs[i]) for i, r in enumerate(reqs)]
