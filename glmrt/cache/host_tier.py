"""The host tier of the radix prefix cache (`--enable-hierarchical-cache`): where evicted
nodes go while host memory lasts, and where hits on them load from.

A node moves whole: its KV pages (MLA latent and pooled indexer keys, one host page per
device page) and the KDA state checkpoints anchored at it (each checkpoint's slot — conv
window, recurrent state, indexer tail, kept last hidden state — and its partial page). Host
rows have their own managers (`PageManager`, `SlotManager` over the host pool's rows), so a
node is on the device (`node.pages`), on the host (`node.host_pages`), or both:

    write_through  a node's pages and checkpoints are copied to the host as soon as the tree
                   holds them: evicting them from the device then costs no copy
    write_back     copied only when evicted from the device

Host space is reclaimed LRU: a host copy of something still on the device is simply freed;
a node only on the host (a leaf) or a checkpoint only on the host is dropped from the tree.
Loads and stores go through `HostPool` (a copy stream on CUDA); a request whose prefix is
loading waits for its own tickets only (`ready`).

On an engine of several ranks this tier, like the tree, is rank 0's: every rank holds a
`HostPool` of the same rows (its own shard of each node), and the copies this tier issues on
rank 0's pool are performed by the other ranks from rank 0's journal, in the same order, before
the next step's forward (glmrt.cache.host_pool). A node moves on every rank at once.
"""

from __future__ import annotations

import hashlib
import socket

from glmrt.cache.host_pool import HostPool, host_rows, pool_tensors
from glmrt.cache.page_manager import PageManager
from glmrt.cache.radix import Node
from glmrt.cache.slot_manager import CHECKPOINT, SlotManager

WRITE_POLICIES = ("write_through", "write_back")


def build_host_pool(cache, size_bytes: int, ratio: float, link=None) -> HostPool:
    """This rank's host rows for a ModelCache: `size_bytes` (0: `ratio` x the device pools'
    bytes) per rank. Refused when the host's available memory is smaller than what every rank
    on it asks for. `link` (glmrt.engine.ranks.PlanLink, an engine of several ranks): every
    rank measures before any allocates, each host is checked against all of its ranks, and all
    ranks take the same (smallest) rows, so rank 0's row ids are valid on every rank."""
    from glmrt.devices import mem_available_bytes

    pools = pool_tensors(cache)
    want = size_bytes if size_bytes > 0 else int(ratio * (cache.kv.nbytes + cache.state.nbytes))
    pages, slots = host_rows(pools, want)
    free = mem_available_bytes()
    row = [_host_id(), free, want, pages, slots]
    ranks = [row] if link is None else link.gather(row)
    for host in dict.fromkeys(r[0] for r in ranks):  # the same verdict on every rank
        mine = [r for r in ranks if r[0] == host]
        need, avail = sum(r[2] for r in mine), min(r[1] for r in mine)
        if need > avail:
            each = f" ({len(mine)} ranks x {want / 2**30:.2f} GiB)" if len(mine) > 1 else ""
            raise ValueError(f"the host tier needs {need / 2**30:.2f} GiB of host memory{each} and "
                             f"{avail / 2**30:.2f} GiB is available: lower --hicache-size or --hicache-ratio")
    pool = HostPool(pools, min(r[3] for r in ranks), min(r[4] for r in ranks))
    if link is not None:
        sizes = link.gather([pool.page_bytes, pool.slot_bytes, pool.nbytes])
        pool.engine_page_bytes, pool.engine_slot_bytes, pool.engine_nbytes = (sum(c) for c in zip(*sizes))
    return pool


def _host_id() -> int:
    """This machine, as an int64 (ranks that share one share its memory)."""
    return int.from_bytes(hashlib.sha256(socket.gethostname().encode()).digest()[:8], "little", signed=True)


