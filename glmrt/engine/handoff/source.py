"""The prefill side of a handoff: the requests an engine has parked after their first token,
what each one hands over, and letting go once the decode side has it."""

from __future__ import annotations

from dataclasses import dataclass

from glmrt import protocol as P
from glmrt.engine.handoff.components import pool_tensors, state_components


@dataclass(frozen=True)
class Parked:
    """What a decode engine needs to reserve room for a parked request."""

    prompt_ids: list[int]
    first_token: int
    cached_tokens: int


class HandoffSource:
    def __init__(self, engine):
        self.engine = engine

    def holds(self, rid: str) -> bool:
        """Whether request `rid` is parked here, its state awaiting a transfer."""
        return rid in self.engine.handoffs

    def parked(self, rid: str) -> Parked:
        req = self.engine.handoffs[rid]
        return Parked(list(req.prompt_ids), req.output_ids[0], req.cached_tokens)

    def export(self, rid: str, reused_tokens: int) -> list[P.AnyStateComponent]:
        """The components to send: the pages from the decode side's first missing one (it holds
        `reused_tokens`, page-aligned, already) and the live slot. Their rows must not change
        until `release`."""
        engine = self.engine
        req = engine.handoffs[rid]
        ps = engine.config.page_size
        pages = req.pages[reused_tokens // ps:-(-req.num_computed // ps)]
        comps = state_components(pool_tensors(engine), pages, req.slot)
        c = engine.counters
        # over tp ranks every decode rank gets as much: the replicated rows and its shard, of one size
        sent = sum(x.num_bytes for x in comps) * engine.parallel.tp_size
        c["handoff_bytes_sent"] = c.get("handoff_bytes_sent", 0) + sent
        return comps

    def transferred(self, seconds: float) -> None:
        """Count one completed transfer of an exported state."""
        c = self.engine.counters
        c["handoff_transfer_seconds"] = c.get("handoff_transfer_seconds", 0.0) + seconds
        c["handoff_transfers"] = c.get("handoff_transfers", 0) + 1

    def release(self, rid: str) -> None:
        """The decode side has the state, or the request ends here: finish it (its pages and
        state go to the prefix cache like any finished request's)."""
        self.engine.finish_handed_off(rid)
