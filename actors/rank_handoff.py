"""PD handoff on an engine of several ranks: each rank's own transfer engine, and the part of a
handoff a rank other than 0 executes when rank 0 says so.

Every rank of a prefill or decode engine of tp N registers its own pools with a transfer engine
of its own (`rank_xfer_name`: "prefill-0" for rank 0, "prefill-0-r1" ...). Rank 0 gathers the
others' peer infos once (op "handoff_info") and sends them in its HandoffOffer / HandoffAccept,
so the prefill's rank r reaches the decode's rank r. Who writes what:

    KDA conv + recurrent state (split by head)  prefill rank r -> decode rank r, its own shard
    MLA latent pages, indexer key pages, tail   prefill rank 0 -> every decode rank
    (replicated on every rank)                  (rank 0's copy only, sent once to each pool)

Rank 0 writes the replicated rows to every decode rank itself rather than having each decode
rank pull them: the writes stay one-sided, so the decode's ranks do nothing to receive (their
transfer engines' workers land the bytes) and need no step of their own, and the prefill's
ranks other than 0 move only what only they hold. Page and slot ids are rank 0's allocation
on both sides and the same in every rank's pools, so rank 0's plan names every rank's rows.

A rank > 0 posts its write when rank 0 publishes op "handoff_write" (in step with rank 0,
right after rank 0 posted its own) and reports the writes that finished when rank 0 publishes
op "handoff_poll"; rank 0 sends KVHandoff only once every rank's part is done, and fails the
request on both sides when any part fails. A rank never waits for a write: one not done within
`timeout` is abandoned and reported failed, so a handoff always ends.
"""

from __future__ import annotations

import time

from glmrt import env
from glmrt.engine.ranks import RankReport, RankWrite


def rank_xfer_name(actor_id: str, rank: int) -> str:
    """The transfer-engine name of an engine's rank (unique in the deployment: NIXL's agent name)."""
    name = actor_id.replace("/", "-")
    return name if rank == 0 else f"{name}-r{rank}"


class RankTransfers:
    """A rank > 0 of a PD engine: its transfer engine with its pools registered, and its writes."""

    def __init__(self, actor_id: str, rank: int, model_rank, timeout: float):
        from glmrt.engine.handoff import pool_tensors
        from transport.kv import make_transfer_engine

        self.timeout = timeout
        self.xfer = make_transfer_engine(rank_xfer_name(actor_id, rank), prefer=env.kv_transfer())
        for tid, t in pool_tensors(model_rank).items():
            self.xfer.register(tid, t)
        self._peers: dict[str, bytes] = {}
        self._posted: dict[str, tuple] = {}        # rid -> (handle, posted at)
        self._failed: list[RankReport] = []        # writes that could not be posted

    def info(self) -> bytes:
        return self.xfer.peer_info()

    def write(self, writes: list[RankWrite], rank: int) -> None:
        """Post this rank's part of each handoff (never raises: a failure is reported by `poll`)."""
        for w in writes:
            try:
                peer, info = w.peers[rank], w.infos[rank]
                if self._peers.get(peer) != info:
                    self.xfer.connect(peer, info)
                    self._peers[peer] = info
                handle = self.xfer.write_components(peer, w.local, w.remote, checksum=w.checksum,
                                                    transfer_id=f"{w.rid}-r{rank}")
            except Exception as e:  # noqa: BLE001 — one write that cannot start fails its request, not the group
                self._failed.append(RankReport(w.rid, False, error=f"rank {rank}: {e}"))
                continue
            self._posted[w.rid] = (handle, time.monotonic())

    def poll(self) -> list[RankReport]:
        """The writes that ended since the last poll: done, failed, or abandoned past the timeout."""
        out, self._failed = self._failed, []
        now = time.monotonic()
        for rid, (handle, since) in list(self._posted.items()):
            result = handle.result
            if result is None and now - since > self.timeout:
                result = self.xfer.abandon(handle, self.timeout)
            if result is None:
                continue
            del self._posted[rid]
            out.append(RankReport(rid, result.ok, result.seconds, result.error))
        return out

    def close(self) -> None:
        self.xfer.close()
