"""Radix prefix cache: KV pages shared by token prefix, KDA state only at checkpoints.

The tree is page-aligned: every edge holds whole pages (`page_size` tokens each), so a page
is shared exactly when all of its tokens match. Recurrent state describes one exact prefix
end and is never shared: the tree keeps *checkpoints* — a state slot saved at position L,
anchored at the node ending at A = floor(L / page_size) * page_size, with the `L - A` tokens
past the anchor and a private copy of the partial page holding their latent / pooled keys.

    root ──[p0 p1]── n1 ──[p2]── n2          pages p0..p2 shared by prefix
                      │           └─ ckpt(L=3*ps+5, extra=5 tokens, slot s7, page q4)
                      └─[p5 p6]── n3
                                  └─ ckpt(L=4*ps, extra=(), slot s9)

A hit resumes at the deepest checkpoint at or before the match: the request takes the
shared pages of [0, A), a fresh page filled from the checkpoint's partial page, and a copy of
the checkpoint's state in its own live slot. A checkpoint saved where a prompt ended, by the
step that sampled from it, also keeps that position's final hidden state (`has_output`): a
prompt equal to its L tokens is a *full hit* that computes nothing and samples its first
token from the kept state. The tree holds one page reference per page it
stores; requests hold their own. No tensors here: copies are returned to the caller as
instructions, or (the host tier, glmrt/cache/host_tier.py) issued by the tier the tree is
given. With a host tier a node or checkpoint evicted from the device moves to the host while
host space lasts, and a hit on it loads it back (`load_path`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from glmrt.cache.page_manager import PageManager
from glmrt.cache.slot_manager import SlotManager


@dataclass(eq=False)
class Checkpoint:
    position: int                   # L: tokens [0, L) are summarised by the state
    extra: tuple[int, ...]          # tokens [A, L) past the anchor node's end
    slot: int | None                # checkpoint slot in the state pool (None: on the host only)
    partial_page: int | None        # private page with the latent/pooled keys of [A, L)
    node: "Node"
    last_use: int = 0
    pins: int = 0                   # planned restores not yet executed: not evictable
    has_output: bool = False        # the slot keeps the final hidden state of position L - 1
    host_slot: int | None = None    # its copy in the host tier (slot, partial page)
    host_partial: int | None = None


@dataclass(eq=False)
class Node:
    tokens: tuple[int, ...]         # this edge's tokens (a multiple of page_size)
    pages: list[int]
    parent: "Node | None"
    end: int                        # tokens from the root to the end of this edge
    children: dict[tuple[int, ...], "Node"] = field(default_factory=dict)
    checkpoints: list[Checkpoint] = field(default_factory=list)
    last_use: int = 0
    host_pages: list[int] | None = None   # its copy in the host tier; `pages` is [] when only there
    pins: int = 0                   # an admission is loading or using it: not evictable
    load: int = 0                   # the host tier's ticket of the load that filled `pages`


@dataclass
class Match:
    """What a prompt can skip: resume at `resume`, with `pages` shared for [0, anchor)."""

    resume: int = 0
    pages: list[int] = field(default_factory=list)   # of `nodes`, when all are on the device
    checkpoint: Checkpoint | None = None
    common: int = 0                 # longest common token prefix with the tree (divergence point)
    nodes: list[Node] = field(default_factory=list)  # the path [0, anchor): whole nodes


class RadixCache:
    def __init__(self, page_size: int, pages: PageManager, slots: SlotManager, enabled: bool = True,
                 host=None):
        self.page_size = page_size
        self.pages = pages
        self.slots = slots
        self.enabled = enabled
        self.root = Node((), [], None, 0)
        self._clock = itertools.count(1)
        self.num_cached_pages = 0       # device pages held by nodes
        self.host = host                # glmrt.cache.host_tier.HostTier, or None
        if host is not None:
            host.tree = self

    # ---- lookup --------------------------------------------------------------------------
    def match(self, tokens: list[int], limit: int, full: bool = False) -> Match:
        """Deepest usable checkpoint for a request whose first `limit` tokens may be skipped;
        `full`: also one covering all of `tokens` that kept its output (a full hit)."""
        m = Match()
        if not self.enabled:
            return m
        ps = self.page_size
        node, pos, path = self.root, 0, []
        now = next(self._clock)
        whole = len(tokens) if full else None
        best = self._best_checkpoint(node, tokens, pos, limit, whole)
        if best:
            m.checkpoint, m.nodes = best, []
        while True:
            node.last_use = now
            key = tuple(tokens[pos:pos + ps])
            child = node.children.get(key) if len(key) == ps else None
            if child is None:
                m.common = pos + self._partial_common(node, tokens, pos)
                break
            n = self._edge_match(child, tokens, pos)
            if n < len(child.tokens):
                child.last_use = now
                m.common = pos + n + self._token_common(child.tokens[n:], tokens[pos + n:])
                break
            node, pos = child, pos + n
            path.append(node)
            cand = self._best_checkpoint(node, tokens, pos, limit, whole)
            if cand and (m.checkpoint is None or cand.position > m.checkpoint.position):
                m.checkpoint, m.nodes = cand, list(path)
        if m.checkpoint is not None:
            m.resume = m.checkpoint.position
            m.checkpoint.last_use = now
            if all(n.pages for n in m.nodes):
                m.pages = [p for n in m.nodes for p in n.pages]
        return m

    def load_path(self, nodes: list[Node], grab) -> tuple[list[int], list[int]] | None:
        """The device pages of `nodes` (a match's path), loading the ones only on the host into
        pages from `grab(n) -> list | None` (which may evict; `nodes` are pinned meanwhile).
        -> (pages, load tickets to wait for), or None when the device has no room."""
        missing = [n for n in nodes if not n.pages]
        tickets = [n.load for n in nodes if n.pages and n.load and not self.host.ready(n.load)] if self.host else []
        if missing:
            for n in nodes:
                n.pins += 1
            try:
                got = grab(sum(len(n.host_pages) for n in missing))
            finally:
                for n in nodes:
                    n.pins -= 1
            if got is None:
                return None
            for n in missing:
                k = len(n.host_pages)
                tickets.append(self.host.load_node(n, got[:k]))
                got = got[k:]
        return [p for n in nodes for p in n.pages], tickets

    def match_pages(self, tokens: list[int], limit: int, waits: list[int] | None = None,
                    grab=None) -> tuple[list[int], int]:
        """KV-only match: the cached full pages of the longest page-aligned prefix of
        `tokens[:limit]` (a decode engine receiving state from a prefill needs no checkpoint).
        With `waits` (and `grab`, as for `load_path`), nodes on the host are loaded back and
        their load tickets appended to it."""
        if not self.enabled:
            return [], 0
        ps = self.page_size
        node, pos, pages, path = self.root, 0, [], []
        now = next(self._clock)
        while pos + ps <= limit:
            child = node.children.get(tuple(tokens[pos:pos + ps]))
            if child is None:
                break
            path.append(child)
            if not child.pages:  # on the host only: load it back (its path pinned meanwhile), or stop
                if waits is None or self.load_path(path, grab) is None:
                    break
                waits.append(child.load)
            n = min(self._edge_match(child, tokens, pos), (limit - pos) // ps * ps)
            pages += child.pages[: n // ps]
            child.last_use = now
            if n < len(child.tokens):
                pos += n
                break
            node, pos = child, pos + n
        return pages, pos

    def _best_checkpoint(self, node: Node, tokens: list[int], pos: int, limit: int,
                         whole: int | None = None) -> Checkpoint | None:
        """Deepest checkpoint of `node` on the path of `tokens` at or before `limit`, or at
        `whole` (the prompt's length) when it kept its output."""
        best = None
        for c in node.checkpoints:
            usable = c.position <= limit or (c.position == whole and c.has_output)
            if usable and tuple(tokens[pos:c.position]) == c.extra:
                if best is None or c.position > best.position:
                    best = c
        return best

    def _edge_match(self, child: Node, tokens: list[int], pos: int) -> int:
        """Tokens of the child's edge matched, in whole pages."""
        ps = self.page_size
        n = 0
        while n < len(child.tokens) and tuple(tokens[pos + n:pos + n + ps]) == child.tokens[n:n + ps]:
            n += ps
        return n

    @staticmethod
    def _token_common(a, b) -> int:
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        return n

    def _partial_common(self, node: Node, tokens: list[int], pos: int) -> int:
        rest = tokens[pos:]
        best = max((self._token_common(c.extra, rest) for c in node.checkpoints), default=0)
        for key in node.children:
            best = max(best, self._token_common(key, rest))
        return best

    # ---- insertion -----------------------------------------------------------------------
    def insert(self, tokens: list[int], pages: list[int]) -> list[int]:
        """Cache the full pages of `tokens` (held by a request's `pages`).

        Returns the canonical page list for those full pages: where the tree already held a
        page for the same tokens, that page; the caller swaps it in (retaining it, releasing
        its own duplicate) so identical prefixes share one set of pages.
        """
        ps = self.page_size
        n_full = min(len(tokens) // ps, len(pages))
        if not self.enabled or n_full == 0:
            return list(pages[:n_full])
        node, pos = self.root, 0
        canonical: list[int] = []
        now = next(self._clock)
        while pos < n_full * ps:
            key = tuple(tokens[pos:pos + ps])
            child = node.children.get(key)
            if child is None:
                new_tokens = tuple(tokens[pos:n_full * ps])
                new_pages = list(pages[pos // ps:n_full])
                self.pages.retain(new_pages)
                self.num_cached_pages += len(new_pages)
                child = Node(new_tokens, new_pages, node, pos + len(new_tokens), last_use=now)
                node.children[key] = child
                canonical += new_pages
                if self.host is not None and self.host.write_through:
                    self.host.backup_node(child)
                break
            n = self._edge_match(child, tokens, pos)
            n = min(n, n_full * ps - pos)
            if n < len(child.tokens):
                child = self._split(child, n)
            if not child.pages:  # on the host only: the request computed these pages again
                child.pages = list(pages[pos // ps:pos // ps + len(child.tokens) // ps])
                self.pages.retain(child.pages)
                self.num_cached_pages += len(child.pages)
            canonical += child.pages
            child.last_use = now
            node, pos = child, pos + n
        return canonical

    def _split(self, child: Node, n: int) -> Node:
        """Split `child` after n tokens (a page multiple); returns the new upper node."""
        ps = self.page_size
        parent = child.parent
        upper = Node(child.tokens[:n], child.pages[: n // ps], parent, child.end - len(child.tokens) + n,
                     last_use=child.last_use, load=child.load)
        if child.host_pages is not None:
            upper.host_pages, child.host_pages = child.host_pages[: n // ps], child.host_pages[n // ps:]
        parent.children[child.tokens[:ps]] = upper
        child.tokens, child.pages, child.parent = child.tokens[n:], child.pages[n // ps:], upper
        upper.children[child.tokens[:ps]] = child
        return upper

    def _anchor(self, tokens: list[int], aligned: int) -> Node | None:
        """The node whose edge ends exactly at `aligned` on the path of `tokens` (splitting one)."""
        node, pos = self.root, 0
        while pos < aligned:
            child = node.children.get(tuple(tokens[pos:pos + self.page_size]))
            if child is None:
                return None
            n = min(self._edge_match(child, tokens, pos), aligned - pos)
            if n < len(child.tokens):
                if n == 0:
                    return None
                child = self._split(child, n)
            node, pos = child, pos + n
        return node

    def add_checkpoint(self, tokens: list[int], position: int, slot: int, partial_page: int | None,
                       has_output: bool = False) -> Checkpoint | None:
        """Register a saved state at `position` (its pages [0, A) must already be inserted).

        Returns None (caller frees the slot and page) when the path is not cached or an
        identical checkpoint already exists. An identical one without the kept output that
        no restore has pinned is replaced by one with it (a full hit needs the output).
        """
        if not self.enabled:
            return None
        aligned = position // self.page_size * self.page_size
        node = self._anchor(tokens, aligned)
        extra = tuple(tokens[aligned:position])
        if node is None:
            return None
        same = next((c for c in node.checkpoints if c.position == position and c.extra == extra), None)
        if same is not None:
            if not has_output or same.has_output or same.pins:
                return None
            self._drop(same)
        c = Checkpoint(position, extra, slot, partial_page, node, last_use=next(self._clock), has_output=has_output)
        node.checkpoints.append(c)
        if self.host is not None and self.host.write_through:
            self.host.backup_checkpoint(c)
        return c

    def has_checkpoint(self, tokens: list[int], position: int, with_output: bool = False) -> bool:
        aligned = position // self.page_size * self.page_size
        node, pos = self.root, 0
        while pos < aligned:
            child = node.children.get(tuple(tokens[pos:pos + self.page_size]))
            if child is None or child.end > aligned or self._edge_match(child, tokens, pos) < len(child.tokens):
                return False
            node, pos = child, child.end
        extra = tuple(tokens[aligned:position])
        return any(c.position == position and c.extra == extra and (c.has_output or not with_output)
                   for c in node.checkpoints)

    # ---- eviction ------------------------------------------------------------------------
    def evictable(self):
        """Device candidates in LRU order: checkpoints not pinned, and leaf nodes without
        checkpoints; with a host tier, any node none of whose children is on the device (it
        moves to the host with its checkpoints)."""
        items = []
        stack = [self.root]
        tiered = self.host is not None
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            items += [(c.last_use, 0, c) for c in n.checkpoints if c.pins == 0 and c.slot is not None]
            if n is self.root or not n.pages or n.pins:
                continue
            if tiered:
                if not any(ch.pages for ch in n.children.values()) and all(c.pins == 0 for c in n.checkpoints):
                    items.append((n.last_use, 1, n))
            elif not n.children and not n.checkpoints:
                items.append((n.last_use, 1, n))
        items.sort(key=lambda x: (x[0], x[1]))
        return [x[2] for x in items]

    def evict(self, need_pages: int = 0, need_slots: int = 0) -> None:
        """Free LRU entries until `need_pages` pages and `need_slots` slots are free (or nothing is
        left); with a host tier they move to the host while it has room."""
        while self.pages.num_free < need_pages or self.slots.num_free < need_slots:
            victims = self.evictable()
            if need_slots and self.slots.num_free < need_slots:
                holders = [v for v in victims if _holds_slot(v)]
                # only slots short: what holds none would go for nothing (the KV cache wiped, no slot)
                victims = holders if self.pages.num_free >= need_pages else holders or victims
            if not victims:
                return
            v = victims[0]
            if self.host is None:
                self._drop(v)
            elif isinstance(v, Checkpoint):
                if not self.host.offload_checkpoint(v):
                    self._drop(v)
            elif not self.host.offload_node(v):
                self._drop(v)

    def _drop(self, item) -> None:
        """Remove a checkpoint, or a node with everything under it, from both tiers."""
        host = self.host
        if host is not None:
            host.pool.fence()  # a copy may still read or fill the device rows freed here
        if isinstance(item, Checkpoint):
            item.node.checkpoints.remove(item)
            if item.slot is not None:
                self.slots.free(item.slot)
            if item.partial_page is not None:
                self.pages.release([item.partial_page])
            if item.host_slot is not None:
                host.slots.free(item.host_slot)
            if item.host_partial is not None:
                host.pages.release([item.host_partial])
            return
        node = item
        del node.parent.children[node.tokens[: self.page_size]]
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            for c in list(n.checkpoints):
                self._drop(c)
            self.pages.release(n.pages)
            self.num_cached_pages -= len(n.pages)
            if n.host_pages is not None:
                host.pages.release(n.host_pages)

    def flush(self) -> None:
        """Drop everything, on both tiers (the leak test's 'after a cache flush both pools are empty')."""
        for c in list(self.root.checkpoints):
            self._drop(c)
        for child in list(self.root.children.values()):
            self._drop(child)

    # ---- accounting ----------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        n_ckpt = n_ckpt_pages = 0
        stack = [self.root]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            n_ckpt += sum(c.slot is not None for c in n.checkpoints)
            n_ckpt_pages += sum(c.partial_page is not None for c in n.checkpoints)
        out = {"cached_pages": self.num_cached_pages, "checkpoints": n_ckpt, "checkpoint_pages": n_ckpt_pages}
        return {**out, **self.host.stats()} if self.host is not None else out

    def check(self) -> None:
        assert self.slots.num_checkpoint == self.stats()["checkpoints"], "checkpoint slots out of sync"
        if self.host is not None:
            self.host.check()


def _holds_slot(item) -> bool:
    """Whether evicting `item` frees a device state slot: a checkpoint with one, or a node
    carrying such a checkpoint (a tiered tree moves a node with its checkpoints)."""
    if isinstance(item, Checkpoint):
        return item.slot is not None
    return any(c.slot is not None for c in item.checkpoints)
