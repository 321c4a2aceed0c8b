"""The page manager on its own: ids, reference counts, the free list (no model, no tensors)."""

from __future__ import annotations

import pytest

from glmrt.cache.page_manager import OutOfPages, PageManager


def test_allocate_hands_out_low_ids_first_with_one_reference():
    pm = PageManager(6)
    assert pm.allocate(3) == [0, 1, 2]
    assert [pm.refcount(p) for p in range(6)] == [1, 1, 1, 0, 0, 0]
    assert (pm.num_free, pm.num_used) == (3, 3)
    pm.check()


def test_a_page_is_free_again_only_when_its_last_holder_releases_it():
    pm = PageManager(4)
    pages = pm.allocate(2)
    pm.retain(pages)            # a second holder (the radix tree)
    pm.release(pages)
    assert pm.num_free == 2 and [pm.refcount(p) for p in pages] == [1, 1]
    pm.release(pages[:1])
    assert pm.num_free == 3 and pm.refcount(pages[0]) == 0
    pm.check()
    assert pm.allocate(1) == [pages[0]]  # the freed page comes back first


def test_over_allocation_raises_and_changes_nothing():
    pm = PageManager(3)
    pm.allocate(2)
    assert pm.can_allocate(1) and not pm.can_allocate(2)
    with pytest.raises(OutOfPages):
        pm.allocate(2)
    assert pm.num_free == 1
    pm.check()


def test_misuse_of_references_is_caught():
    pm = PageManager(2)
    with pytest.raises(AssertionError):
        pm.retain([0])          # free pages have no holder to share with
    (p,) = pm.allocate(1)
    pm.release([p])
    with pytest.raises(AssertionError):
        pm.release([p])
    with pytest.raises(ValueError):
        PageManager(0)


def test_check_detects_a_corrupted_free_list():
    pm = PageManager(3)
    pm.allocate(1)
    pm._free.append(0)          # a used page on the free list
    with pytest.raises(AssertionError):
        pm.check()
