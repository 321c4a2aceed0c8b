"""The host tier's memory: one host tensor per device pool tensor, and the copies between them.

    device pool tensor           host tensor (rows first: one row is contiguous)
    kv.latent  [L, pages, ...]   latent [host pages, L, ...]      page rows
    kv.pooled  [L, pages, ...]   pooled [host pages, L, ...]
    state.conv [L, slots, ...]   conv   [host slots, L, ...]      slot rows (checkpoints)
    ... recurrent, tail_k, tail_g, last_hidden alike

The host tensors are keyed by the names of the device pool tensors (`pool_tensors`), so a
rank's host tier mirrors whatever that rank's pools hold. Copies run on a copy stream of their
own on CUDA (host memory pinned), plain copies on the CPU; each copy returns a ticket, done
when `ready(ticket)`. The compute stream waits for the copy stream (`fence`) before it may
write device rows a copy still reads or writes.

On an engine of several ranks every rank has a pool of the same rows holding its own shard
(its KDA heads; its own copy of the replicated MLA latent pages and indexer keys). Rank 0's
tier decides every copy; its pool keeps a journal of them (`take_journal`), which travels in
the next step's ForwardInputs, and the other ranks `replay` it before that step's forward:
the same copies and fences in the same order against the same device state, so tickets are
numbered alike on every rank and rank 0's "done" tickets name the same copies everywhere.
"""

from __future__ import annotations

import math

import msgspec
import torch

PAGE_TENSORS = ("latent", "pooled")
SLOT_TENSORS = ("conv", "recurrent", "tail_k", "tail_g", "last_hidden")


class HostOp(msgspec.Struct, array_like=True, omit_defaults=True):
    """One operation of rank 0's host tier, as the other ranks replay it on their own shard:

        store | load       (from row, to row) `pages` and `slots` pairs, device <-> host
        fence              the compute stream waits for the copies issued so far
        disk_put           host rows -> the entry `key` of this rank's disk store: a page
                           (`page`), or a checkpoint (`slot`, its partial page `page` or -1, `meta`)
        disk_get           the entry `key` -> those host rows
        disk_remove        the entry `key` leaves the store (rank 0's store evicted it)
    """

    op: str
    pages: list[tuple[int, int]] = []
    slots: list[tuple[int, int]] = []
    key: str = ""
    page: int = -1
    slot: int = -1
    meta: list[int] = []


def pool_tensors(cache) -> dict[str, torch.Tensor]:
    """A ModelCache's device pool tensors by name ([layers, rows, ...] each)."""
    kv, st = cache.kv, cache.state
    return {"latent": kv.latent, "pooled": kv.pooled, "conv": st.conv, "recurrent": st.recurrent,
            "tail_k": st.tail_k, "tail_g": st.tail_g, "last_hidden": st.last_hidden}


def row_bytes(pools: dict[str, torch.Tensor], names: tuple[str, ...]) -> int:
    """Bytes of one row (axis 1, every layer) of each tensor in `names`, summed."""
    return sum(t.shape[0] * math.prod(t.shape[2:]) * t.element_size() for t in (pools[n] for n in names))


def host_rows(device_pools: dict[str, torch.Tensor], budget_bytes: int) -> tuple[int, int]:
    """(pages, slots) of a host tier of `budget_bytes`, split between pages and slots as the
    device pools are."""
    page_b, slot_b = row_bytes(device_pools, PAGE_TENSORS), row_bytes(device_pools, SLOT_TENSORS)
    dev_pages, dev_slots = device_pools["latent"].shape[1], device_pools["conv"].shape[1]
    device_bytes = dev_pages * page_b + dev_slots * slot_b
    scale = budget_bytes / device_bytes
    return int(dev_pages * scale), int(dev_slots * scale)


def _runs(rows: list[int]) -> list[tuple[int, int, int]]:
    """(index into rows, first row, length) of each run of consecutive row ids."""
    out = []
    i = 0
    while i < len(rows):
        j = i + 1
        while j < len(rows) and rows[j] == rows[j - 1] + 1:
            j += 1
        out.append((i, rows[i], j - i))
        i = j
    return out


