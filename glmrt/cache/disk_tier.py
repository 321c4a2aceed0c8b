"""The third tier: what the host tier drops goes to a NodeStore (glmrt/cache/node_store.py),
and an admission whose prefix the tree lacks pulls it back into the host tier.

    host tier drops a node only on the host     -> each of its pages: `p<key at page end>`
    host tier drops a checkpoint only there     -> its slot rows + partial page: `c<tail key>`
    admission (prefetch) finds, past the tree's deepest page of the prompt, pages on disk and a
    checkpoint deeper than the tree's resume point -> host rows filled from the files, a
    host-only node and checkpoint attached to the tree; the ordinary match then loads them.

Keys chain the prompt's pages from a salt naming the model and cache layout, so a checkpoint
`j` tokens past a page boundary is found by hashing the prompt's next `j` tokens: no index to
keep, and files written by an earlier run are found again.

On an engine of several ranks each rank has a store of its own (a directory per rank) holding
its shard of each entry under the same key. Rank 0's tier decides everything (what is written,
read back and evicted, by its own store's index and cap); each of its puts, gets and removals is
noted in its host pool's journal, and the other ranks' `DiskMirror` performs the same on their
stores from the next step's inputs. A rank whose file is missing when rank 0 reads one stops
the engine rather than serve rows it does not have.
"""

from __future__ import annotations

import hashlib

import torch

from glmrt.cache.host_pool import PAGE_TENSORS, SLOT_TENSORS, HostOp
from glmrt.cache.node_store import NodeStore, prefix_keys, tail_key
from glmrt.cache.radix import Checkpoint, Node
from glmrt.cache.slot_manager import CHECKPOINT


def page_entry(h: dict[str, torch.Tensor], page: int) -> dict[str, torch.Tensor]:
    return {n: h[n][page] for n in PAGE_TENSORS}


def checkpoint_entry(h: dict[str, torch.Tensor], slot: int, partial: int | None, meta: list[int]) -> dict:
    """A checkpoint's slot rows, its partial page's rows and (position, has_output)."""
    entry = {n: h[n][slot] for n in SLOT_TENSORS}
    if partial is not None:
        entry.update({"partial." + n: h[n][partial] for n in PAGE_TENSORS})
    entry["meta"] = torch.tensor(meta, dtype=torch.long)
    return entry


def fill_page(h: dict[str, torch.Tensor], page: int, got: dict) -> None:
    for n in PAGE_TENSORS:
        h[n][page] = got[n]


def fill_checkpoint(h: dict[str, torch.Tensor], slot: int, partial: int | None, got: dict) -> None:
    for n in SLOT_TENSORS:
        h[n][slot] = got[n]
    if partial is not None:
        for n in PAGE_TENSORS:
            h[n][partial] = got["partial." + n]


class DiskMirror:
    """A rank other than 0: its own store, kept as rank 0's store is (`HostPool.replay`)."""

    def __init__(self, store: NodeStore, pool):
        self.store, self.pool = store, pool

    def apply(self, op: HostOp) -> None:
        h = self.pool.tensors
        partial = op.page if op.page >= 0 else None
        if op.op == "disk_remove":
            self.store.remove(op.key)
            return
        self.pool.synchronize()  # the host rows as the last copy into them left them
        if op.op == "disk_put":
            entry = page_entry(h, op.page) if op.slot < 0 else checkpoint_entry(h, op.slot, partial, op.meta)
            if not self.store.put(op.key, entry):
                raise RuntimeError(f"the disk tier could not write {op.key} on this rank (rank 0 did)")
        elif op.op == "disk_get":
            got = self.store.get(op.key)
            if got is None:  # removed or damaged under us: these rows would be wrong
                raise RuntimeError(f"the disk tier's {op.key} is missing on this rank (rank 0 read it): "
                                   f"its files no longer match rank 0's")
            if op.slot < 0:
                fill_page(h, op.page, got)
            else:
                fill_checkpoint(h, op.slot, partial, got)
        else:
            raise ValueError(f"unknown host tier operation {op.op!r}")


