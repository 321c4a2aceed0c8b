"""The engine actor (kind `engine`, alias `unified`): the in-process Engine behind an inbox.

The step runs in a worker thread so the event loop keeps receiving and sending while the
model computes; requests and aborts that arrive during a step are applied between steps
(the Engine is only ever touched by one thread at a time).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import os
import time
from typing import Any

import msgspec

from actors.aborts import RecentAborts
from actors.base import Actor
from actors.engine_handoff import RANK_POLL_S, HandoffMixin
from actors.logs import EngineStatsLog
from actors.request_ledger import RequestLedger
from glmrt import protocol as P

STATS_S = 1.0
STOP_RANKS_S = 5.0  # an engine's other ranks have this long to leave after it stops
VISION_TIMEOUT_S = 60.0  # a request whose embeddings take longer (a vision actor died) fails


class EngineActor(HandoffMixin, Actor):
    kind = "engine"

    async def setup(self) -> dict[str, Any]:
        import torch

        from glmrt.engine.engine import Engine

        torch.set_num_threads(self.spec.config.torch_threads)
        if self.spec.gpus and torch.cuda.is_available():
            torch.cuda.set_device(self.spec.gpus[0])
        cfg = self.spec.config.engine
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine-step")
        loop = asyncio.get_running_loop()
        self.ranks = None
        if self.spec.config.tp > 1:
            self.engine = await loop.run_in_executor(self._executor, self._start_ranks_and_build())
        else:
            self.engine = await loop.run_in_executor(self._executor, lambda: Engine(cfg, log=self.log.info))
        # NOTE: the loop appends and the step thread pops: a deque's append/popleft are atomic
        self._pending: collections.deque[tuple[str, Any]] = collections.deque()
        self._wake = asyncio.Event()
        # NOTE: the api aborts at the engine directly, so an abort can overtake the request it
        # names (still at the tokenizer or the vision actor): the loop remembers whole-request
        # aborts a while and drops such a request when it arrives
        self._early_aborts = RecentAborts()  # requests aborted before (or while) their parts arrive
        self._routes: dict[str, tuple[P.RequestKey, str]] = {}  # engine rid -> (its choice's key, detok)
        self._prompt_cached: dict[P.RequestKey, int] = {}       # request -> cached prompt tokens of choice 0
        self.ledger = RequestLedger()  # step thread: duplicates dropped, outputs kept for replays
        self._pd: dict[str, tuple] = {}          # prefill: engine rid -> (decode id, sampling, offered at)
        self._reservations: dict[str, tuple] = {}  # decode: engine rid -> (HandoffOffer, reserved at)
        self._vision_wait: dict[P.RequestKey, P.EngineRequest] = {}  # waiting for a vision actor's embeddings
        self._vision_results: dict[P.RequestKey, tuple] = {}        # embeddings that came first
        self._vision_since: dict[P.RequestKey, float] = {}          # when either of those began
        self._compiling: set[asyncio.Task] = set()  # requests whose grammar compiles before they are handled
        self.xfer = None
        self._xfer_peers: dict[str, bytes] = {}   # peer transfer engine -> the info we connected with
        self._transfers: list = []   # (engine rid, rank 0's write handles) started by the last step
        self._transfer_tasks: set[asyncio.Task] = set()  # their completions, awaited on the loop
        self._moving: dict = {}  # prefill: engine rid -> engine_handoff.Moving, its state on its way
        if cfg.role != "unified":  # in the step thread: at tp > 1 it is a collective of the ranks
            await loop.run_in_executor(self._executor, self._start_handoff)
        info = dict(self.engine.info())
        info.update(tp_size=self.spec.config.tp, ep_size=self.spec.config.ep,
                    ranks=self.ranks.ranks() if self.ranks is not None else
                    [{"rank": 0, "pid": os.getpid(), "device": self._device_name()}])
        if self.xfer is not None:
            info.update(kv_transfer=self.xfer.backend)
        info.update(backend=self.engine.backend.name, dtype=str(self.engine.dtype).removeprefix("torch."),
                    kv_dtype=self.engine.layout.kv_dtype, state_dtype=self.engine.layout.state_dtype,
                    memory=self.engine.memory.describe())
        return info

    def _start_ranks_and_build(self):
        """Start ranks 1..tp-1 (from this, the main thread) -> what builds rank 0's Engine in the
        step thread, once they have joined its group."""
        from actors.engine_rank import RankGroup
        self.ranks, build = RankGroup.start(self.spec, self.log)
        return build

    def _device_name(self) -> str:
        """A one-rank engine's device as the machine numbers it ("cuda:3"), or "cpu"."""
        from actors.engine_rank import device_names
        return device_names(1, self.spec.gpus)[0] if self.spec.gpus else str(self.engine.model.device)

    def busy(self) -> bool:
        return bool(self._routes or self._pending or self._reservations or self._transfer_tasks or self._compiling
                    or self._moving)

    def load(self) -> tuple[float, int, int]:
        s = self.engine.scheduler
        cap = max(1, self.engine.memory.max_running_requests)
        return (len(s.running) + len(s.waiting)) / cap, len(s.running), len(s.waiting)

    async def handle(self, msg: Any, frames: list) -> None:
        if isinstance(msg, (P.EngineRequest, P.HandoffOffer)) and msg.grammar is not None:
            # NOTE: the grammar compiles on the engine's pool, off the loop and the step thread;
            # the message is handled once it has (a refusal is raised by add_request / reserve
            # and answered as a 400; the api holds the response until then)
            task = asyncio.ensure_future(self._after_compile(msg, frames))
            self._compiling.add(task)
            task.add_done_callback(self._compiling.discard)
            return
        await self._handle(msg, frames)

    async def _handle(self, msg: Any, frames: list) -> None:
        if isinstance(msg, P.EngineRequest):
            if self._aborted_early(msg.key):
                return
            # a draining engine still serves what was routed to it before the api stopped routing here
            mm = []
            if msg.mm_items and any(it.tensor is None for it in msg.mm_items):
                # a vision actor computes the embeddings: hold the request until they arrive
                early = self._vision_results.pop(msg.key, None)
                if early is None:
                    self._vision_wait[msg.key] = msg
                    self._vision_since.setdefault(msg.key, time.monotonic())
                    return
                self._vision_since.pop(msg.key, None)
                self._join_vision(msg, *early)
                self._wake.set()
                return
            if msg.mm_items:
                from glmrt.engine.mm import MMInput
                from transport.codec import tensor_from_frame
                for it in msg.mm_items:  # copy: the frames' memory belongs to zmq
                    pixels = tensor_from_frame(it.tensor, frames[it.tensor.frame], as_torch=True).clone()
                    mm.append(MMInput(it.kind, pixels, tuple(it.grid_thw), it.num_tokens))
            self._pending.append(("add", (msg, mm)))
        elif isinstance(msg, P.Abort):
            if self._early_aborts.note(msg):
                for key in [k for k in self._vision_since if msg.drops(k)]:
                    self._vision_forget(key)
            self._pending.append(("abort", msg))
        elif isinstance(msg, P.VisionResult):
            if self._aborted_early(msg.key):
                return
            req_msg = self._vision_wait.pop(msg.key, None)
            if req_msg is None:
                self._vision_results[msg.key] = (msg, frames)
                self._vision_since.setdefault(msg.key, time.monotonic())
                return
            self._vision_since.pop(msg.key, None)
            self._join_vision(req_msg, msg, frames)
        elif isinstance(msg, P.HandoffOffer):
            if self._aborted_early(msg.key):  # refuse it, so the prefill lets go of the state now
                await self.send(msg.prefill, P.HandoffAccept(rid=msg.rid, ok=False, decode=self.spec.actor_id,
                                                             reason="the request was aborted"))
                return
            self._pending.append(("offer", msg))
        elif isinstance(msg, P.HandoffAccept):
            self._pending.append(("accept", msg))
        elif isinstance(msg, P.KVHandoff):
            self._pending.append(("kv", msg))
        elif isinstance(msg, P.HandoffDone):
            self._pending.append(("done", msg))
        elif isinstance(msg, P.ReplayRequest):
            # a request still waiting for its embeddings has no tokens yet: its DetokenizeRequest
            # (perhaps lost with the old detokenizer) is all the restarted one needs
            wanted = {p.key.request for p in msg.progress}
            for key, waiting in list(self._vision_wait.items()):
                if key in wanted and waiting.detokenize is not None:
                    await self.send(msg.detokenizer, waiting.detokenize)
            self._pending.append(("replay", msg))
        self._wake.set()

    async def _after_compile(self, msg: P.EngineRequest | P.HandoffOffer, frames: list) -> None:
        try:
            await asyncio.wrap_future(self.engine.runner.structured.compile(msg.grammar))
        except Exception:  # noqa: BLE001 - add_request / reserve raise it again, as the request's 400
            pass
        await self._handle(msg, frames)

    def _vision_forget(self, key: P.RequestKey) -> P.EngineRequest | None:
        """On the loop: drop what is held for `key`'s embeddings; the request, if it was waiting."""
        self._vision_since.pop(key, None)
        self._vision_results.pop(key, None)
        return self._vision_wait.pop(key, None)

    async def _expire_vision(self, now: float) -> None:
        """A vision actor that died (or never answers) must not hold a request forever."""
        for key in [k for k, t in self._vision_since.items() if now - t > VISION_TIMEOUT_S]:
            waiting = self._vision_forget(key)
            if waiting is not None:
                await self.send(waiting.detokenizer, P.EngineError(
                    key=key, status=503, message="the vision encoder did not return this request's embeddings "
                                                 f"within {VISION_TIMEOUT_S:.0f} s; retry"))

    def _stats(self) -> P.EngineStats:
        e = self.engine
        info = e.info()
        counters = {k: float(v) for k, v in info.items() if isinstance(v, (int, float)) and v is not None}
        return P.EngineStats(actor=self.spec.kind, replica=self.spec.replica,
                             kv_pages_total=e.memory.num_pages, kv_pages_free=e.pages.num_free,
                             state_slots_total=e.memory.num_slots, state_slots_free=e.slots.num_free,
                             max_running_requests=e.memory.max_running_requests,
                             running=len(e.scheduler.running), waiting=len(e.scheduler.waiting), counters=counters)

    def _apply_pending(self) -> list[tuple[str, P.Msg]]:
        """Runs in the step thread: add/abort requests. Returns errors to send."""
        from glmrt.engine.engine import ContextLengthExceeded

        errors = []
        pending = [self._pending.popleft() for _ in range(len(self._pending))]
        for op, arg in pending:
            if op == "abort":
                self._abort(arg)
                continue
            if op == "part":
                errors += self._pd_part(arg)
                continue
            if op == "error":
                m, why = arg
                errors.append((m.detokenizer, P.EngineError(key=m.key, status=400, message=why)))
                continue
            if op in ("offer", "accept", "kv", "done"):
                errors += getattr(self, f"_pd_{op}")(arg)
                continue
            if op == "replay":
                errors += self._replay(arg)
                continue
            m, mm = arg
            if not self.ledger.accept(m.key, m.detokenize):
                continue  # a re-sent request whose first copy reached us (its tokenizer died after sending it)
            error = None
            if self.engine.config.role == "prefill" and not m.decode:
                error = P.EngineError(key=m.key, status=500, message="prefill engine got a request without a decode")
            else:
                try:
                    rids = self.engine.add_request(m.prompt_ids, m.sampling, mm_items=mm or None, grammar=m.grammar)
                except ContextLengthExceeded as e:
                    error = P.EngineError(key=m.key, status=400, message=str(e), code="context_length_exceeded")
                except ValueError as e:
                    error = P.EngineError(key=m.key, status=400, message=str(e))
            if error is not None:
                errors.append((m.detokenizer, error))
                self.ledger.end(m.key)
                continue
            for i, rid in enumerate(rids):  # one engine request per choice, in choice order
                self._routes[rid] = (m.key.with_choice(i), m.detokenizer)
                if m.decode:  # each choice hands over its own params (choice i samples with seed + i)
                    self._pd[rid] = (m.decode, self.engine.requests[rid].params, None)
        return errors

    def _output_so_far(self, key: P.RequestKey, req, last: P.TokenOut | None = None) -> P.TokenOut:
        """Choice `key`'s output from index 0, for a detokenizer replay: the tokens sent so far
        (not the PLACEHOLDER of a step in flight), with `last`'s finish and counts when it ended."""
        from glmrt.engine.runner import PLACEHOLDER
        ids = list(req.output_ids)
        if PLACEHOLDER in ids:
            ids = ids[:ids.index(PLACEHOLDER)]
        logprobs = top = None
        if req.params.logprobs:  # a decode's first logprob stayed with the prefill: 0.0 stands in
            pad = max(0, len(ids) - len(req.logprobs))
            logprobs = ([0.0] * pad + [x if x is not None else 0.0 for x in req.logprobs])[:len(ids)]
            top = ([[]] * pad + [list(map(tuple, t)) if t else [] for t in req.top_logprobs])[:len(ids)]
        if last is None:
            last = P.TokenOut(key=key, token_ids=[], first_index=0, prompt_tokens=len(req.prompt_ids),
                              cached_tokens=req.cached_tokens)
        return msgspec.structs.replace(last, token_ids=ids, first_index=0, completion_tokens=len(ids),
                                       logprobs=logprobs, top_logprobs=top)

    def _replay(self, want: P.ReplayRequest) -> list:
        """Step thread, between steps: every token sent so far is out, none of the next step's."""
        live = [self._output_so_far(key, self.engine.requests[rid]) for rid, (key, detok) in self._routes.items()
                if detok == want.detokenizer and rid in self.engine.requests]
        return self.ledger.replay(want, live)

    def _route_gone(self, key: P.RequestKey) -> None:
        """Step thread: a route of `key`'s request went; once none is left the request ended here."""
        if not any(k.request == key.request for k, _ in self._routes.values()):
            self._prompt_cached.pop(key.request, None)
            self.ledger.end(key.request)

    def _abort(self, abort: P.Abort) -> None:
        """Runs in the step thread: drop the running requests, parked handoffs and reservations
        `abort` names."""
        for rid, (key, _) in list(self._routes.items()):
            if abort.drops(key):
                if self.xfer is not None and self.source.holds(rid):
                    self._release_handoff(rid)
                else:
                    self.engine.abort(rid)
                self.engine.requests.pop(rid, None)
                del self._routes[rid]
                self._pd.pop(rid, None)
                self._route_gone(key)
        for rid in [r for r, (offer, _) in self._reservations.items() if abort.drops(offer.key)]:
            self.sink.cancel(rid)
            del self._reservations[rid]

    def _aborted_early(self, key: P.RequestKey) -> bool:
        """On the loop: whether an abort for `key`'s request came before it (actors/aborts.py)."""
        return key in self._early_aborts

    def _join_vision(self, msg: P.EngineRequest, result: P.VisionResult, frames: list) -> None:
        from glmrt.engine.mm import MMInput
        from transport.codec import tensor_from_frame
        if result.error:
            self._pending.append(("error", (msg, result.error)))
            return
        if result.cuda_ipc:  # the embeddings stayed on the GPU: map them, copy, let go
            from transport.cuda_ipc import import_cuda
            feats = [import_cuda(d).clone() for d in result.cuda_ipc]
        else:
            feats = [tensor_from_frame(ref, frames[ref.frame], as_torch=True).clone() for ref in result.embeddings]
        mm = [MMInput(it.kind, None, tuple(it.grid_thw), it.num_tokens, embeds=f)
              for it, f in zip(msg.mm_items, feats)]
        self._pending.append(("add", (msg, mm)))

    def _step(self) -> tuple[list, list]:
        errors = self._apply_pending()
        if self.xfer is not None:
            errors += self._poll_ranks()
        outs = self.engine.step() if self.engine.has_work() else []
        batches: dict[str, list[P.TokenOut]] = {}
        prompt_cached = self._prompt_cached
        for o in outs:
            route = self._routes.get(o.rid)
            if route is not None and route[0].choice == 0 and route[0] not in prompt_cached:
                prompt_cached[route[0]] = o.cached_tokens
        for o in outs:
            route = self._routes.get(o.rid)
            if route is None:
                continue
            key, detok = route
            req = self.engine.requests.get(o.rid)
            top = [list(map(tuple, t)) if t else [] for t in o.new_top_logprobs] if o.new_top_logprobs else None
            handing_off = o.finish_reason == "handoff"
            finished = o.finished and not handing_off
            out = P.TokenOut(
                key=key, token_ids=o.new_token_ids, first_index=o.completion_tokens - len(o.new_token_ids),
                finished=finished, finish_reason=o.finish_reason if finished else None,
                prompt_tokens=o.prompt_tokens,
                completion_tokens=o.completion_tokens,
                # n > 1: the prompt was computed once, by choice 0; report its cached count for all
                cached_tokens=prompt_cached.get(key.request, o.cached_tokens) if key.choice else o.cached_tokens,
                logprobs=[x if x is not None else 0.0 for x in o.new_logprobs] if o.new_logprobs else None,
                top_logprobs=top, spec_verify_ct=o.spec_verify_ct)
            batches.setdefault(detok, []).append(out)
            if finished:
                del self._routes[o.rid]
                self._pd.pop(o.rid, None)
                if req is not None:
                    self.ledger.finish_choice(self._output_so_far(key, req, out))
                    self.engine.requests.pop(o.rid, None)
                self._route_gone(key)
        if self.xfer is not None:  # prefill/decode roles
            errors += self._offers(outs)
        return errors, list(batches.items())

    async def background(self) -> None:
        loop = asyncio.get_running_loop()
        last_stats = 0.0
        stats_log = EngineStatsLog(self.spec.config.log_interval, time.monotonic())
        while True:
            if not self._pending and not self.engine.has_work():
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(),
                                           timeout=RANK_POLL_S if self.ranks_moving() else STATS_S)
                except asyncio.TimeoutError:
                    pass
            errors, batches = await loop.run_in_executor(self._executor, self._step)
            for dest, err, *tensors in errors:
                await self.send(dest, err, tensors[0] if tensors else ())
            self._watch_transfers()  # the step thread is idle here: _transfers is the loop's
            for dest, items in batches:
                await self.send(dest, P.TokenBatch(items=items))
            now = time.monotonic()
            stats = None
            if now - last_stats >= STATS_S:
                last_stats = now
                stats = self._stats()
                await self.send("api/0", stats)
                await self._expire_vision(now)
            if stats_log.due(now):
                line = stats_log.line(stats or self._stats(), now)
                if line is not None:
                    self.log.info(line)

    async def teardown(self) -> None:
        for task in [*getattr(self, "_transfer_tasks", ()), *getattr(self, "_compiling", ())]:
            task.cancel()
        if getattr(self, "ranks", None) is not None:
            self.ranks.stopping = True
            try:  # after the step in flight (one step thread): the ranks are between steps then
                await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(self._executor, self.ranks.stop, self.engine),
                                       timeout=2 * STOP_RANKS_S)
            except Exception:
                self.ranks.kill()
        if getattr(self, "engine", None) is not None:
            self.engine.runner.structured.close()
        self._executor.shutdown(wait=False)
        if getattr(self, "xfer", None) is not None:
            self.xfer.close()
