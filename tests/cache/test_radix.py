"""The radix prefix cache on its own: page-aligned prefix sharing, checkpoints, LRU eviction.

Data only: a request is a token list and the pages it holds, as the engine would pass them.
"""

from __future__ import annotations

import pytest

from glmrt.cache.page_manager import PageManager
from glmrt.cache.radix import Checkpoint, RadixCache
from glmrt.cache.slot_manager import CHECKPOINT, LIVE, SlotManager

PS = 4


@pytest.fixture
def tree() -> RadixCache:
    return RadixCache(PS, PageManager(32), SlotManager(8))


def cached(tree: RadixCache, tokens: list[int]) -> list[int]:
    """A request computes `tokens`, offers its full pages, then lets go of its own references."""
    own = tree.pages.allocate(-(-len(tokens) // PS))
    canon = tree.insert(tokens, own)
    tree.pages.release(own)
    return canon


def checkpoint(tree: RadixCache, tokens: list[int], position: int) -> Checkpoint | None:
    slot = tree.slots.allocate(CHECKPOINT)
    page = tree.pages.allocate(1)[0] if position % PS else None
    return tree.add_checkpoint(tokens, position, slot, page)


def test_insert_keeps_full_pages_and_shares_identical_prefixes(tree):
    a = list(range(10))                      # 2 full pages + 2 tokens
    pages_a = cached(tree, a)
    assert len(pages_a) == 2 and tree.num_cached_pages == 2
    assert all(tree.pages.refcount(p) == 1 for p in pages_a)   # the tree's own reference
    own = tree.pages.allocate(3)
    canon = tree.insert(a[:8] + [90, 91, 92, 93], own)          # same first two pages, new third
    assert canon[:2] == pages_a and canon[2] == own[2]
    assert tree.num_cached_pages == 3
    assert tree.pages.refcount(own[2]) == 2 and tree.pages.refcount(own[0]) == 1
    tree.check()


def test_a_divergence_inside_an_edge_splits_it(tree):
    a = list(range(12))
    cached(tree, a)
    b = a[:4] + [50, 51, 52, 53]
    cached(tree, b)
    (upper,) = tree.root.children.values()
    assert upper.tokens == tuple(a[:4]) and upper.end == 4
    assert sorted(len(c.tokens) for c in upper.children.values()) == [4, 8]
    assert tree.match_pages(b, len(b))[1] == 8
    assert tree.match_pages(a, len(a)) == (cached(tree, a), 12)


def test_match_pages_stops_at_the_limit_and_on_page_boundaries(tree):
    a = list(range(12))
    pages = cached(tree, a)
    assert tree.match_pages(a, 11) == (pages[:2], 8)
    assert tree.match_pages(a[:6] + [77] * 6, 12) == (pages[:1], 4)  # a partial page is never shared
    assert tree.match_pages([99] * 12, 12) == ([], 0)


def test_match_resumes_at_the_deepest_checkpoint_within_the_limit(tree):
    a = list(range(16))
    pages = cached(tree, a)
    early = checkpoint(tree, a, 4)                 # page-aligned: no partial page
    late = checkpoint(tree, a, 10)                 # 2 tokens past the anchor at 8
    assert early.partial_page is None and late.partial_page is not None and late.extra == (8, 9)
    m = tree.match(a, limit=15)
    assert (m.resume, m.checkpoint, m.pages) == (10, late, pages[:2])
    m = tree.match(a, limit=9)                     # may not skip past token 9
    assert (m.resume, m.checkpoint, m.pages) == (4, early, pages[:1])
    m = tree.match(a[:9] + [70, 71], limit=10)     # token 9 differs: the late checkpoint does not apply
    assert m.checkpoint is early and m.common == 9
    assert tree.match([5] * 8, limit=7).resume == 0
    assert tree.has_checkpoint(a, 10) and not tree.has_checkpoint(a, 11)


def test_checkpoints_need_their_path_and_are_unique(tree):
    a = list(range(8))
    assert checkpoint(tree, a, 4) is None          # nothing cached yet: the caller frees slot and page
    cached(tree, a)
    assert checkpoint(tree, a, 6) is not None
    assert checkpoint(tree, a, 6) is None          # the same state twice
    assert tree.stats() == {"cached_pages": 2, "checkpoints": 1, "checkpoint_pages": 1}


def test_eviction_is_lru_and_spares_pinned_checkpoints(tree):
    old, new = [1] * 8, [2] * 8
    cached(tree, old)
    cached(tree, new)
    tree.match(new, 7)                             # touch: `old` is now the least recently used
    free = tree.pages.num_free
    tree.evict(need_pages=free + 1)
    assert tree.match_pages(old, 8) == ([], 0) and tree.match_pages(new, 8)[1] == 8
    assert tree.pages.num_free == free + 2
    ck = checkpoint(tree, new, 8)
    ck.pins = 1                                    # a planned restore has not run yet
    tree.evict(need_slots=tree.slots.num_free + 1)
    assert tree.has_checkpoint(new, 8)             # the pinned checkpoint survives; its node too
    assert tree.match_pages(new, 8)[1] == 8
    ck.pins = 0
    tree.evict(need_slots=tree.slots.num_free + 1)  # a slot is wanted: the checkpoint goes first
    assert not tree.has_checkpoint(new, 8) and tree.match_pages(new, 8)[1] == 8
    tree.check()


def test_a_slot_wanted_evicts_only_what_holds_one(tree):
    """Dropping a KV node frees pages, never a state slot: a slot wanted while no checkpoint can
    go leaves the cached prefixes alone (it used to wipe them all and still find no slot), and
    a checkpoint that can go goes alone."""
    a, b = [1] * 8, [2] * 8
    cached(tree, a)
    cached(tree, b)
    pages = tree.num_cached_pages
    held = [tree.slots.allocate(LIVE) for _ in range(tree.slots.num_free)]  # every slot a request's
    tree.evict(need_slots=1)
    assert tree.num_cached_pages == pages and tree.slots.num_free == 0
    tree.slots.free(held.pop())
    checkpoint(tree, a, 8)
    tree.evict(need_slots=1)
    assert tree.slots.num_free == 1 and not tree.has_checkpoint(a, 8) and tree.num_cached_pages == pages
    tree.evict(need_pages=tree.pages.num_free + 2, need_slots=2)  # pages short too: nodes may go
    assert tree.num_cached_pages == pages - 2
    tree.check()


def test_flush_returns_every_page_and_slot(tree):
    a = list(range(14))
    cached(tree, a)
    cached(tree, a[:4] + [60] * 8)
    checkpoint(tree, a, 9)
    checkpoint(tree, a, 12)
    tree.flush()
    assert tree.pages.num_free == tree.pages.num_pages and tree.slots.num_free == tree.slots.num_slots
    assert tree.stats() == {"cached_pages": 0, "checkpoints": 0, "checkpoint_pages": 0}


def test_a_disabled_tree_caches_nothing():
    tree = RadixCache(PS, PageManager(8), SlotManager(2), enabled=False)
    own = tree.pages.allocate(2)
    assert tree.insert(list(range(8)), own) == own and tree.pages.refcount(own[0]) == 1
    assert tree.match(list(range(8)), 7).resume == 0 and tree.match_pages(list(range(8)), 8) == ([], 0)
    assert tree.add_checkpoint(list(range(8)), 4, 0, None) is None
