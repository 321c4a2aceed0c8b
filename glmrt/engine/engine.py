"""The in-process engine: the model plus its pools, serving many requests at once.

    engine = Engine(EngineConfig(model="~/ckpt/tiny"))
    rids = engine.add_request(prompt_ids, SamplingParams(max_tokens=32))
    while engine.has_work():
        for out in engine.step(): ...

One step: schedule (data) -> run the plan (model) -> apply tokens, cache full pages in the
radix tree, turn saved states into checkpoints, finish requests (glmrt.engine.finishing). Two
step bodies, one chosen at construction: the synchronous `_normal_step`, and `_overlap_step`
(glmrt.engine.overlap), which launches decode step N+1 on the device before it reads step N's
tokens. Everything a later layer (actors, API, PD) needs wraps this class; it owns no sockets.
"""

from __future__ import annotations

import itertools
import os
import time
import uuid
from dataclasses import dataclass, field

import torch

from glmrt.cache.page_manager import PageManager
from glmrt.cache.radix import RadixCache
from glmrt.cache.slot_manager import SlotManager
from glmrt.engine import compile_watch
from glmrt.engine.config import EngineConfig
from glmrt.engine.finishing import RequestFinishing
from glmrt.engine.model_rank import ModelRank
from glmrt.engine.overlap import OverlapSchedule
from glmrt.engine.ranks import PlanLink
from glmrt.engine.request import Request, Status
from glmrt.engine.scheduler import Scheduler, SchedulerConfig
from glmrt.engine.speculative import SpecOutput, Speculator
from glmrt.engine.structured import StructuredOutput
from glmrt.engine.warmup import warm_up_prefill
from glmrt.parallel import Parallel
from glmrt.sampling_params import Grammar, SamplingParams


def choice_seed(seed: int, i: int) -> int:
    """Choice i's seed: seed + i, wrapped into the 64 bits a torch generator takes ([-2^63, 2^64))."""
    s = seed + i
    return s - 2**64 if s >= 2**64 else s


class ContextLengthExceeded(ValueError):
    """The prompt (plus one generated token) cannot fit the context or the KV pool."""


SLOW_STEP_S = 2.0  # a synchronous step slower than this is logged with its batch


def describe_plan(plan) -> str:
    """One line for the log: tokens, requests, and each prefill chunk's length and prefix."""
    decode = sum(1 for w in plan.work if w.num == 1 and w.start > 0)
    chunks = [f"{w.num}@{w.start}" for w in plan.work if not (w.num == 1 and w.start > 0)]
    shown = ", ".join(chunks[:8]) + (f", ... {len(chunks) - 8} more" if len(chunks) > 8 else "")
    return (f"{plan.num_tokens} tokens, {len(plan.work)} requests ({decode} decode rows; prefill chunks "
            f"tokens@prefix: {shown or 'none'}), {len(plan.restores)} restores, {len(plan.saves)} saves")


@dataclass
class RequestOutput:
    rid: str
    new_token_ids: list[int]
    new_logprobs: list[float | None] = field(default_factory=list)
    new_top_logprobs: list = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    spec_verify_ct: int = 0   # speculative decoding: the request's decode steps so far


@dataclass
class Completion:
    rid: str
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str | None
    cached_tokens: int
    logprobs: list[float | None]
    top_logprobs: list


