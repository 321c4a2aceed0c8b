"""Whole-request aborts an actor remembers for a while, and the work queue that skips them.

An Abort can reach an actor before the work it cancels (the api aborts everywhere at once while
the request is still a hop upstream) or while that work waits in the actor's queue. Each actor
that can skip work keeps the aborts of the last `memory_s` seconds and asks about a request
when its work comes up. Choice-only aborts (a stop string ending one of n choices) are not kept:
they cancel no whole request.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable
from typing import Any

from glmrt import protocol as P

ABORT_MEMORY_S = 60.0  # a request that reaches an actor later than this after its abort is served


class Recent:
    """Keys noted in the last `memory_s` seconds, each with a value; older ones are forgotten
    whenever the map is used (insertion order is time order, so they are at the front)."""

    def __init__(self, memory_s: float = ABORT_MEMORY_S):
        self.memory_s = memory_s
        self._items: dict[Any, tuple[float, Any]] = {}

    def put(self, key: Any, value: Any = None) -> None:
        self._forget()
        self._items.pop(key, None)  # re-inserted last: insertion order stays time order
        self._items[key] = (time.monotonic(), value)

    def pop(self, key: Any) -> Any:
        """The value noted under `key` (None if none, or forgotten), no longer kept."""
        self._forget()
        return self._items.pop(key, (0.0, None))[1]

    def __contains__(self, key: Any) -> bool:
        self._forget()
        return key in self._items

    def _forget(self) -> None:
        now = time.monotonic()
        while self._items:
            oldest, (t, _) = next(iter(self._items.items()))
            if now - t <= self.memory_s:
                break
            del self._items[oldest]


class RecentAborts:
    def __init__(self, memory_s: float = ABORT_MEMORY_S):
        self._requests = Recent(memory_s)  # whole requests aborted lately

    def note(self, abort: P.Abort) -> bool:
        """Remember `abort` if it cancels a whole request -> whether it does."""
        if abort.choice_only:
            return False
        self._requests.put(abort.key.request)
        return True

    def __contains__(self, key: P.RequestKey) -> bool:
        """Whether the request of `key` was aborted in the last memory_s seconds."""
        return key.request in self._requests


class AbortableQueue:
    """An actor's work items, taken in arrival order by one worker (`serve`) while the actor's
    inbox keeps being read: an item whose request is aborted meanwhile (`aborts`) is skipped.
    `run(item)` does one item and answers its own failures; one that escapes is logged."""

    def __init__(self, run: Callable[[Any], Awaitable[None]], key: Callable[[Any], P.RequestKey], log):
        self._run, self._key, self._log = run, key, log
        self._items: collections.deque = collections.deque()
        self._queued = asyncio.Event()
        self.aborts = RecentAborts()
        self.working = False

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: Any) -> None:
        self._items.append(item)
        self._queued.set()

    async def serve(self) -> None:
        """The worker: runs for the actor's life (its background task)."""
        while True:
            await self._queued.wait()
            self._queued.clear()
            await self.run_queued()

    async def run_queued(self) -> None:
        """Do what is queued now, skipping what was aborted."""
        while self._items:
            item = self._items.popleft()
            if self._key(item) in self.aborts:
                continue
            self.working = True
            try:
                await self._run(item)
            except Exception:  # never stop the worker
                self._log.exception("%s failed", self._key(item).rid)
            finally:
                self.working = False
