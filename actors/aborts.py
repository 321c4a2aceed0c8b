"""Whole-request aborts an actor remembers for a while.

An Abort can reach an actor before the work it cancels (the api aborts everywhere at once while
the request is still a hop upstream) or while that work waits in the actor's queue. Each actor
that can skip work keeps the aborts of the last `memory_s` seconds and asks about a request
when its work comes up. Choice-only aborts (a stop string ending one of n choices) are not kept:
they cancel no whole request.
"""

from __future__ import annotations

import time

from glmrt import protocol as P

ABORT_MEMORY_S = 60.0  # a request that reaches an actor later than this after its abort is served


class RecentAborts:
    def __init__(self, memory_s: float = ABORT_MEMORY_S):
        self.memory_s = memory_s
        self._when: dict[P.RequestKey, float] = {}  # whole request -> when its abort came, oldest first

    def note(self, abort: P.Abort) -> bool:
        """Remember `abort` if it cancels a whole request -> whether it does."""
        if abort.choice_only:
            return False
        self._when.pop(abort.key.request, None)  # re-inserted last: insertion order stays time order
        self._when[abort.key.request] = time.monotonic()
        return True

    def __contains__(self, key: P.RequestKey) -> bool:
        """Whether the request of `key` was aborted in the last memory_s seconds."""
        now = time.monotonic()
        while self._when:
            oldest, t = next(iter(self._when.items()))
            if now - t <= self.memory_s:
                break
            del self._when[oldest]
        return key.request in self._when
