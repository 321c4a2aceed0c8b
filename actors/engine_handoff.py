"""The engine actor's prefill/decode handoff (the `_pd_*` methods, run in the step thread):
offers, reservations, the state writes on every rank and their completion.

    prefill                                   decode
    first token -> detokenizer (index 0)
    HandoffOffer(prompt, first token, layout) ->  layout check, sink.reserve (pages + slot)
                                              <-  HandoffAccept(ok, reused_tokens, components,
                                                  every rank's transfer info)
    every rank writes its part                ->  (the rows land in every decode rank's pools)
    KVHandoff(components), once all are done  ->  sink.receive, sink.activate
                                              <-  HandoffDone(ok)
    source.release (state -> prefix cache)        decode continues at output index 1

A refused offer (layout mismatch, no room) or a failed write on any rank fails that request
cleanly on both sides (EngineError to the detokenizer; pages and slot freed on both), never a
hang. On an engine of several ranks each rank has its own transfer engine: prefill rank 0
writes the replicated rows (MLA latent and indexer key pages, the indexer tail) to every decode
rank and its KDA shard to decode rank 0; prefill rank r > 0 writes its own KDA shard to decode
rank r when rank 0 publishes it (actors/rank_handoff.py says why it goes this way).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from actors.rank_handoff import rank_xfer_name
from glmrt import env
from glmrt import protocol as P

HANDOFF_TIMEOUT_S = 30.0
RANK_POLL_S = 0.002  # while ranks > 0 still write a handoff, how often rank 0 asks them


@dataclass
class Moving:
    """Prefill: one request's state on its way, from every rank."""

    decode: str
    done: P.KVHandoff            # sent once every part is written
    parts: int                   # parts not finished yet: rank 0's writes (one part) + one per rank > 0
    rank_parts: int              # of those, the ranks > 0 (rank 0 polls them)
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0