class Engine(OverlapSchedule, RequestFinishing, ModelRank):
    def __init__(self, config: EngineConfig, *, log=print, model=None, parallel: Parallel | None = None,
                 link: PlanLink | None = None):
        super().__init__(config, log=log, model=model, parallel=parallel, link=link)
        device, dtype_name, kv_dtype = self.device_name, self.dtype_name, self.kv_dtype
        self.pages = PageManager(self.memory.num_pages)
        self.slots = SlotManager(self.memory.num_slots)
        self.tree = RadixCache(config.page_size, self.pages, self.slots, enabled=not config.disable_radix_cache,
                               host=self._host_tier(config) if config.enable_hierarchical_cache else None)
        self.scheduler = Scheduler(SchedulerConfig(
            page_size=config.page_size, max_running_requests=self.memory.max_running_requests,
            chunked_prefill_size=config.chunked_prefill_size, max_prefill_tokens=config.max_prefill_tokens,
            policy=config.schedule_policy, state_checkpoint_interval=config.state_checkpoint_interval,
            max_num_batched_tokens=config.max_num_batched_tokens),
            self.pages, self.slots, self.tree, draft_depth=self._draft_depth if self.spec_steps else None,
            max_drafting=self.memory.rollback_slots)
        self.spec = Speculator(self.runner, self.spec_steps, self.rollback_base) if self.spec_steps else None
        self.runner.structured = StructuredOutput(self._tokenizer_json(), self.model_config.text.vocab_size,
                                                  self.eos_ids)
        if (self.runner.graphs or self.runner.spec_graphs) is not None and config.cuda_graph_warmup_tokens > 0:
            t0 = time.perf_counter()  # (the f-string's parts run in order: capture, then the clock)
            self.log(f"captured CUDA graphs of {self.runner.capture_graphs(config.cuda_graph_warmup_tokens)} batch "
                     f"buckets in {time.perf_counter() - t0:.1f} s")
        if device.startswith("cuda"):
            compile_watch.install()  # names the kernels behind a slow step in the log
            if not config.skip_server_warmup:
                warm_up_prefill(self, config)
        self._inflight = None  # the launched decode step whose tokens are not read yet
        # CPU/GPU overlap needs the sync-free decode path (graphs + device sampling)
        self.overlap = self.runner.graphs is not None and not config.disable_overlap_schedule
        self.requests: dict[str, Request] = {}
        self.handoffs: dict[str, Request] = {}   # prefill role: finished prompts whose state awaits transfer
        self.imports: dict[str, Request] = {}    # decode role: reserved requests whose state is arriving
        self._arrival = itertools.count()
        self.counters = {"prompt_tokens": 0, "cached_prompt_tokens": 0, "generation_tokens": 0,
                         "finished": 0, "aborted": 0, "retractions": 0}
        self.log(f"glmrt engine: {self.backend.description}, dtype {dtype_name}, KV {kv_dtype}, "
                 f"state {config.mamba_ssm_dtype}, decode CUDA graphs "
                 + (f"up to batch {self.runner.graphs.max_bs}" if self.runner.graphs else "off"))
        self.log(f"glmrt engine: {self.options.describe()}")
        if self.spec is not None:
            self.log(f"glmrt engine: speculative decoding EAGLE (the checkpoint's MTP layer), {self.spec_steps} draft "
                     f"steps, topk 1, {self.spec_steps + 1} tokens verified per step (greedy: exact match; sampled: "
                     "rejection sampling); requests with a grammar decode one token per step; no overlap schedule; "
                     + (f"graphed greedy steps to batch {g.max_bs}" if (g := self.runner.spec_graphs) else "eager"))
        for line in self.memory.describe().splitlines():
            self.log(line)

    # ---- construction helpers ------------------------------------------------------------

    def _host_tier(self, config: EngineConfig):
        from glmrt.cache.disk_tier import DiskTier
        from glmrt.cache.host_tier import HostTier

        disk = None
        if self.disk_store is not None:
            # the weights (checkpoint path, or the random weights' preset and seed) and the rows' layout
            weights = os.path.realpath(os.path.expanduser(config.model)) if config.model else config.preset or "tiny"
            disk = DiskTier(self.disk_store, f"{weights}|{config.load_format}|{config.seed}|{config.quantization}|"
                                             f"{self.layout}", config.page_size)
        tier = HostTier(self.host_pool, config.hicache_write_policy, disk)
        ranks = f" on each of {self.parallel.tp_size} ranks" if self.parallel.active else ""
        self.log(f"host tier: {tier.pool.nbytes / 2**30:.3f} GiB{ranks}, {tier.pool.num_pages} pages, "
                 f"{tier.pool.num_slots} slots, {config.hicache_write_policy}" + (", pinned" if tier.pool.cuda else ""))
        return tier

    def _tokenizer_json(self) -> str | None:
        path = os.path.join(os.path.expanduser(self.config.model), "tokenizer.json") if self.config.model else None
        return path if path is not None and os.path.exists(path) else None

    # ---- the public API ------------------------------------------------------------------
    def default_params(self, **overrides) -> SamplingParams:
        return SamplingParams.from_generation_config(self.generation_config, **overrides)

    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None,
                    rid: str | None = None, mm_items: list | None = None, grammar: Grammar | None = None) -> list[str]:
        """Queue a prompt; returns one request id per choice (n > 1 shares the prompt's prefill).

        `mm_items` (glmrt.engine.mm.MMInput, in prompt order) fill the prompt's image
        placeholder tokens with vision-tower embeddings. `grammar` constrains every choice's
        answer (each its own matcher); one that cannot compile raises GrammarError (a
        ValueError), waiting for its compile when it has not finished (the engine actor
        adds a request only once it has).
        """
        params = params or self.default_params()
        params.validate(self.model_config.text.vocab_size)
        structured = self.runner.structured
        if grammar is not None and params.min_tokens:
            raise ValueError("min_tokens cannot be combined with a grammar (the grammar decides where the answer ends)")
        compiled = structured.compiled(grammar) if grammar is not None else None
        structured.check_budget(params.max_thinking_tokens)
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.text.vocab_size
        if any(t < 0 or t >= vocab for t in prompt):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(prompt) + 1 > self.context_length:
            raise ContextLengthExceeded(
                f"this model's maximum context is {self.context_length} tokens (context length and KV pool); "
                f"the prompt has {len(prompt)} tokens")
        rid = rid or uuid.uuid4().hex
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        mm_state = key_ids = None
        if mm_items:
            from glmrt.engine.mm import MMState, cache_key_ids, placeholder_positions
            precomputed = all(it.embeds is not None for it in mm_items)
            if self.model.visual is None and not precomputed:
                why = ("this engine runs without its vision tower (load_vision = false)" if not self.config.load_vision
                       else "this model has no vision tower")
                raise ValueError(f"{why}: image and video input is refused")
            pos = placeholder_positions(prompt, self.model_config.image_token_id, mm_items)
            mm_state = MMState(list(mm_items), torch.tensor(pos, dtype=torch.long))
            if precomputed:  # a separate vision actor ran the tower
                mm_state.embeds = torch.cat([it.embeds for it in mm_items]).to(self.model.device)
            key_ids = cache_key_ids(prompt, pos, mm_items)
        parent = Request(rid, prompt, params, self.next_arrival(), mm_key_ids=key_ids)
        reqs = [parent]
        for i in range(1, params.n):
            seed = None if params.seed is None else choice_seed(params.seed, i)
            child_params = _replace_params(params, seed=seed)
            child = Request(f"{rid}-{i}", list(prompt), child_params, self.next_arrival(), fork_parent=parent,
                            mm_key_ids=key_ids)
            parent.fork_children.append(child)
            reqs.append(child)
        for r in reqs:
            self.requests[r.rid] = r
            r.grammar = grammar
            structured.attach(r, compiled)
            if mm_state is not None:
                self.runner.mm[r.rid] = mm_state  # children share it (and its embeddings)
            self.scheduler.add(r)
        self.counters["prompt_tokens"] += len(prompt)
        return [r.rid for r in reqs]

    def next_arrival(self) -> int:
        """The arrival number of a request joining now (the admission order reads it)."""
        return next(self._arrival)

    def finish_handed_off(self, rid: str) -> None:
        """A request parked for a handoff ends here (the decode side has its state, or it
        failed): it finishes like any request, its pages and state going to the prefix cache."""
        req = self.handoffs.pop(rid)
        req.status = Status.RUNNING
        self._finish(req, "handoff_done")
        self.requests.pop(rid, None)

    def abort(self, rid: str) -> bool:
        req = self.requests.get(rid)
        if req is None or req.finished or req.finishing is not None:  # finishing: its end already went out
            return False
        self._finish(req, "abort")
        self.counters["aborted"] += 1
        return True

    def has_work(self) -> bool:
        return self._inflight is not None or self.scheduler.has_work()

    # ---- the step: schedule -> execute -> apply, in one of two loop bodies ---------------
    def _draft_depth(self, req: Request) -> int:
        return self.spec.depth(req, self.context_length, self.runner.structured.constrained(req))

    def _keep(self, req: Request, tokens: list[int]) -> int:
        """How many of a drafting request's verified tokens it keeps: through the first that ends it."""
        base = len(req.output_ids)
        for j, tok in enumerate(tokens):
            if self._finish_reason(req, tok, base + j + 1) is not None:
                return j + 1
        return len(tokens)

    def _spec_step(self) -> list[RequestOutput]:
        """The speculative step: decodes draft and verify (glmrt.engine.speculative), in one
        synchronous step with the rest of the plan."""
        plan = self._schedule()
        if not plan:
            return []
        return self._apply(plan, self._execute(plan, lambda p: self.spec.execute(p, self._keep)))

    def step(self) -> list[RequestOutput]:
        """Schedule and run one step; returns the tokens whose values are now known."""
        return self._step_body()

    def _normal_step(self) -> list[RequestOutput]:
        """The synchronous step: its tokens are on the host when it returns."""
        plan = self._schedule()
        if not plan:
            return []
        return self._apply(plan, self._execute(plan))

    def _schedule(self):
        plan = self.scheduler.schedule()
        self.counters["retractions"] += len(plan.retracted)
        for w in plan.work:
            w.req.inflight += 1
        return plan

    def _execute(self, plan, run=None) -> list:
        """Run the plan (`run`: the runner's execute) and wait for its tokens; a slow step is
        logged with its batch."""
        compile_watch.take()
        t0 = time.perf_counter()
        results = (run or self.runner.execute)(plan)  # host values: the step has finished
        took = time.perf_counter() - t0
        compiled = compile_watch.take()
        if took > SLOW_STEP_S:
            self.log(f"slow step: {took:.1f} s for {describe_plan(plan)} (a kernel variant compiled "
                     f"on first use stalls like this; the start-up warm-up should have run it); "
                     f"{compile_watch.summary(compiled)}")
        elif compiled:  # a shorter stall (a fast compile, a cache load, an autotune) is still a warm-up gap
            self.log(f"step compiled kernels: {took:.2f} s for {describe_plan(plan)}; {compile_watch.summary(compiled)}")
        return results

    def _apply(self, plan, results) -> list[RequestOutput]:
        """A finished step's bookkeeping: positions computed, restores done, full pages into
        the tree, saved states into checkpoints, sampled tokens to their requests."""
        for w in plan.work:
            w.req.num_computed = w.start + w.num
        for res in results:  # a drafting request's kept tokens: its computed positions already count them
            if isinstance(res, SpecOutput):
                self._accept_tokens(res.req, res.tokens, res.logprobs, res.top_logprobs)
        for r in plan.restores:
            r.checkpoint.pins -= 1
        saving = {id(sv.req) for sv in plan.saves}
        for req in {id(w.req): w.req for w in plan.work}.values():
            if not req.finished and req.finishing is None:
                self._cache_pages(req, force=id(req) in saving)  # a save needs its anchor path in the tree
        for s in plan.saves:
            if self.tree.add_checkpoint(s.req.key_ids, s.position, s.dst_slot, s.dst_page, s.with_output) is None:
                self.slots.free(s.dst_slot)
                if s.dst_page is not None:
                    self.pages.release([s.dst_page])
        outputs = []
        for res in results:
            req = res.req
            if isinstance(res, SpecOutput):
                outputs.append(self._emit_run(req, res))
                continue
            if req.finished or req.finishing is not None:
                continue  # finished by the step before (overlap): this token is past its end
            req.output_ids.append(res.token)
            if self.spec is not None and len(req.output_ids) > 1:
                req.spec_verify_ct += 1  # a decode step of a speculating engine (one that could not draft)
            self.runner.structured.accept(req, res.token)
            if req.params.logprobs:
                req.logprobs.append(res.logprob)
                req.top_logprobs.append(res.top_logprobs)
            outputs.append(self._emit(req, res.token, res.logprob, res.top_logprobs, len(req.output_ids)))
        self._step_done(plan)
        return outputs

    def _accept_tokens(self, req: Request, tokens: list[int], logprobs, tops) -> None:
        for j, tok in enumerate(tokens):
            req.output_ids.append(tok)
            self.runner.structured.accept(req, tok)
            if req.params.logprobs:
                req.logprobs.append(logprobs[j])
                req.top_logprobs.append(tops[j])

    def _emit_run(self, req: Request, res: SpecOutput) -> RequestOutput:
        """Report a drafting request's kept tokens (already in its outputs) as one output; release
        the pages the verify held past its next position."""
        base = len(req.output_ids) - len(res.tokens)
        req.spec_verify_ct += 1
        outs = [self._emit(req, tok, res.logprobs[j], res.top_logprobs[j], base + j + 1)
                for j, tok in enumerate(res.tokens)]
        if not req.finished:
            need = -(-(req.num_computed + 1) // self.config.page_size)
            if len(req.pages) > need:
                self.pages.release(req.pages[need:])
                del req.pages[need:]
        out = outs[-1]
        out.new_token_ids = [t for o in outs for t in o.new_token_ids]
        out.new_logprobs = [x for o in outs for x in o.new_logprobs]
        out.new_top_logprobs = [x for o in outs for x in o.new_top_logprobs]
        return out

    def info(self) -> dict:
        return {**self._info(), **(self.spec.stats.as_dict() if self.spec is not None else {})}

    def _emit(self, req: Request, token: int, logprob, top, n_out: int) -> RequestOutput:
        """Count and report one token (the n_out-th output); finish the request if it ends it."""
        self.counters["generation_tokens"] += 1
        reason = self._finish_reason(req, token, n_out)
        lp = req.params.logprobs
        out = RequestOutput(req.rid, [token], [logprob] if lp else [], [top] if lp else [], reason is not None,
                            reason, len(req.prompt_ids), n_out, req.cached_tokens, req.spec_verify_ct)
        if reason is not None:
            del req.output_ids[n_out:]  # a PLACEHOLDER of a step still in flight
            if req.inflight > 1 and reason != "handoff":
                # a later step still computes with this request's slot and pages: keep them
                # until it has run, and schedule nothing more for it
                req.finishing = reason
                if req in self.scheduler.running:
                    self.scheduler.running.remove(req)
            else:
                self._finish(req, reason)
        return out

    def _step_done(self, plan) -> None:
        for w in plan.work:
            req = w.req
            req.inflight -= 1
            if req.finishing is not None and req.inflight == 0 and not req.finished:
                reason, req.finishing = req.finishing, None
                req.num_computed = min(req.num_computed, req.num_tokens)
                self._finish(req, reason)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[list[Completion]]:
        """Run prompts to completion (offline use); one list of n choices per prompt."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        groups = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        while self.has_work():
            self.step()
        out = []
        for rids in groups:
            out.append([self._completion(self.requests.pop(r)) for r in rids])
        return out

    def _info(self) -> dict:
        return {**self.memory.as_dict(), "context_length": self.context_length,
                "pages_free": self.pages.num_free, "slots_free": self.slots.num_free,
                "slots_checkpoint": self.slots.num_checkpoint, "slots_live": self.slots.num_live,
                "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "constrained": len(self.runner.structured.constraints),
                "grammars_compiled": self.runner.structured.compiled_count,
                **self.tree.stats(), **self.counters}

    def flush_cache(self) -> None:
        self.tree.flush()

    # ---- internals -----------------------------------------------------------------------
    def _completion(self, req: Request) -> Completion:
        return Completion(req.rid, req.prompt_ids, req.output_ids, req.finish_reason, req.cached_tokens,
                          req.logprobs, req.top_logprobs)

    def check_invariants(self) -> None:
        """Both pools: free + cached + in use == capacity, reference counts exact."""
        self.pages.check()
        self.slots.check()
        self.tree.check()
        refs = [0] * self.pages.num_pages
        live = 0
        for req in self.requests.values():
            if req.finished:
                assert not req.pages and req.slot is None, f"finished request {req.rid} still holds memory"
                continue
            for p in req.pages:
                refs[p] += 1
            live += req.slot is not None
        stack = [self.tree.root]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            for p in n.pages:
                refs[p] += 1
            for c in n.checkpoints:
                if c.partial_page is not None:
                    refs[c.partial_page] += 1
        for p in range(self.pages.num_pages):
            assert refs[p] == self.pages.refcount(p), f"page {p}: {self.pages.refcount(p)} refs, {refs[p]} holders"
        assert live == self.slots.num_live, f"{self.slots.num_live} live slots, {live} held by requests"


def _replace_params(params: SamplingParams, **kw) -> SamplingParams:
    return params.replace(**kw)
