"""Logical KV pages: ids, reference counts and the free list. No tensors.

A page is held by the requests whose page tables list it and by the radix tree when it
holds a cached prefix. Each holder counts one reference; a page returns to the free list
when its count drops to zero.

    page states:   free (ref 0, on the free list)  <->  used (ref >= 1)
    invariant:     num_free + num_used == num_pages
"""

from __future__ import annotations


class OutOfPages(RuntimeError):
    """Not enough free pages; the scheduler evicts or retracts and tries again."""


class PageManager:
    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError("the KV pool needs at least one page")
        self.num_pages = num_pages
        self._ref = [0] * num_pages
        # Pop from the end: low page ids first, so a fresh request's pages form few runs.
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._ref[p] = 1
        return pages

    def retain(self, pages: list[int]) -> None:
        for p in pages:
            if self._ref[p] <= 0:
                raise AssertionError(f"retain of free page {p}")
            self._ref[p] += 1

    def release(self, pages: list[int]) -> None:
        for p in pages:
            r = self._ref[p] - 1
            if r < 0:
                raise AssertionError(f"double release of page {p}")
            self._ref[p] = r
            if r == 0:
                self._free.append(p)

    def refcount(self, page: int) -> int:
        return self._ref[page]

    def check(self) -> None:
        """Integrity check (tests, idle time): free list and counts agree."""
        free = set(self._free)
        assert len(free) == len(self._free), "page on the free list twice"
        for p in range(self.num_pages):
            assert (self._ref[p] == 0) == (p in free), f"page {p}: ref {self._ref[p]}, free={p in free}"
