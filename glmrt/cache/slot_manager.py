"""State-pool slots: request-local KDA conv + recurrent state and the indexer tail. No tensors.

A slot is free, live (the running state of exactly one request), or a checkpoint (a saved
copy owned by the radix tree). Slots are never shared: a prefix hit copies a checkpoint
into the request's own live slot.

    invariant: num_free + num_live + num_checkpoint == num_slots
"""

from __future__ import annotations

FREE, LIVE, CHECKPOINT = "free", "live", "checkpoint"


class OutOfSlots(RuntimeError):
    """No free state slot; the scheduler evicts checkpoints or retracts and tries again."""


class SlotManager:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError("the state pool needs at least one slot")
        self.num_slots = num_slots
        self._state = [FREE] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._count = {FREE: num_slots, LIVE: 0, CHECKPOINT: 0}

    @property
    def num_free(self) -> int:
        return self._count[FREE]

    @property
    def num_live(self) -> int:
        return self._count[LIVE]

    @property
    def num_checkpoint(self) -> int:
        return self._count[CHECKPOINT]

    def allocate(self, kind: str = LIVE) -> int:
        if not self._free:
            raise OutOfSlots("no free state slot")
        s = self._free.pop()
        self._set(s, kind)
        return s

    def free(self, slot: int) -> None:
        if self._state[slot] == FREE:
            raise AssertionError(f"double free of slot {slot}")
        self._set(slot, FREE)
        self._free.append(slot)

    def convert(self, slot: int, kind: str) -> None:
        """Hand a slot over without copying (a finished request's live state becomes a checkpoint)."""
        if self._state[slot] == FREE or kind == FREE:
            raise AssertionError(f"convert of free slot {slot}")
        self._set(slot, kind)

    def kind(self, slot: int) -> str:
        return self._state[slot]

    def _set(self, slot: int, kind: str) -> None:
        self._count[self._state[slot]] -= 1
        self._state[slot] = kind
        self._count[kind] += 1

    def check(self) -> None:
        assert sum(self._count.values()) == self.num_slots
        assert set(self._free) == {s for s, k in enumerate(self._state) if k == FREE}