class HandoffMixin:
    """The `EngineActor` of a prefill or decode role: its handoff source and sink, its transfer
    engine (and its ranks'), and the messages of a handoff."""

    def _start_handoff(self) -> None:
        """Step thread (at tp > 1 it gathers the ranks' transfer infos, a collective): the
        engine's handoff source and sink, a transfer engine (transport/kv) with rank 0's pools
        registered, and every rank's peer info."""
        from glmrt.engine import handoff
        from transport.kv import make_transfer_engine
        from transport.kv.wire import decode_peer_info

        self.source, self.sink = handoff.HandoffSource(self.engine), handoff.HandoffSink(self.engine)
        self._layout = handoff.handoff_layout(self.engine)
        self.xfer = make_transfer_engine(rank_xfer_name(self.spec.actor_id, 0), prefer=env.kv_transfer())
        for tid, t in handoff.pool_tensors(self.engine).items():
            self.xfer.register(tid, t)
        infos = self.engine.runner.gather_transfer_info(self.xfer.peer_info())
        if not all(infos):
            raise RuntimeError(f"ranks {[r for r, i in enumerate(infos) if not i]} have no transfer engine")
        # NOTE: with GLMRT_KV_TRANSFER=auto each rank picks NIXL or zmq itself: refuse a mix at
        # start, before any request would fail on it
        backends = [decode_peer_info(i).backend for i in infos]
        if len(set(backends)) > 1:
            raise RuntimeError(f"the ranks' transfer engines differ ({', '.join(backends)} by rank); "
                               "set GLMRT_KV_TRANSFER to one backend")
        self._rank_infos = infos[1:]

    def ranks_moving(self) -> bool:
        """Whether ranks > 0 still write a handoff (rank 0 polls them soon, not once a second)."""
        return any(m.rank_parts for m in list(self._moving.values()))

    def _connect(self, name: str, info: bytes) -> None:
        """Connect to a peer's transfer engine `name`, again when its info changed (it restarted).
        The decode connects back to the prefill too, so it can acknowledge checksummed writes."""
        if self._xfer_peers.get(name) != info:
            self.xfer.connect(name, info)
            self._xfer_peers[name] = info

    def _release_handoff(self, rid: str) -> None:
        if self.source.holds(rid):
            self.source.release(rid)
        self._pd.pop(rid, None)

    def _fail(self, rid: str, status: int, message: str) -> list:
        route = self._routes.pop(rid, None)
        self.engine.requests.pop(rid, None)
        if route is None:
            return []
        self._route_gone(route[0])
        return [(route[1], P.EngineError(key=route[0].request, status=status, message=message))]

    def _pd_offer(self, offer: P.HandoffOffer) -> list:
        from glmrt.engine import handoff
        from transport.kv import TransferError
        reason = handoff.layout_mismatch(self._layout, offer.layout)
        if reason is None:
            try:
                params = offer.sampling.replace(n=1)  # the offer is one choice of the request
                res = self.sink.reserve(offer.rid, offer.prompt_ids, offer.first_token, params, grammar=offer.grammar)
            except (handoff.HandoffError, ValueError) as e:
                reason = str(e)
        if reason is None:
            try:
                self._connect(rank_xfer_name(offer.prefill, 0), offer.transfer_info)
            except TransferError as e:
                self.sink.cancel(offer.rid)
                reason = f"cannot reach the prefill's transfer engine: {e}"
        if reason is not None:
            return [(offer.prefill, P.HandoffAccept(rid=offer.rid, ok=False, decode=self.spec.actor_id,
                                                    reason=reason))]
        self._reservations[offer.rid] = (offer, time.monotonic())
        return [(offer.prefill, P.HandoffAccept(
            rid=offer.rid, ok=True, decode=self.spec.actor_id, reused_tokens=res.reused_tokens,
            components=res.components, transfer_info=self.xfer.peer_info(),
            rank_transfer_info=list(self._rank_infos)))]

    def _pd_accept(self, acc: P.HandoffAccept) -> list:
        """Every rank's one-sided writes into the decode ranks' reserved rows (rank 0's posted
        here, the other ranks' published to them); KVHandoff follows once all are done."""
        from glmrt.engine import handoff
        from glmrt.engine.ranks import RankWrite
        from transport.kv import TransferError
        rid = acc.rid
        if not self.source.holds(rid):
            return []
        if not acc.ok:
            self._release_handoff(rid)
            return self._fail(rid, 503, f"decode {acc.decode} refused the request: {acc.reason}")
        tp = self.engine.parallel.tp_size
        peers = [rank_xfer_name(acc.decode, r) for r in range(tp)]
        infos = [acc.transfer_info, *acc.rank_transfer_info]
        handles = []
        try:
            if len(infos) != tp:  # the layout check compared tp: a decode that lost a rank's info
                raise TransferError(f"decode {acc.decode} named {len(infos)} ranks' transfer engines for tp {tp}")
            for name, info in zip(peers, infos):
                self._connect(name, info)
            local = self.source.export(rid, acc.reused_tokens)
            checksum = env.kv_checksum()
            # NOTE: a transfer id names one write of this engine (its ack is matched by it): one per decode rank
            handles.append(self.xfer.write_components(peers[0], local, acc.components, checksum=checksum,
                                                      transfer_id=f"{rid}-r0"))
            (shared, mine), (shared_at, theirs) = handoff.split_by_rank(local), handoff.split_by_rank(acc.components)
            for r, name in enumerate(peers[1:], start=1):  # rank 0's copy of the replicated rows, into every rank
                handles.append(self.xfer.write_components(name, shared, shared_at, checksum=checksum,
                                                          transfer_id=f"{rid}-r{r}"))
        except TransferError as e:
            if handles:  # a write already posted may still land in the decode's rows: fail once it ended
                self._moving[rid] = Moving(acc.decode, P.KVHandoff(rid=rid, components=acc.components), 1, 0,
                                           errors=[str(e)])
                self._transfers.append((rid, handles))
                return []
            self._release_handoff(rid)
            return ([(acc.decode, P.HandoffDone(rid=rid, ok=False, reason=str(e)))]
                    + self._fail(rid, 503, f"handoff to {acc.decode} failed: {e}"))
        # ranks > 0: their own KDA shards, posted by each in step with this one
        self.engine.runner.publish_writes([RankWrite(rid, peers, infos, mine, theirs, checksum)] if tp > 1 else [])
        self._moving[rid] = Moving(acc.decode, P.KVHandoff(rid=rid, components=acc.components), tp, tp - 1)
        self._transfers.append((rid, handles))
        return []

    def _watch_transfers(self) -> None:
        """On the loop, after a step: rank 0's writes started in it complete on a task of their
        own, so the next steps (and other requests' tokens) never wait behind a transfer."""
        started, self._transfers = self._transfers, []
        for rid, handles in started:
            task = asyncio.ensure_future(self._finish_transfer(rid, handles))
            self._transfer_tasks.add(task)
            task.add_done_callback(self._transfer_tasks.discard)

    async def _finish_transfer(self, rid: str, handles: list) -> None:
        """When rank 0's writes end, the step thread counts them as one part of the handoff."""
        from glmrt.engine.ranks import RankReport
        results = await asyncio.gather(*(self.xfer.wait(h, timeout=HANDOFF_TIMEOUT_S) for h in handles))
        failed = [r.error for r in results if not r.ok]
        self._pending.append(("part", RankReport(rid, not failed, max(r.seconds for r in results),
                                                 "; ".join(failed) or None)))
        self._wake.set()

    def _poll_ranks(self) -> list:
        """Step thread: the parts ranks > 0 finished, when any is awaited."""
        if not self.ranks_moving():
            return []
        return [m for r in self.engine.runner.poll_writes() for m in self._pd_part(r, rank_part=True)]

    def _pd_part(self, report, rank_part: bool = False) -> list:
        """One part of a handoff ended; once all have, KVHandoff to the decode, or (any failed)
        the request fails on both sides."""
        m = self._moving.get(report.rid)
        if m is None:
            return []
        m.parts -= 1
        m.rank_parts -= int(rank_part)
        m.seconds = max(m.seconds, report.seconds)
        if not report.ok:
            m.errors.append(report.error or "unknown error")
        if m.parts:
            return []
        rid = report.rid
        del self._moving[rid]
        if not self.source.holds(rid):  # aborted or timed out meanwhile: already let go
            return []
        if not m.errors:
            self.source.transferred(m.seconds)
            return [(m.decode, m.done)]
        reason = f"state transfer failed: {'; '.join(m.errors)}"
        self._release_handoff(rid)
        return ([(m.decode, P.HandoffDone(rid=rid, ok=False, reason=reason))]
                + self._fail(rid, 503, f"handoff to {m.decode} failed: {reason}"))

    def _pd_kv(self, msg: P.KVHandoff) -> list:
        from glmrt.engine import handoff
        entry = self._reservations.pop(msg.rid, None)
        if entry is None:
            return []
        offer, _ = entry
        try:
            self.sink.receive(msg.rid, msg.components)
        except handoff.HandoffError as e:
            self.sink.cancel(msg.rid)
            return [(offer.prefill, P.HandoffDone(rid=msg.rid, ok=False, reason=str(e))),
                    (offer.detokenizer, P.EngineError(key=offer.key.request, status=503,
                                                      message=f"handoff failed: {e}"))]
        self.sink.activate(msg.rid, cached_tokens=offer.cached_tokens)
        self._routes[msg.rid] = (offer.key, offer.detokenizer)
        self.ledger.hold(offer.key.request, offer.detokenize)
        return [(offer.prefill, P.HandoffDone(rid=msg.rid, ok=True))]

    def _pd_done(self, done: P.HandoffDone) -> list:
        rid = done.rid
        if rid in self._reservations:  # decode side: the prefill's write failed
            del self._reservations[rid]
            self.sink.cancel(rid)
            return []
        self._release_handoff(rid)
        if done.ok:
            route = self._routes.pop(rid, None)  # the decode side serves it now
            self.engine.requests.pop(rid, None)
            if route is not None:
                self._route_gone(route[0])
            return []
        return self._fail(rid, 503, f"handoff to decode failed: {done.reason}")

    def _grammar_of(self, rid: str):
        req = self.engine.handoffs.get(rid) or self.engine.requests.get(rid)
        return req.grammar if req is not None else None

    def _offers(self, outs) -> list:
        """Prefill: every request that just produced its first token goes to its decode."""
        msgs = []
        now = time.monotonic()
        for o in outs:
            if o.finish_reason != "handoff" or not self.source.holds(o.rid):
                continue
            decode, sampling, _ = self._pd[o.rid]
            parked = self.source.parked(o.rid)
            key, detok = self._routes[o.rid]
            self._pd[o.rid] = (decode, sampling, now)
            msgs.append((decode, P.HandoffOffer(
                rid=o.rid, key=key, prompt_ids=parked.prompt_ids,
                first_token=parked.first_token, sampling=sampling, detokenizer=detok,
                prefill=self.spec.actor_id, layout=self._layout, transfer_info=self.xfer.peer_info(),
                cached_tokens=parked.cached_tokens, detokenize=self.ledger.detokenize.get(key.request),
                grammar=self._grammar_of(o.rid))))
        for rid, (_, t) in list(self._reservations.items()):  # a prefill that never sends the state
            if now - t > HANDOFF_TIMEOUT_S:
                self.sink.cancel(rid)
                del self._reservations[rid]
        for rid, (decode, _, t) in list(self._pd.items()):  # a decode that never answers
            if t is not None and now - t > HANDOFF_TIMEOUT_S and self.source.holds(rid):
                self._release_handoff(rid)
                msgs += self._fail(rid, 503, f"handoff to {decode} timed out")
        return msgs
