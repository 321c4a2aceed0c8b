"""Speculative decoding with the checkpoint's MTP layer: chain drafting, one verify forward per
step, exact rollback (rank 0; every forward goes through `ModelRunner.run`, so the other ranks of
an engine follow it as they follow any step).

A drafting request at `num_computed = c` (token x_c sampled, not computed) runs, in one engine step:

1. draft: `Work.draft = k` steps of the MTP layer (`ForwardInputs(op="draft")`): step 0 at draft
   position c-1 from the final hidden state its slot keeps (position c-1's) and x_c's embedding,
   step i from step i-1's draft hidden state and d_i -> d_1..d_k, on the chain's own indexer tail;
2. verify: the slot is copied into the request's rollback snapshot, then one forward of the model
   computes x_c, d_1..d_k at positions c..c+k with logits at each (the draft layer's pass over the
   same positions follows it, `draft_extend`);
3. accept: greedy, the sampler at each position, its output ids extended by the drafts before it,
   gives the model's own tokens t_0..t_k; the kept run is t_0..t_a, where d_1..d_a equal
   t_0..t_{a-1}. Sampled (temperature > 0), rejection sampling for a chain: the drafts were drawn
   from the draft layer's distribution q_i (filtered as the request's sampling filters the model's),
   d_i is accepted with probability min(1, p_i(d_i) / q_i(d_i)) against the model's distribution p_i
   at that position, the first rejection draws its replacement from max(0, p_i - q_i) renormalised
   and a full acceptance draws one more from p_k, so each kept token follows the model's own
   distribution; every draw comes from the request's generator (seeded as without speculation,
   though the draws differ). A stop token, max_tokens or the context may cut the run shorter: the
   engine's `keep` says;
4. rollback: when n < k + 1 tokens are kept, the snapshot goes back into the slot and the
   stateful ops alone (conv, KDA recurrence, indexer updates) run again over positions c..c+n-1
   from the inputs the verify kept (glmrt.engine.rollback), so the KDA recurrent state, conv
   window, both indexer tails and the kept hidden state are exactly those after the last kept
   position. The KV
   rows and pooled keys the verify wrote past it belong to positions the request has not computed:
   nothing reads them before a later forward rewrites them (a pooled key is read only once its pool
   is complete), and the engine releases the pages past the next position.

Requests constrained by a grammar, or with no room left (max_tokens, context), decode one token
per step in the same batch.

On one rank with CUDA graphs (glmrt.engine.spec_graphs), a step whose every request drafts K
tokens greedily (no penalties, logprobs or pending min_tokens, no restores, saves or forks) runs
as two graph replays instead: draft and verify together, then the rollback when any request keeps
fewer than K + 1 tokens. Its cycle time counts as verify time (the draft runs inside that graph).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from backends.meta import host_to_device
from glmrt.engine.ranks import ForwardInputs, StateCopy
from glmrt.engine.request import Request
from glmrt.engine.runner import ModelRunner, StepOutput
from glmrt.engine.sampler import Sampler, SamplerRow
from glmrt.engine.scheduler import StepPlan, Work


@dataclass
class SpecOutput:
    """A drafting request's tokens of one step: the model's own choices it keeps."""

    req: Request
    tokens: list[int]
    logprobs: list[float | None]
    top_logprobs: list
    drafted: int      # draft tokens verified
    accepted: int     # of them, how many the model agreed with (before a stop cut the run)


@dataclass
class SpecStats:
    """Counters over the engine's life (the engine's stats and /metrics read them)."""

    steps: int
    batches: int = 0      # engine steps that drafted (their draft and verify times are summed below)
    cycles: int = 0       # drafting requests verified (one per request and step)
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    drafted_at: list[int] = field(default_factory=list)   # per draft position: cycles that drafted it
    accepted_at: list[int] = field(default_factory=list)  # per draft position: cycles that accepted it

    def __post_init__(self):
        self.drafted_at = [0] * self.steps
        self.accepted_at = [0] * self.steps

    def count(self, drafted: int, accepted: int, emitted: int) -> None:
        self.cycles += 1
        self.drafted += drafted
        self.accepted += accepted
        self.emitted += emitted
        for i in range(drafted):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < accepted

    def as_dict(self) -> dict[str, float]:
        """Flat numbers (the engine's stats counters): per draft position i, spec_drafted_at_i and
        spec_accepted_at_i."""
        out = {"spec_steps": self.batches, "spec_cycles": self.cycles, "spec_draft_tokens": self.drafted,
               "spec_accepted_tokens": self.accepted, "spec_emitted_tokens": self.emitted,
               "spec_draft_seconds": round(self.draft_s, 6), "spec_verify_seconds": round(self.verify_s, 6)}
        for i in range(self.steps):
            out[f"spec_drafted_at_{i}"] = self.drafted_at[i]
            out[f"spec_accepted_at_{i}"] = self.accepted_at[i]
        return out


class Speculator:
    def __init__(self, runner: ModelRunner, steps: int, rollback_base: int):
        self.runner = runner
        self.steps = steps
        self.rollback_base = rollback_base  # first rollback snapshot slot (past the managed ones)
        self.stats = SpecStats(steps)
        # Tests only: replace a request's drafts (so every acceptance count can be reached on a
        # model whose draft layer is random), and cap the drafts accepted per step (both for
        # greedy requests only); and replace the draft layer's logits of a sampled request's chain
        # step (a draft that disagrees with the model as often as a test wants).
        self.draft_override: Callable[[Request, list[int]], list[int]] | None = None
        self.accept_cap: Callable[[Request, int], int] | None = None
        self.draft_logits: Callable[[Request, list[int], torch.Tensor], torch.Tensor] | None = None
        self.graphs = runner.spec_graphs  # glmrt.engine.spec_graphs.SpecGraphs, or None (eager)

    def depth(self, req: Request, context_length: int, constrained: bool) -> int:
        """Draft tokens a decoding request verifies this step (0: it decodes one token): requests
        without a grammar (its mask at each position would need the matcher advanced by the
        drafts) draft, as many as max_tokens and the context leave room for."""
        if req.num_computed < len(req.prompt_ids) or not req.output_ids or constrained:
            return 0  # also the prompt's last token (a resumed prefill): not a decode
        room = min(req.params.max_tokens - len(req.output_ids), context_length - req.num_tokens) - 1
        return max(0, min(self.steps, room))

    # ---- one step -------------------------------------------------------------------------
    @torch.no_grad()
    def execute(self, plan: StepPlan, keep: Callable[[Request, list[int]], int]) -> list[StepOutput | SpecOutput]:
        """Run a plan whose decodes may draft (`Work.draft`) -> the step's outputs. `keep(req,
        tokens)`: how many of a drafting request's tokens it keeps (a stop, max_tokens). Every
        forward of a speculating engine runs here, so the draft layer sees every computed position."""
        key = self._graph_key(plan)
        if key is not None:
            return self._execute_graphed(plan, keep, key)
        spec = [w for w in plan.work if w.draft > 0]
        t0 = time.perf_counter()
        drafts, q = self._draft(spec) if spec else ([], [])
        t1 = time.perf_counter()
        for w in spec:
            w.num = 1 + w.draft
        step, feats, rows_of = self._verify_inputs(plan, spec, drafts)
        logits = self.runner.run(step, feats)
        normal = StepPlan(work=[w for w in plan.work if w.draft == 0], forks=plan.forks)
        outputs = self._sample_normal(normal, logits, rows_of)
        if not spec:
            return outputs
        verified = self._verify(spec, drafts, q, logits, rows_of)
        replay = []  # (work, its snapshot row, tokens kept) of each partial acceptance
        for i, (w, (tokens, logprobs, tops, accepted)) in enumerate(zip(spec, verified)):
            n = max(1, min(keep(w.req, tokens), len(tokens)))
            self.stats.count(w.draft, accepted, n)
            if n < 1 + w.draft:
                replay.append((w, i, n))
            w.num = n
            outputs.append(SpecOutput(w.req, tokens[:n], logprobs[:n], tops[:n], w.draft, accepted))
        if replay:
            self._roll_back(replay)
        self.stats.batches += 1
        self.stats.draft_s += t1 - t0
        self.stats.verify_s += time.perf_counter() - t1
        return outputs

    def _graph_key(self, plan: StepPlan) -> tuple[int, int] | None:
        """The speculative graphs' bucket for this step, when every request in it drafts K tokens
        greedily and nothing else happens in it (None: eager)."""
        if (self.graphs is None or not plan.work or plan.restores or plan.saves or plan.forks
                or self.draft_override is not None or self.accept_cap is not None or self.draft_logits is not None):
            return None
        mm = self.runner.mm
        for w in plan.work:
            r = w.req
            if (w.draft != self.steps or w.num != 1 or not w.sample or not r.params.is_greedy
                    or not Sampler.can_sample_async(r.params, len(r.output_ids))
                    or (r.rid in mm and w.start < len(r.prompt_ids))):
                return None
        return self.graphs.key(len(plan.work), max(w.start for w in plan.work) + self.steps)

    def _execute_graphed(self, plan: StepPlan, keep: Callable[[Request, list[int]], int],
                         key: tuple[int, int]) -> list[SpecOutput]:
        """`execute` for a step `_graph_key` accepts: two graph replays and one read of the tokens."""
        t0 = time.perf_counter()
        work, k = plan.work, self.steps
        out = self.graphs.run(key, [w.req.token_slice(w.start, w.start + 1)[0] for w in work], [w.start for w in work],
                              [w.req.slot for w in work], [self.rollback_base + i for i in range(len(work))],
                              [w.req.pages for w in work])
        outputs, kept = [], []
        for w, row in zip(work, out.tolist()):
            t, d = row[:k + 1], row[k + 1:]
            a = 0
            while a < k and d[a] == t[a]:
                a += 1
            tokens = t[:a + 1]
            n = max(1, min(keep(w.req, tokens), len(tokens)))
            self.stats.count(k, a, n)
            w.num = n
            kept.append(n)
            outputs.append(SpecOutput(w.req, tokens[:n], [None] * n, [None] * n, k, a))
        if min(kept) < k + 1:
            self.graphs.roll_back(key, kept)
        self.stats.batches += 1
        self.stats.verify_s += time.perf_counter() - t0
        return outputs

    def _draft(self, spec: list[Work]) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
        """The draft chain: w.draft tokens per request, greedy over the draft layer's logits, or for
        a sampled request drawn from its filtered distribution q (kept for the verification)."""
        runner = self.runner
        drafts: list[list[int]] = [[] for _ in spec]
        q: list[list[torch.Tensor]] = [[] for _ in spec]
        prev: list[int] | None = None   # the rows of the previous step, as indices into spec
        for i in range(max(w.draft for w in spec)):
            rows = [j for j, w in enumerate(spec) if w.draft > i]
            ids = [spec[j].req.token_slice(spec[j].start, spec[j].start + 1)[0] if i == 0 else drafts[j][-1]
                   for j in rows]
            chain = None if prev is None else [prev.index(j) for j in rows]
            step = ForwardInputs(op="draft", ids=ids, prefix_lens=[spec[j].start - 1 + i for j in rows],
                                 slot_ids=[spec[j].req.slot for j in rows],
                                 page_tables=[spec[j].req.pages for j in rows], chain_rows=chain)
            logits = runner.run(step)
            tokens = logits.argmax(dim=-1).tolist()
            sampled = [row for row, j in enumerate(rows) if not spec[j].req.params.is_greedy]
            if sampled:  # one filtered distribution per sampled row, each drawn with its request's generator
                x = logits[sampled]
                if self.draft_logits is not None:
                    x = torch.cat([self.draft_logits(spec[rows[row]].req, drafts[rows[row]], x[i:i + 1])
                                   for i, row in enumerate(sampled)])
                reqs = [spec[rows[row]].req for row in sampled]
                probs = runner.sampler.probabilities(x, [SamplerRow(r.params, r.prompt_ids,
                                                                    r.output_ids + drafts[rows[row]],
                                                                    runner.generator(r), runner.eos_ids)
                                                         for r, row in zip(reqs, sampled)])
                for i, (r, row) in enumerate(zip(reqs, sampled)):
                    q[rows[row]].append(probs[i])
                    tokens[row] = int(torch.multinomial(probs[i], 1, generator=runner.generator(r)))
            for row, j in enumerate(rows):
                drafts[j].append(int(tokens[row]))
            prev = rows
        if self.draft_override is not None:
            drafts = [list(self.draft_override(w.req, d))[:w.draft] if w.req.params.is_greedy else d
                      for w, d in zip(spec, drafts)]
        return drafts, q

    def _verify_inputs(self, plan: StepPlan, spec: list[Work], drafts: list[list[int]]):
        """The verify forward: the plan's work (a drafting request's row carries its drafts, all
        with logits), after the restores and the rollback snapshots -> (inputs, vision features,
        logits rows of each sampled request, in [forward rows; full hits] order)."""
        runner = self.runner
        tokens = {id(w.req): [w.req.token_slice(w.start, w.start + 1)[0]] + d for w, d in zip(spec, drafts)}
        before = [StateCopy(r.src_slot, r.dst_slot, r.src_page, r.dst_page) for r in plan.restores]
        before += [StateCopy(w.req.slot, self.rollback_base + i) for i, w in enumerate(spec)]
        after = ([StateCopy(s.src_slot, s.dst_slot, s.src_page, s.dst_page) for s in plan.saves]
                 + [StateCopy(f.parent.slot, f.dst_slot, f.src_page, f.dst_page) for f in plan.forks])
        computed = [w for w in plan.work if w.num > 0]
        ids: list[int] = []
        logits_rows: list[int] = []
        rows_of: dict[int, list[int]] = {}
        for w in computed:
            t = tokens.get(id(w.req)) or w.req.token_slice(w.start, w.start + w.num)
            if w.sample:
                n = len(t) if id(w.req) in tokens else 1
                rows_of[id(w.req)] = list(range(len(logits_rows), len(logits_rows) + n))
                logits_rows += list(range(len(ids) + len(t) - n, len(ids) + len(t)))
            ids += t
        hits = [w for w in plan.work if w.sample and w.num == 0]
        for j, w in enumerate(hits):
            rows_of[id(w.req)] = [len(logits_rows) + j]
        keep = [(rows_of[id(s.req)][-1], s.src_slot) for s in plan.saves if s.with_output]
        rows, feats = runner._vision_rows(computed)
        step = ForwardInputs(ids=ids, prefix_lens=[w.start for w in computed], seq_lens=[w.num for w in computed],
                             slot_ids=[w.req.slot for w in computed], page_tables=[w.req.pages for w in computed],
                             logits_rows=logits_rows, before=before, after=after, embed_rows=rows, keep_hidden=keep,
                             hit_slots=[w.req.slot for w in hits],
                             sample_order=list(range(len(logits_rows) + len(hits))) if hits else None,
                             draft_extend=True, capture=[computed.index(w) for w in spec])
        return step, feats, rows_of

    def _sample_normal(self, normal: StepPlan, logits: torch.Tensor, rows_of) -> list[StepOutput]:
        """The requests that decode one token (and prefill ends, full hits, forks), as `execute` samples them."""
        runner = self.runner
        reqs = runner._sampled(normal)
        if not reqs:
            return []
        rows = [rows_of[id(w.req)][0] for w in normal.work if w.sample]
        mask = runner.structured.fill(reqs) if runner.structured is not None else None
        sel, = host_to_device(logits.device, torch.tensor(rows, dtype=torch.long))  # pinned: no wait for the verify
        return runner._sample(normal, logits[sel], reqs, mask)

    def _verify(self, spec: list[Work], drafts: list[list[int]], q: list[list[torch.Tensor]], logits: torch.Tensor,
                rows_of):
        """The kept run of each drafting request -> per request (tokens t_0..t_a, their logprobs and
        top logprobs, a: the drafts accepted). Each position's sampler row sees the drafts before it
        as outputs (penalties, min_tokens)."""
        runner = self.runner
        out: list = [None] * len(spec)
        greedy = [i for i, w in enumerate(spec) if w.req.params.is_greedy]
        if greedy:
            rows, rows_in, spans = [], [], []
            for i in greedy:
                r, d = spec[i].req, drafts[i]
                spans.append((len(rows), len(rows) + 1 + len(d)))
                rows += rows_of[id(r)]
                rows_in += [SamplerRow(r.params, r.prompt_ids, r.output_ids + d[:j], None, runner.eos_ids)
                            for j in range(1 + len(d))]
            res = runner.sampler.sample(logits[torch.tensor(rows, device=logits.device)], rows_in)
            for i, (s0, s1) in zip(greedy, spans):
                t, d = res.tokens[s0:s1], drafts[i]
                a = 0
                while a < len(d) and d[a] == t[a]:
                    a += 1
                if self.accept_cap is not None:
                    a = min(a, self.accept_cap(spec[i].req, a))
                out[i] = (t[:a + 1], res.logprobs[s0:s0 + a + 1], res.top_logprobs[s0:s0 + a + 1], a)
        for i, w in enumerate(spec):
            if out[i] is None:
                out[i] = self._rejection_sample(w.req, drafts[i], q[i],
                                                logits[torch.tensor(rows_of[id(w.req)], device=logits.device)])
        return out

    def _rejection_sample(self, r: Request, d: list[int], q: list[torch.Tensor], logits: torch.Tensor):
        """Verify a sampled request's chain: accept d_i with probability min(1, p_i(d_i) / q_i(d_i)),
        replace the first rejected one from max(0, p_i - q_i) renormalised, or add one from p_k."""
        runner = self.runner
        gen = runner.generator(r)
        rows_in = [SamplerRow(r.params, r.prompt_ids, r.output_ids + d[:j], gen, runner.eos_ids)
                   for j in range(1 + len(d))]
        p = runner.sampler.probabilities(logits, rows_in)
        tokens = []
        for i, tok in enumerate(d):
            u = float(torch.rand(1, generator=gen, device=p.device))
            if u * float(q[i][tok]) < float(p[i, tok]):
                tokens.append(tok)
                continue
            residual = (p[i] - q[i].to(p.dtype)).clamp_min_(0)
            if float(residual.sum()) <= 0:  # q >= p everywhere p has mass: p itself
                residual = p[i]
            tokens.append(int(torch.multinomial(residual, 1, generator=gen)))
            break
        else:
            tokens.append(int(torch.multinomial(p[len(d)], 1, generator=gen)))
        n = len(tokens)
        res = runner.sampler.result(logits[:n], rows_in[:n], tokens)
        return tokens, res.logprobs, res.top_logprobs, n - 1

    def _roll_back(self, replay: list[tuple[Work, int, int]]) -> None:
        """Roll back: each snapshot into its slot, then the stateful ops over the kept positions
        from the verify's own inputs (glmrt.engine.rollback; no other part of the model runs)."""
        self.runner.run(ForwardInputs(
            op="rollback", prefix_lens=[w.start for w, _, _ in replay], seq_lens=[n for _, _, n in replay],
            slot_ids=[w.req.slot for w, _, _ in replay], page_tables=[w.req.pages for w, _, _ in replay],
            before=[StateCopy(self.rollback_base + i, w.req.slot) for w, i, _ in replay],
            capture=[i for _, i, _ in replay]))
