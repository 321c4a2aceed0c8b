"""The state-slot manager on its own: free / live / checkpoint slots (no model, no tensors)."""

from __future__ import annotations

import pytest

from glmrt.cache.slot_manager import CHECKPOINT, FREE, LIVE, OutOfSlots, SlotManager


def counts(sm: SlotManager) -> tuple[int, int, int]:
    return sm.num_free, sm.num_live, sm.num_checkpoint


def test_allocate_by_kind_and_free():
    sm = SlotManager(4)
    a = sm.allocate()
    b = sm.allocate(CHECKPOINT)
    assert (a, b) == (0, 1)
    assert (sm.kind(a), sm.kind(b), sm.kind(2)) == (LIVE, CHECKPOINT, FREE)
    assert counts(sm) == (2, 1, 1)
    sm.free(a)
    assert counts(sm) == (3, 0, 1)
    sm.check()
    assert sm.allocate() == a


def test_convert_hands_a_slot_over_without_a_copy():
    sm = SlotManager(2)
    s = sm.allocate(LIVE)
    sm.convert(s, CHECKPOINT)   # a finished request's state becomes the tree's checkpoint
    assert sm.kind(s) == CHECKPOINT and counts(sm) == (1, 0, 1)
    sm.convert(s, LIVE)
    assert counts(sm) == (1, 1, 0)
    sm.check()


def test_exhaustion_and_misuse_raise():
    sm = SlotManager(1)
    s = sm.allocate()
    with pytest.raises(OutOfSlots):
        sm.allocate()
    with pytest.raises(AssertionError):
        sm.convert(s, FREE)
    sm.free(s)
    with pytest.raises(AssertionError):
        sm.free(s)
    with pytest.raises(AssertionError):
        sm.convert(s, LIVE)
    with pytest.raises(ValueError):
        SlotManager(0)
    assert counts(sm) == (1, 0, 0)
    sm.check()
