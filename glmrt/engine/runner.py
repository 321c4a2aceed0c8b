"""The model runner: executes a StepPlan on the model and its pools, then samples.

Order inside one step: restores (checkpoint -> live slot, partial page copies) ->
one forward over every work item (a flat varlen batch) -> saves and forks (state and
partial page copies, taken from the state the forward just produced) -> sampling of every
request whose last uncomputed token was computed, plus each n>1 child from its parent's row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backends.meta import BatchMeta
from glmrt.cache.pools import ModelCache
from glmrt.engine.request import Request
from glmrt.engine.sampler import Sampler, SamplerRow
from glmrt.engine.scheduler import StepPlan


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
            self._generators[req.rid] = g
        return g

    def forget(self, req: Request) -> None:
        self._generators.pop(req.rid, None)
        self.mm.pop(req.rid, None)

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

    # ---- the step ------------------------------------------------------------------------
    @torch.no_grad()
    def execute(self, plan: StepPlan) -> list[StepOutput]:
        for r in plan.restores:
            self.copy_state(r.src_slot, r.dst_slot)
            if r.src_page is not None:
                self.copy_page(r.src_page, r.dst_page)
        work = plan.work
        meta = BatchMeta.build([w.start for w in work], [w.num for w in work], [w.req.slot for w in work],
                               [w.req.pages for w in work], self.cache.page_size, self.device)
        ids = torch.tensor([t for w in work for t in w.req.token_slice(w.start, w.start + w.num)], dtype=torch.long)
        rows = [i for i, w in enumerate(work) if w.sample]
        ends = meta.cu_seqlens
        idx = torch.tensor([ends[i + 1] - 1 for i in rows], dtype=torch.long, device=self.device)
        ids = ids.to(self.device)
        logits, _ = self.model(ids, meta, self.cache, input_embeds=self._input_embeds(work, ids),
                               logits_indices=idx)
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
        extra = [f.child for f in plan.forks if id(f.parent) in row_of]
        reqs = sampled + extra
        if not reqs:
            return []
        sel = torch.tensor(list(range(len(sampled))) + [row_of[id(f.parent)] for f in plan.forks
                                                        if id(f.parent) in row_of], device=logits.device)
        rows_in = [SamplerRow(r.params, r.prompt_ids, r.output_ids, self.generator(r), self.eos_ids) for r in reqs]
        res = self.sampler.sample(logits[sel], rows_in)
        return [StepOutput(r, res.tokens[i], res.logprobs[i], res.top_logprobs[i]) for i, r in enumerate(reqs)]