class HostTier:
    def __init__(self, pool: HostPool, write_policy: str = "write_through", disk=None):
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"hicache write policy must be one of {WRITE_POLICIES}, got {write_policy!r}")
        self.pool = pool
        self.write_through = write_policy == "write_through"
        self.pages = PageManager(pool.num_pages)
        self.slots = SlotManager(pool.num_slots)
        self.tree = None  # the RadixCache this tier serves (set by it)
        self.disk = disk  # glmrt.cache.disk_tier.DiskTier: where what leaves the host goes, or None
        if disk is not None:
            disk.host = self
        self.counters = {"host_load_bytes": 0, "host_store_bytes": 0, "host_loads": 0, "host_stores": 0,
                         "host_hit_tokens": 0, "host_dropped_nodes": 0}

    # ---- room on the host ----------------------------------------------------------------
    def _candidates(self):
        """Host entries to reclaim, LRU first: (last_use, kind, item)."""
        out = []
        stack = [self.tree.root]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            for c in n.checkpoints:
                if c.host_slot is not None and c.pins == 0:
                    out.append((c.last_use, 0, c))
            if n.host_pages is not None and n.pins == 0 and n is not self.tree.root:
                if n.pages or (not n.children and not n.checkpoints):
                    out.append((n.last_use, 1, n))
        out.sort(key=lambda x: (x[0], x[1]))
        return [x[2] for x in out]

    def make_room(self, pages: int, slots: int) -> bool:
        """Free host rows until `pages` pages and `slots` slots are free; False if it cannot."""
        while self.pages.num_free < pages or self.slots.num_free < slots:
            victims = self._candidates()
            if slots and self.slots.num_free < slots:
                victims = [v for v in victims if not isinstance(v, Node)] or victims
            if not victims:
                return False
            v = victims[0]
            if isinstance(v, Node):
                if v.pages:
                    self._free_node_copy(v)
                else:
                    if self.disk is not None:
                        self.disk.spill_node(v)
                    self.tree._drop(v)
                    self.counters["host_dropped_nodes"] += 1
            elif v.slot is not None:            # a checkpoint also on the device
                self._free_checkpoint_copy(v)
            else:
                if self.disk is not None:
                    self.disk.spill_checkpoint(v)
                self.tree._drop(v)
        return True

    def _free_node_copy(self, node) -> None:
        self.pages.release(node.host_pages)
        node.host_pages = None

    def _free_checkpoint_copy(self, c) -> None:
        self.slots.free(c.host_slot)
        if c.host_partial is not None:
            self.pages.release([c.host_partial])
        c.host_slot = c.host_partial = None

    # ---- device -> host ------------------------------------------------------------------
    def backup_node(self, node) -> bool:
        """Copy a device node's pages to the host (no-op when it has a host copy)."""
        if node.host_pages is not None:
            return True
        n = len(node.pages)
        node.pins += 1
        try:
            if not self.make_room(n, 0):
                return False
        finally:
            node.pins -= 1
        host = self.pages.allocate(n)
        self.pool.store(list(zip(node.pages, host)), [])
        node.host_pages = host
        self._count_store(n, 0)
        return True

    def backup_checkpoint(self, c) -> bool:
        if c.host_slot is not None:
            return True
        n_pages = 1 if c.partial_page is not None else 0
        c.pins += 1
        try:
            if not self.make_room(n_pages, 1):
                return False
        finally:
            c.pins -= 1
        c.host_slot = self.slots.allocate(CHECKPOINT)
        pages = []
        if c.partial_page is not None:
            c.host_partial = self.pages.allocate(1)[0]
            pages = [(c.partial_page, c.host_partial)]
        self.pool.store(pages, [(c.slot, c.host_slot)])
        self._count_store(n_pages, 1)
        return True

    def offload_node(self, node) -> bool:
        """Move a device node and its device checkpoints to the host (copying what the host
        lacks), freeing their device rows. False (nothing changed) when the host has no room."""
        node.pins += 1
        try:
            if not self.backup_node(node):
                return False
            for c in list(node.checkpoints):
                if c.slot is not None and not self.offload_checkpoint(c):
                    self.tree._drop(c)
        finally:
            node.pins -= 1
        self.pool.fence()   # the device pages may be reused once the copy has read them
        self.tree.pages.release(node.pages)
        self.tree.num_cached_pages -= len(node.pages)
        node.pages = []
        return True

    def offload_checkpoint(self, c) -> bool:
        if not self.backup_checkpoint(c):
            return False
        self.pool.fence()
        self.tree.slots.free(c.slot)
        if c.partial_page is not None:
            self.tree.pages.release([c.partial_page])
        c.slot = c.partial_page = None
        return True

    def _count_store(self, pages: int, slots: int) -> None:
        self.counters["host_stores"] += 1
        self.counters["host_store_bytes"] += pages * self.pool.engine_page_bytes + slots * self.pool.engine_slot_bytes

    # ---- host -> device ------------------------------------------------------------------
    def load_node(self, node, device_pages: list[int]) -> int:
        """Fill `device_pages` (allocated, the tree's reference) from the node's host copy."""
        ticket = self.pool.load(list(zip(node.host_pages, device_pages)), [])
        node.pages = device_pages
        node.load = ticket
        self.tree.num_cached_pages += len(device_pages)
        self._count_load(len(device_pages), 0, len(node.tokens))
        return ticket

    def restore(self, c, dst_slot: int, dst_page: int | None) -> int:
        """A request's live slot (and its fresh partial page) from a checkpoint on the host."""
        pages = [(c.host_partial, dst_page)] if c.host_partial is not None else []
        self._count_load(len(pages), 1, len(c.extra))
        return self.pool.load(pages, [(c.host_slot, dst_slot)])

    def _count_load(self, pages: int, slots: int, tokens: int) -> None:
        self.counters["host_loads"] += 1
        self.counters["host_load_bytes"] += pages * self.pool.engine_page_bytes + slots * self.pool.engine_slot_bytes
        self.counters["host_hit_tokens"] += tokens

    def ready(self, ticket: int) -> bool:
        return self.pool.ready(ticket)

    # ---- accounting ----------------------------------------------------------------------
    def prefetch(self, tokens: list[int], limit: int, full: bool, resume: int) -> bool:
        """Pull a deeper checkpoint of this prompt from the disk tier into the host tier."""
        return self.disk is not None and self.disk.prefetch(self.tree, tokens, limit, full, resume)

    def stats(self) -> dict[str, int]:
        out = {"host_pages_total": self.pages.num_pages, "host_pages_used": self.pages.num_used,
               "host_slots_total": self.slots.num_slots, "host_slots_used": self.slots.num_checkpoint,
               "host_pool_bytes": self.pool.engine_nbytes, **self.counters}
        if self.disk is not None:
            out.update(self.disk.counters, **self.disk.store.counters, disk_used_bytes=self.disk.store.used_bytes,
                       disk_capacity_bytes=self.disk.store.capacity_bytes)
        return out

    def check(self) -> None:
        """Host rows held == host rows the tree's nodes and checkpoints name."""
        self.pages.check()
        self.slots.check()
        refs = [0] * self.pages.num_pages
        slots = 0
        stack = [self.tree.root]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            for p in n.host_pages or ():
                refs[p] += 1
            for c in n.checkpoints:
                if c.host_slot is not None:
                    slots += 1
                if c.host_partial is not None:
                    refs[c.host_partial] += 1
            assert n is self.tree.root or n.pages or n.host_pages is not None, "a node on neither tier"
        for p in range(self.pages.num_pages):
            assert refs[p] == self.pages.refcount(p), f"host page {p}: {self.pages.refcount(p)} refs, {refs[p]} holders"
        assert slots == self.slots.num_checkpoint, f"{self.slots.num_checkpoint} host slots, {slots} held"