class DiskTier:
    def __init__(self, store: NodeStore, salt: str, page_size: int):
        self.store = store
        store.on_remove = self._removed
        self.salt = salt
        self.root_key = hashlib.sha256(salt.encode()).hexdigest()
        self.page_size = page_size
        self.host = None  # the HostTier in front of it (set by it)
        self.counters = {"disk_spilled_pages": 0, "disk_spilled_checkpoints": 0, "disk_hits": 0,
                         "disk_hit_tokens": 0}

    def _removed(self, key: str) -> None:
        if self.host is not None:
            self.host.pool.note(HostOp("disk_remove", key=key))

    def _keys(self, tokens: list[int]) -> list[str]:
        return prefix_keys(self.salt, tokens, self.page_size)

    def _base(self, keys: list[str], anchor: int) -> str:
        return keys[anchor // self.page_size - 1] if anchor else self.root_key

    @staticmethod
    def _path_tokens(node: Node) -> list[int]:
        parts = []
        while node is not None and node.parent is not None:
            parts.append(node.tokens)
            node = node.parent
        return [t for part in reversed(parts) for t in part]

    # ---- host -> disk --------------------------------------------------------------------
    def spill_node(self, node: Node) -> None:
        """Write a host-only node's pages (it is about to leave the host)."""
        self.host.pool.synchronize()  # the host rows as the last copy into them left them
        tokens = self._path_tokens(node)
        keys = self._keys(tokens)
        first = (node.end - len(node.tokens)) // self.page_size
        h = self.host.pool.tensors
        for i, hp in enumerate(node.host_pages):
            key = "p" + keys[first + i]
            if self.store.put(key, page_entry(h, hp)):
                self.host.pool.note(HostOp("disk_put", key=key, page=hp))
                self.counters["disk_spilled_pages"] += 1

    def spill_checkpoint(self, c: Checkpoint) -> None:
        self.host.pool.synchronize()
        tokens = self._path_tokens(c.node)
        base = self._base(self._keys(tokens), c.node.end)
        meta = [c.position, int(c.has_output)]
        key = "c" + tail_key(base, c.extra)
        if self.store.put(key, checkpoint_entry(self.host.pool.tensors, c.host_slot, c.host_partial, meta)):
            self.host.pool.note(HostOp("disk_put", key=key, slot=c.host_slot,
                                       page=-1 if c.host_partial is None else c.host_partial, meta=meta))
            self.counters["disk_spilled_checkpoints"] += 1

    # ---- disk -> host --------------------------------------------------------------------
    def prefetch(self, tree, tokens: list[int], limit: int, full: bool, resume: int) -> bool:
        """Attach to the tree, on the host, a checkpoint the store has deeper than `resume` on
        the path of `tokens` (at most `limit`, or all of them with its output when `full`),
        with the pages between the tree's deepest page and its anchor. -> whether it did."""
        ps = self.page_size
        node, pos = tree.root, 0
        while True:  # the tree's deepest page-aligned position on this path
            child = node.children.get(tuple(tokens[pos:pos + ps]))
            if child is None:
                break
            n = tree._edge_match(child, tokens, pos)
            if n < len(child.tokens):
                pos += n
                break
            node, pos = child, pos + n
        keys = self._keys(tokens)
        top = pos
        while top // ps < len(keys) and self.store.contains("p" + keys[top // ps]):
            top += ps
        found = None
        for anchor in range(top, pos - 1, -ps):
            base = self._base(keys, anchor)
            longest = min(ps - 1, len(tokens) - anchor)
            for j in range(longest, -1, -1):
                position = anchor + j
                if position <= resume or (position > limit and not (full and position == len(tokens))):
                    continue
                if self.store.contains("c" + tail_key(base, tuple(tokens[anchor:position]))):
                    found = (anchor, position)
                    break
            if found:
                break
        return found is not None and self._attach(tree, tokens, keys, pos, *found, limit)

    def _attach(self, tree, tokens, keys, pos: int, anchor: int, position: int, limit: int) -> bool:
        ps, host = self.page_size, self.host
        extra = tuple(tokens[anchor:position])
        ckey = "c" + tail_key(self._base(keys, anchor), extra)
        pkeys = ["p" + keys[i] for i in range(pos // ps, anchor // ps)]
        at = tree._anchor(tokens, pos) if pos else tree.root
        if at is None:
            return False
        # room first (a partial page assumed): what it spills may evict files, never the ones
        # read below, which the other ranks read again when they perform the fills
        at.pins += 1
        try:
            if not host.make_room(len(pkeys) + 1, 1):
                return False
        finally:
            at.pins -= 1
        entry = self.store.get(ckey)
        if entry is None or (position > limit and not entry["meta"][1]):
            return False
        pages = [self.store.get(k) for k in pkeys]
        if any(got is None for got in pages):
            return False
        host.pool.synchronize()  # no copy in flight still touches the rows written here
        h = host.pool.tensors
        if pages:
            hps = host.pages.allocate(len(pages))
            for hp, got, key in zip(hps, pages, pkeys):
                fill_page(h, hp, got)
                host.pool.note(HostOp("disk_get", key=key, page=hp))
            node = Node(tuple(tokens[pos:anchor]), [], at, anchor, last_use=next(tree._clock), host_pages=hps)
            at.children[node.tokens[:ps]] = node
        else:
            node = at
        c = Checkpoint(position, extra, None, None, node, last_use=next(tree._clock),
                       has_output=bool(entry["meta"][1]), host_slot=host.slots.allocate(CHECKPOINT))
        if "partial." + PAGE_TENSORS[0] in entry:
            c.host_partial = host.pages.allocate(1)[0]
        fill_checkpoint(h, c.host_slot, c.host_partial, entry)
        host.pool.note(HostOp("disk_get", key=ckey, slot=c.host_slot,
                              page=-1 if c.host_partial is None else c.host_partial))
        node.checkpoints.append(c)
        self.counters["disk_hits"] += 1
        self.counters["disk_hit_tokens"] += position - pos
        return True
