"""The engine actor (kind `engine`, alias `unified`): the in-process Engine behind an inbox.

The step runs in a worker thread so the event loop keeps receiving and sending while the
model computes; requests and aborts that arrive during a step are applied between steps
(the Engine is only ever touched by one thread at a time).
"""

from __future__ import annotations

import asyncio
import os
import concurrent.futures
import time
from typing import Any

from actors.base import Actor
from glmrt import env
from glmrt import protocol as P

STATS_S = 1.0
HANDOFF_TIMEOUT_S = 30.0


class EngineActor(Actor):
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
        self.engine = await loop.run_in_executor(self._executor, lambda: Engine(cfg, log=self._log))
        self._pending: list[tuple[str, Any]] = []
        self._wake = asyncio.Event()
        self._routes: dict[str, tuple[P.RequestKey, str]] = {}  # engine rid -> (its choice's key, detok)
        self._prompt_cached: dict[P.RequestKey, int] = {}       # request -> cached prompt tokens of choice 0
        self._pd: dict[str, tuple] = {}          # prefill: engine rid -> (decode id, sampling, offered at)
        self._reservations: dict[str, tuple] = {}  # decode: engine rid -> (Reservation, HandoffOffer)
        self._vision_wait: dict[P.RequestKey, P.EngineRequest] = {}  # waiting for a vision actor's embeddings
        self._vision_results: dict[P.RequestKey, tuple] = {}        # embeddings that came first
        from actors.handoff import layout_of, make_transfer
        self._layout = layout_of(self.engine, os.path.basename(os.path.normpath(cfg.model or cfg.preset or "")))
        self.xfer = make_transfer(self.engine, self.spec.actor_id.replace("/", "-")) if cfg.role != "unified" else None
        self._xfer_peers: set[str] = set()
        self._transfers: list = []   # (handle, decode id, KVHandoff) awaiting completion on the loop
        info = dict(self.engine.info())
        info.update(kv_transfer="nixl" if self.xfer is not None else "frames")
        info.update(backend=self.engine.backend.name, dtype=str(self.engine.dtype).removeprefix("torch."),
                    kv_dtype=self.engine.layout.kv_dtype, state_dtype=self.engine.layout.state_dtype,
                    memory=self.engine.memory.describe())
        return info

    def _log(self, line: str) -> None:
        print(f"[{self.spec.actor_id}] {line}", flush=True)

    def busy(self) -> bool:
        return bool(self._routes) or bool(self._pending) or bool(self._reservations)

    def load(self) -> tuple[float, int, int]:
        s = self.engine.scheduler
        cap = max(1, self.engine.memory.max_running_requests)
        return (len(s.running) + len(s.waiting)) / cap, len(s.running), len(s.waiting)

    async def handle(self, msg: Any, frames: list) -> None:
        if isinstance(msg, P.EngineRequest):
            # a draining engine still serves what was routed to it before the api stopped routing here
            mm = []
            if msg.mm_items and any(it.tensor is None for it in msg.mm_items):
                # a vision actor computes the embeddings: hold the request until they arrive
                early = self._vision_results.pop(msg.key, None)
                if early is None:
                    self._vision_wait[msg.key] = msg
                    return
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
            self._pending.append(("abort", msg))
        elif isinstance(msg, P.EngineStatsQuery):
            await self.send(msg.reply_to, self._stats(msg.qid))
            return
        elif isinstance(msg, P.VisionResult):
            req_msg = self._vision_wait.pop(msg.key, None)
            if req_msg is None:
                self._vision_results[msg.key] = (msg, frames)
                return
            self._join_vision(req_msg, msg, frames)
        elif isinstance(msg, P.HandoffOffer):
            self._pending.append(("offer", msg))
        elif isinstance(msg, P.HandoffAccept):
            self._pending.append(("accept", msg))
        elif isinstance(msg, P.KVHandoff):
            self._pending.append(("kv", (msg, frames)))
        elif isinstance(msg, P.HandoffDone):
            self._pending.append(("done", msg))
        self._wake.set()

    def _stats(self, qid: int = 0) -> P.EngineStats:
        e = self.engine
        info = e.info()
        counters = {k: float(v) for k, v in info.items() if isinstance(v, (int, float)) and v is not None}
        return P.EngineStats(actor=self.spec.kind, replica=self.spec.replica, qid=qid,
                             kv_pages_total=e.memory.num_pages, kv_pages_free=e.pages.num_free,
                             state_slots_total=e.memory.num_slots, state_slots_free=e.slots.num_free,
                             max_running_requests=e.memory.max_running_requests,
                             running=len(e.scheduler.running), waiting=len(e.scheduler.waiting), counters=counters)

    def _apply_pending(self) -> list[tuple[str, P.Msg]]:
        """Runs in the step thread: add/abort requests. Returns errors to send."""
        from glmrt.engine.engine import ContextLengthExceeded

        errors = []
        pending, self._pending = self._pending, []
        for op, arg in pending:
            if op == "abort":
                for rid, (key, _) in list(self._routes.items()):
                    if arg.drops(key):
                        if rid in self.engine.handoffs:
                            self._release_handoff(rid)
                        else:
                            self.engine.abort(rid)
                        self.engine.requests.pop(rid, None)
                        del self._routes[rid]
                for rid in [r for r, (_, offer, _) in self._reservations.items() if arg.drops(offer.key)]:
                    from glmrt.engine import handoff
                    handoff.cancel(self.engine, rid)
                    del self._reservations[rid]
                continue
            if op == "error":
                m, why = arg
                errors.append((m.detokenizer, P.EngineError(key=m.key, status=400, message=why)))
                continue
            if op in ("offer", "accept", "kv", "done"):
                errors += getattr(self, f"_pd_{op}")(arg)
                continue
            m, mm = arg
            if self.engine.config.role == "prefill" and not m.decode:
                errors.append((m.detokenizer, P.EngineError(key=m.key, status=500,
                                                            message="prefill engine got a request without a decode")))
                continue
            try:
                rids = self.engine.add_request(m.prompt_ids, m.sampling, mm_items=mm or None)
            except ContextLengthExceeded as e:
                errors.append((m.detokenizer, P.EngineError(key=m.key, status=400, message=str(e),
                                                            code="context_length_exceeded")))
                continue
            except ValueError as e:
                errors.append((m.detokenizer, P.EngineError(key=m.key, status=400, message=str(e))))
                continue
            for i, rid in enumerate(rids):  # one engine request per choice, in choice order
                self._routes[rid] = (m.key.with_choice(i), m.detokenizer)
                if m.decode:
                    self._pd[rid] = (m.decode, m.sampling, None)
        return errors

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

    # ---- prefill/decode handoff (actors/handoff.py has the protocol) ---------------------
    def _release_handoff(self, rid: str) -> None:
        from glmrt.engine import handoff
        if rid in self.engine.handoffs:
            handoff.release(self.engine, rid)
        self._pd.pop(rid, None)

    def _fail(self, rid: str, status: int, message: str) -> list:
        route = self._routes.pop(rid, None)
        self.engine.requests.pop(rid, None)
        if route is None:
            return []
        return [(route[1], P.EngineError(key=route[0].request, status=status, message=message))]

    def _pd_offer(self, offer: P.HandoffOffer) -> list:
        from actors.handoff import layout_mismatch
        from glmrt.engine import handoff
        reason = layout_mismatch(self._layout, offer.layout)
        if reason is None:
            try:
                params = offer.sampling.replace(n=1)  # the offer is one choice of the request
                res = handoff.reserve(self.engine, offer.rid, offer.prompt_ids, offer.first_token, params)
                self._reservations[offer.rid] = (res, offer, time.monotonic())
                info = None
                if self.xfer is not None and offer.transfer_info:
                    if offer.prefill not in self._xfer_peers:
                        self.xfer.connect(offer.prefill.replace("/", "-"), offer.transfer_info)
                        self._xfer_peers.add(offer.prefill)
                    info = self.xfer.peer_info()
                return [(offer.prefill, P.HandoffAccept(
                    rid=offer.rid, ok=True, decode=self.spec.actor_id, reused_tokens=res.reused_tokens,
                    pages=res.fill_pages(self.engine.config.page_size), slot=res.slot, transfer_info=info))]
            except (handoff.HandoffError, ValueError) as e:
                reason = str(e)
        return [(offer.prefill, P.HandoffAccept(rid=offer.rid, ok=False, decode=self.spec.actor_id, reason=reason))]

    def _pd_accept(self, acc: P.HandoffAccept) -> list:
        from actors.handoff import pack
        rid = acc.rid
        if rid not in self.engine.handoffs:
            return []
        if not acc.ok:
            self._release_handoff(rid)
            return self._fail(rid, 503, f"decode {acc.decode} refused the request: {acc.reason}")
        req = self.engine.handoffs[rid]
        if self.xfer is not None and acc.transfer_info:
            return self._write_state(rid, req, acc)
        comps, tensors = pack(self.engine, rid, acc.reused_tokens)
        c = self.engine.counters
        c["handoff_bytes_sent"] = c.get("handoff_bytes_sent", 0) + sum(x.num_bytes for x in comps)
        _, sampling, _ = self._pd.get(rid, (None, P.SamplingParams(), None))
        detok = self._routes.get(rid, (None, ""))[1]
        msg = P.KVHandoff(rid=rid, prompt_len=len(req.prompt_ids), first_token=req.output_ids[0], components=comps,
                          sampling=sampling, detokenizer=detok, prompt_ids=list(req.prompt_ids))
        return [(acc.decode, msg, tensors)]

    def _write_state(self, rid: str, req, acc: P.HandoffAccept) -> list:
        """One-sided write (NIXL) of the state into the decode's reserved pages and slot."""
        from actors.handoff import pool_tensors, regions
        from glmrt.engine import handoff
        peer = acc.decode.replace("/", "-")
        if acc.decode not in self._xfer_peers:
            self.xfer.connect(peer, acc.transfer_info)
            self._xfer_peers.add(acc.decode)
        src_pages, src_slot = handoff.source_pages(self.engine, rid, acc.reused_tokens)
        local = regions(pool_tensors(self.engine).get, src_pages, src_slot)
        remote = regions(lambda tid: self.xfer.peer_tensor(peer, tid), list(acc.pages), acc.slot)
        # NOTE: a checksum of GPU memory costs a device-to-host copy of the bytes: opt-in
        checksum = env.kv_checksum()
        handle = self.xfer.write(peer, local, remote, checksum=checksum, transfer_id=rid)
        _, sampling, _ = self._pd.get(rid, (None, P.SamplingParams(), None))
        msg = P.KVHandoff(rid=rid, prompt_len=len(req.prompt_ids), first_token=req.output_ids[0], components=[],
                          sampling=sampling, detokenizer=self._routes.get(rid, (None, ""))[1],
                          prompt_ids=list(req.prompt_ids), transfer_id=rid)
        self._transfers.append((handle, acc.decode, msg))
        c = self.engine.counters
        c["handoff_bytes_sent"] = c.get("handoff_bytes_sent", 0) + sum(r.num_bytes for r in local)
        return []

    async def _finish_transfers(self) -> None:
        """On the loop: when a one-sided write completes, tell the decode (or fail the request)."""
        pending, self._transfers = self._transfers, []
        for handle, decode, msg in pending:
            result = await self.xfer.wait(handle, timeout=HANDOFF_TIMEOUT_S)
            if result.ok:
                c = self.engine.counters
                c["handoff_transfer_seconds"] = c.get("handoff_transfer_seconds", 0.0) + result.seconds
                c["handoff_transfers"] = c.get("handoff_transfers", 0) + 1
                await self.send(decode, msg)
            else:
                self._pending.append(("done", P.HandoffDone(rid=msg.rid, ok=False,
                                                            reason=f"state transfer failed: {result.error}")))
                await self.send(decode, P.HandoffDone(rid=msg.rid, ok=False, reason=result.error))
                self._wake.set()

    def _pd_kv(self, arg) -> list:
        from actors.handoff import pool_tensors, regions, unpack
        from glmrt.engine import handoff
        msg, frames = arg
        entry = self._reservations.pop(msg.rid, None)
        if entry is None:
            return []
        res, offer, _ = entry
        try:
            # components in-band (frames), or already written into our pools (NIXL, transfer_id)
            if msg.components:
                moved = unpack(self.engine, res, msg.components, frames)
            else:
                pools = pool_tensors(self.engine)
                moved = sum(r.num_bytes for r in regions(pools.get, res.fill_pages(self.engine.config.page_size),
                                                         res.slot))
        except (handoff.HandoffError, KeyError, ValueError, RuntimeError) as e:
            handoff.cancel(self.engine, msg.rid)
            return [(offer.prefill, P.HandoffDone(rid=msg.rid, ok=False, reason=str(e))),
                    (offer.detokenizer, P.EngineError(key=offer.key.request, status=503,
                                                      message=f"handoff failed: {e}"))]
        handoff.activate(self.engine, msg.rid)
        self.engine.requests[msg.rid].cached_tokens = offer.cached_tokens
        c = self.engine.counters
        c["handoff_bytes_received"] = c.get("handoff_bytes_received", 0) + moved
        c["handoff_reused_tokens"] = c.get("handoff_reused_tokens", 0) + res.reused_tokens
        self._routes[msg.rid] = (offer.key, offer.detokenizer)
        return [(offer.prefill, P.HandoffDone(rid=msg.rid, ok=True))]

    def _pd_done(self, done: P.HandoffDone) -> list:
        rid = done.rid
        if rid in self._reservations:  # decode side: the prefill's write failed
            from glmrt.engine import handoff
            res, offer, _ = self._reservations.pop(rid)
            handoff.cancel(self.engine, rid)
            return []
        self._release_handoff(rid)
        if done.ok:
            self._routes.pop(rid, None)  # the decode side serves it now
            self.engine.requests.pop(rid, None)
            return []
        return self._fail(rid, 503, f"handoff to decode failed: {done.reason}")

    def _offers(self, outs) -> list:
        """Prefill: every request that just produced its first token goes to its decode."""
        msgs = []
        now = time.monotonic()
        for o in outs:
            if o.finish_reason != "handoff" or o.rid not in self.engine.handoffs:
                continue
            decode, sampling, _ = self._pd[o.rid]
            req = self.engine.handoffs[o.rid]
            self._pd[o.rid] = (decode, sampling, now)
            msgs.append((decode, P.HandoffOffer(
                rid=o.rid, key=self._routes[o.rid][0], prompt_ids=list(req.prompt_ids),
                first_token=req.output_ids[0], sampling=sampling, detokenizer=self._routes[o.rid][1],
                prefill=self.spec.actor_id, layout=self._layout, cached_tokens=req.cached_tokens,
                transfer_info=self.xfer.peer_info() if self.xfer is not None else None)))
        for rid, (_, offer, t) in list(self._reservations.items()):  # a prefill that never sends the state
            if now - t > HANDOFF_TIMEOUT_S:
                from glmrt.engine import handoff
                handoff.cancel(self.engine, rid)
                del self._reservations[rid]
        for rid, (decode, _, t) in list(self._pd.items()):  # a decode that never answers
            if t is not None and now - t > HANDOFF_TIMEOUT_S and rid in self.engine.handoffs:
                self._release_handoff(rid)
                msgs += self._fail(rid, 503, f"handoff to {decode} timed out")
        return msgs

    def _step(self) -> tuple[list, list]:
        errors = self._apply_pending()
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
            batches.setdefault(detok, []).append(P.TokenOut(
                key=key, token_ids=o.new_token_ids, first_index=o.completion_tokens - len(o.new_token_ids),
                finished=finished, finish_reason=o.finish_reason if finished else None,
                prompt_tokens=o.prompt_tokens,
                completion_tokens=o.completion_tokens,
                # n > 1: the prompt was computed once, by choice 0; report its cached count for all
                cached_tokens=prompt_cached.get(key.request, o.cached_tokens) if key.choice else o.cached_tokens,
                logprobs=[x if x is not None else 0.0 for x in o.new_logprobs] if o.new_logprobs else None,
                top_logprobs=top))
            if finished:
                del self._routes[o.rid]
                self._pd.pop(o.rid, None)
                if not any(k.request == key.request for k, _ in self._routes.values()):
                    prompt_cached.pop(key.request, None)
                if req is not None:
                    self.engine.requests.pop(o.rid, None)
        errors += self._offers(outs)
        return errors, list(batches.items())

    async def background(self) -> None:
        loop = asyncio.get_running_loop()
        last_stats = 0.0
        while True:
            if not self._pending and not self.engine.has_work():
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=STATS_S)
                except asyncio.TimeoutError:
                    pass
            errors, batches = await loop.run_in_executor(self._executor, self._step)
            for dest, err, *tensors in errors:
                await self.send(dest, err, tensors[0] if tensors else ())
            if self._transfers:
                await self._finish_transfers()
            for dest, items in batches:
                await self.send(dest, P.TokenBatch(items=items))
            now = time.monotonic()
            if now - last_stats >= STATS_S:
                last_stats = now
                await self.send("api/0", self._stats())

    async def teardown(self) -> None:
        self._executor.shutdown(wait=False)
        if getattr(self, "xfer", None) is not None:
            self.xfer.close()