class HostPool:
    def __init__(self, device_pools: dict[str, torch.Tensor], num_pages: int, num_slots: int):
        if num_pages < 1 or num_slots < 1:
            raise ValueError(f"the host tier needs at least one page and one slot (got {num_pages} pages, "
                             f"{num_slots} slots): raise --hicache-size or --hicache-ratio")
        self.device_pools = device_pools
        self.num_pages, self.num_slots = num_pages, num_slots
        self.cuda = next(iter(device_pools.values())).is_cuda
        pin = self.cuda and torch.cuda.is_available()
        self.tensors: dict[str, torch.Tensor] = {}
        for name, t in device_pools.items():
            rows = num_pages if name in PAGE_TENSORS else num_slots
            self.tensors[name] = torch.zeros((rows, t.shape[0], *t.shape[2:]), dtype=t.dtype, device="cpu",
                                             pin_memory=pin)
        self.page_bytes = row_bytes(device_pools, PAGE_TENSORS)
        self.slot_bytes = row_bytes(device_pools, SLOT_TENSORS)
        # the same rows' bytes over every rank of the engine (set by build_host_pool): what the
        # engine's counters report, each rank copying its own shard of a row
        self.engine_page_bytes, self.engine_slot_bytes = self.page_bytes, self.slot_bytes
        self.engine_nbytes = self.nbytes
        self.stream = torch.cuda.Stream(device=next(iter(device_pools.values())).device) if self.cuda else None
        self._tickets: dict[int, torch.cuda.Event] = {}
        self._keep: dict[int, list[torch.Tensor]] = {}   # staging tensors alive until their copy is done
        self._next = 1
        self.journal: list[HostOp] | None = None  # rank 0 of several: what the others replay
        self.disk_mirror = None  # another rank of several with a disk tier: glmrt.cache.disk_tier.DiskMirror
        self._loads: set[int] = set()  # with a journal: loads in flight (a forward may wait for them)
        self._done: list[int] = []     # with a journal: loads seen finished since the last take_journal

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    # ---- copies --------------------------------------------------------------------------
    def store(self, pages: list[tuple[int, int]], slots: list[tuple[int, int]]) -> int:
        """Device -> host: (device row, host row) pairs of pages and of slots. Returns a ticket."""
        return self._copy(pages, slots, to_host=True)

    def load(self, pages: list[tuple[int, int]], slots: list[tuple[int, int]]) -> int:
        """Host -> device: (host row, device row) pairs of pages and of slots. Returns a ticket."""
        return self._copy(pages, slots, to_host=False)

    def _copy(self, pages, slots, to_host: bool) -> int:
        ticket = self._next
        self._next += 1
        if self.journal is not None:
            self.journal.append(HostOp("store" if to_host else "load", list(pages), list(slots)))
            if not to_host and self.stream is not None:
                self._loads.add(ticket)
        if self.stream is None:
            self._do_copy(pages, slots, to_host, [])
            return ticket
        self._reap()
        keep: list[torch.Tensor] = []
        self.stream.wait_stream(torch.cuda.current_stream())  # the rows as the compute stream left them
        with torch.cuda.stream(self.stream):
            self._do_copy(pages, slots, to_host, keep)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        self._tickets[ticket] = ev
        self._keep[ticket] = keep
        return ticket

    def _do_copy(self, pages, slots, to_host: bool, keep: list) -> None:
        for names, pairs in ((PAGE_TENSORS, pages), (SLOT_TENSORS, slots)):
            if not pairs:
                continue
            if to_host:
                dev_rows, host_rows_ = [a for a, _ in pairs], [b for _, b in pairs]
            else:
                host_rows_, dev_rows = [a for a, _ in pairs], [b for _, b in pairs]
            idx = torch.tensor(dev_rows, dtype=torch.long).to(self.device_pools[names[0]].device)
            for name in names:
                d, h = self.device_pools[name], self.tensors[name]
                if to_host:  # gather on the device, rows first, then contiguous runs to the host
                    staged = d.index_select(1, idx).transpose(0, 1).contiguous()
                    keep.append(staged)
                    for i, h0, n in _runs(host_rows_):
                        h[h0:h0 + n].copy_(staged[i:i + n], non_blocking=True)
                else:        # contiguous host runs to a device staging tensor, then scatter
                    staged = torch.empty((len(pairs), *h.shape[1:]), dtype=h.dtype, device=d.device)
                    keep.append(staged)
                    for i, h0, n in _runs(host_rows_):
                        staged[i:i + n].copy_(h[h0:h0 + n], non_blocking=True)
                    d.index_copy_(1, idx, staged.transpose(0, 1))

    def ready(self, ticket: int) -> bool:
        ev = self._tickets.get(ticket)
        if ev is None:
            return True
        if not ev.query():
            return False
        self._forget(ticket)
        return True

    def _forget(self, ticket: int) -> None:
        del self._tickets[ticket]
        self._keep.pop(ticket, None)
        if ticket in self._loads:
            self._loads.discard(ticket)
            self._done.append(ticket)

    def _reap(self) -> None:
        """Forget the copies that have finished (stores are never asked about: their staging
        tensors go here)."""
        for t in [t for t, ev in self._tickets.items() if ev.query()]:
            self._forget(t)

    def fence(self) -> None:
        """The compute stream waits for every copy issued so far (before it reuses their rows)."""
        if self.journal is not None and self.stream is not None and self.journal[-1:] != [HostOp("fence")]:
            self.journal.append(HostOp("fence"))  # one fence stands for several in a row
        if self.stream is not None:
            self._reap()
            if self._tickets:
                torch.cuda.current_stream().wait_stream(self.stream)

    # ---- the other ranks of an engine of several -------------------------------------------
    def note(self, op: HostOp) -> None:
        """Rank 0 of several: an operation on the host rows outside the copies (the disk tier's)."""
        if self.journal is not None:
            self.journal.append(op)

    def take_journal(self) -> tuple[list[HostOp], list[int]]:
        """Rank 0: the operations issued since the last call, and the loads seen finished
        since then (the step about to run may read their rows)."""
        ops, done = self.journal, self._done
        self.journal, self._done = [], []
        return ops, done

    def replay(self, ops: list[HostOp], done: list[int]) -> None:
        """Another rank: perform rank 0's journal on this rank's shard, then make the compute
        stream wait for the loads rank 0 saw finish (the coming forward may read their rows;
        the other copies stay on the copy stream, as on rank 0)."""
        for op in ops:
            if op.op == "fence":
                self.fence()
            elif op.op in ("store", "load"):
                self._copy(op.pages, op.slots, to_host=op.op == "store")
            else:
                self.disk_mirror.apply(op)
        for t in done:
            ev = self._tickets.get(t)
            if ev is not None:
                torch.cuda.current_stream().wait_event(ev)

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()
            for t in list(self._tickets):
                self.ready(t)
