"""The decode side of a handoff: reserve room for a request, check the state that arrived,
activate the request (or cancel the reservation)."""

from __future__ import annotations

from dataclasses import dataclass

from glmrt import protocol as P
from glmrt.cache.slot_manager import LIVE
from glmrt.engine.handoff.components import HandoffError, pool_tensors, state_components
from glmrt.engine.request import Request, Status
from glmrt.sampling_params import Grammar, SamplingParams


@dataclass
class Reservation:
    rid: str
    reused_tokens: int        # page-aligned prefix already in the decode side's cache
    pages: list[int]          # the request's pages on the decode side, in position order
    slot: int
    components: list[P.AnyStateComponent]   # the rows the prefill writes: pages from reused_tokens on, the slot


class HandoffSink:
    def __init__(self, engine):
        self.engine = engine
        self._reserved: dict[str, Reservation] = {}

    def holds(self, rid: str) -> bool:
        return rid in self._reserved

    def reservation(self, rid: str) -> Reservation:
        return self._reserved[rid]

    def reserve(self, rid: str, prompt_ids: list[int], first_token: int, params: SamplingParams,
                grammar: Grammar | None = None) -> Reservation:
        """Pages (reusing cached full pages of the same prefix) and a live slot, or HandoffError.
        With a `grammar` the decode owns the choice's matcher from here: the prefill's first
        token goes through it (a grammar that cannot compile raises GrammarError)."""
        engine = self.engine
        if rid in engine.requests:
            raise HandoffError(f"request {rid!r} is already on this engine")
        structured = engine.runner.structured
        compiled = structured.compiled(grammar) if grammar is not None else None
        structured.check_budget(params.max_thinking_tokens)
        ps = engine.config.page_size
        n_pages = -(-len(prompt_ids) // ps)
        # with a host tier, cached pages there are loaded back (the request waits for them)
        waits = [] if engine.tree.host is not None else None
        shared, reused = engine.tree.match_pages(prompt_ids, len(prompt_ids), waits, engine.scheduler._grab_pages)
        engine.pages.retain(shared)  # before any eviction below can free them
        need = n_pages - len(shared)
        if not engine.pages.can_allocate(need):
            engine.tree.evict(need_pages=need)
        if engine.slots.num_free == 0:
            engine.tree.evict(need_slots=1)
        if not engine.pages.can_allocate(need) or engine.slots.num_free == 0:
            if waits:
                engine.tree.host.pool.fence()
            engine.pages.release(shared)
            raise HandoffError(f"no room for request {rid!r}: {need} pages and a slot needed")
        pages = shared + engine.pages.allocate(need)
        slot = engine.slots.allocate(LIVE)
        req = Request(rid, list(prompt_ids), params, engine.next_arrival(), output_ids=[int(first_token)],
                      status=Status.WAITING, slot=slot, pages=pages, num_computed=0, cached_tokens=reused,
                      admitted_once=True, waits=waits or [], grammar=grammar)
        structured.attach(req, compiled)
        engine.requests[rid] = req
        engine.imports[rid] = req
        res = Reservation(rid, reused, list(pages), slot,
                          state_components(pool_tensors(engine), pages[reused // ps:], slot))
        self._reserved[rid] = res
        return res

    def receive(self, rid: str, components: list[P.AnyStateComponent]) -> int:
        """The prefill says `components` are written: they must be exactly the reserved rows.
        Returns the bytes received (by rank 0; the counter counts every rank's)."""
        want = self._reserved[rid].components
        if components != want:
            raise HandoffError(f"the state written is not the reservation: got "
                               f"{[(c.kind, c.rows) for c in components]}, reserved {[(c.kind, c.rows) for c in want]}")
        moved = sum(c.num_bytes for c in components)
        c = self.engine.counters
        c["handoff_bytes_received"] = c.get("handoff_bytes_received", 0) + moved * self.engine.parallel.tp_size
        return moved

    def activate(self, rid: str, cached_tokens: int | None = None) -> None:
        """The state has arrived; the request decodes from its first token. `cached_tokens`
        (what the prefill side had cached) replaces the decode side's count in its usage."""
        res = self._reserved.pop(rid)
        engine = self.engine
        req = engine.imports.pop(rid)
        req.num_computed = len(req.prompt_ids)
        req.status = Status.RUNNING
        if cached_tokens is not None:
            req.cached_tokens = cached_tokens
        engine.scheduler.running.append(req)
        engine.counters["prompt_tokens"] += len(req.prompt_ids)
        engine.counters["handoff_reused_tokens"] = engine.counters.get("handoff_reused_tokens", 0) + res.reused_tokens

    def cancel(self, rid: str) -> None:
        """The transfer failed or the request was aborted: give the reservation back."""
        self._reserved.pop(rid, None)
        req = self.engine.imports.pop(rid, None)
        if req is not None:
            self.engine.scheduler.free_request(req)
            self.engine.runner.structured.forget(req)
            req.status = Status.FINISHED
            self.engine.requests.pop(rid, None)
