"""What an engine actor remembers of the requests it accepted: duplicates and detokenizer replays.

A request can reach an engine twice: the api re-sends a request held by a tokenizer that died,
and that tokenizer may have forwarded it already. `RequestLedger.accept` admits each
`RequestKey` once, while the request runs and for `KEEP_S` after it ended. The ledger also keeps
each request's `DetokenizeRequest` and, for `KEEP_S`, the whole output of its finished choices,
so that `replay` can rebuild a restarted detokenizer's state: the tokens it lost may belong to a
choice that finished while it was down. Used by the engine actor's step thread only.
"""

from __future__ import annotations

import collections
import time

from glmrt import protocol as P

KEEP_S = 120.0  # how long an ended request is remembered (a restart takes seconds)


class RequestLedger:
    def __init__(self, keep_s: float = KEEP_S) -> None:
        self.keep_s = keep_s
        self.detokenize: dict[P.RequestKey, P.DetokenizeRequest | None] = {}  # every known request
        self.finished: dict[P.RequestKey, list[P.TokenOut]] = {}  # request -> its finished choices' output
        self._ended: collections.deque[tuple[float, P.RequestKey]] = collections.deque()

    def accept(self, key: P.RequestKey, detokenize: P.DetokenizeRequest | None) -> bool:
        """Whether request `key` is new (then it is remembered); False for a duplicate."""
        self._expire()
        if key in self.detokenize:
            return False
        self.detokenize[key] = detokenize
        return True

    def hold(self, key: P.RequestKey, detokenize: P.DetokenizeRequest | None) -> None:
        """Remember a request that arrived by handoff (a decode's choices come one at a time)."""
        self._expire()
        self.detokenize.setdefault(key, detokenize)

    def finish_choice(self, out: P.TokenOut) -> None:
        """A choice finished: `out` is its whole output (first_index 0), kept for replays."""
        self.finished.setdefault(out.key.request, []).append(out)

    def end(self, key: P.RequestKey) -> None:
        """Request `key` holds nothing here any more: forget it after `keep_s`."""
        self._expire()
        self._ended.append((time.monotonic(), key))

    def _expire(self) -> None:
        now = time.monotonic()
        while self._ended and now - self._ended[0][0] > self.keep_s:
            _, key = self._ended.popleft()
            self.detokenize.pop(key, None)
            self.finished.pop(key, None)

    def replay(self, want: P.ReplayRequest, live: list[P.TokenOut]) -> list[tuple[str, P.DetokenizeReplay]]:
        """The DetokenizeReplays for `want.detokenizer`: every request it names that runs here or
        finished a choice here, with `live` (the running choices' output so far, first_index 0)
        and the finished choices. The api names only requests routed through that detokenizer."""
        received = {p.key: p.received for p in want.progress}
        by_request: dict[P.RequestKey, list[P.TokenOut]] = {}
        for out in live:
            by_request.setdefault(out.key.request, []).append(out)
        replays = []
        for key in dict.fromkeys(p.key.request for p in want.progress):
            detokenize = self.detokenize.get(key)
            outs = by_request.get(key, []) + self.finished.get(key, [])
            if detokenize is None or not outs:
                continue
            choices = [P.ReplayedChoice(tokens=o, received=received.get(o.key, 0)) for o in outs]
            replays.append((want.detokenizer, P.DetokenizeReplay(request=detokenize, choices=choices)))
        return replays
