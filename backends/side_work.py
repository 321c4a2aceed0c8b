"""Side work: a chain of launches that may run beside the chain queued after it.

At decode sizes a layer is a chain of small launches, each waiting for the one before, and
some of its links do not depend on each other (the DSA indexer's keys are computed from the
layer input, as are the queries; KDA's output gate from its own projection). A model layer
marks such work with `ops.fork(x)`:

    side = ops.fork(x)
    with side:
        w = indexer.keys(x, ...)     # queued as side work
    q = ...                          # the main chain, queued meanwhile
    side.join()                      # what follows waits for the side work
    sel = indexer.select(q, w, ...)

`Inline` runs the side work where it stands (the reference, CPUs, large batches): the same
order as without a fork. `SideStream` queues it on a second CUDA stream that starts where the
current stream stands when the block opens; `join()` makes the current stream wait for it. In a
CUDA graph capture the two streams become two branches of the graph.

The rules a caller keeps (the caching allocator knows nothing of the fork):
  - every tensor the side work reads stays referenced until join() (the main chain must not
    free it and have its memory reused while the side work may still read it);
  - the main chain neither reads what the side work writes nor writes what it reads before
    join();
  - join() before the forward returns, and no collective inside a fork.
"""

from __future__ import annotations

import functools

import torch


class Inline:
    """Side work run in place, in order."""

    def __enter__(self) -> "Inline":
        return self

    def __exit__(self, *exc) -> bool:
        return False

    def join(self) -> None:
        pass


INLINE = Inline()


class SideStream(Inline):
    """Side work on `stream`, forked from the current stream of its device when the block opens."""

    def __init__(self, stream: torch.cuda.Stream):
        self.stream = stream
        self._ctx = None
        self._open = False

    def __enter__(self) -> "SideStream":
        assert not self._open, "side work does not nest"
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        self._ctx = torch.cuda.stream(self.stream)
        self._ctx.__enter__()
        self._open = True
        return self

    def __exit__(self, *exc) -> bool:
        self._open = False
        self._ctx.__exit__(*exc)
        return False

    def join(self) -> None:
        torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)


@functools.cache
def side_stream(device: int) -> SideStream:
    """The one side stream of a CUDA device. High priority: a pool of its own (torch's
    default-priority pool is shared round robin with graph captures and the host tier's copies),
    and the short chain it carries is on the step's critical path."""
    return SideStream(torch.cuda.Stream(device, priority=-1))
