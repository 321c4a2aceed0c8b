"""The last program of a group to finish runs the group's epilogue, in the same launch.

A split-K GEMM at decode sizes writes fp32 partials and used a second launch to sum them; in a
batch-1 step each such launch waits for the one before it (bench/RESULTS.md). Here every program
of a group stores its part, then takes a ticket from the group's counter; the program that draws
the last ticket reads the parts back and finishes the group, and resets the counter to zero for
the next launch (CUTLASS's serial split-K: a barrier, then one thread's release/acquire atomic).

Counters come from a zeroed ring per device (`counters`): consecutive calls take consecutive
slices, so launches that may run at once (a layer's two streams, at most a fork-join window
apart) never share one, and a CUDA graph keeps the slices its capture took. A slice starts on a
128-byte line: the kernel's counter pointer always has the same alignment (one compiled variant,
none compiled for a new offset mid-capture), and concurrent launches share no line. A counter is
zero again when its launch ends, whatever the launch's size. Inside a capture with no ring yet (it
would capture the ring's memset) the caller gets None and keeps its separate launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

RING = 1 << 16  # counters per device (256 KiB): a slice comes back after a few hundred launches
ALIGN = 32  # counters: one 128-byte line
_rings: dict = {}  # device -> [counter tensor, next offset]


def counters(device: torch.device, n: int) -> torch.Tensor | None:
    """At least n zeroed int32 counters that nothing else in flight uses, or None (see above)."""
    n = -(-n // ALIGN) * ALIGN
    if n > RING:
        return None
    key = (device.type, device.index if device.index is not None
           else (torch.cuda.current_device() if device.type == "cuda" else 0))
    ring = _rings.get(key)
    if ring is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        ring = _rings[key] = [torch.zeros(RING, dtype=torch.int32, device=device), 0]
        if device.type == "cuda":  # zero before any stream's launch draws a ticket (the side stream's too)
            torch.cuda.synchronize(device)
    if ring[1] + n > RING:
        ring[1] = 0
    out = ring[0][ring[1]: ring[1] + n]  # (n rounded up: the next slice starts on a line too)
    ring[1] += n
    return out


@triton.jit
def last_arrival(COUNTER, group_size):
    """True in the group's last program to get here (then reset the counter). Every program of
    the group calls it once, after its stores; the one it returns True in sees them all (with
    cache_modifier=".cg" loads: L1 is not coherent between SMs)."""
    tl.debug_barrier()  # every thread's stores issued before the ticket (one thread takes it)
    ticket = tl.atomic_add(COUNTER, 1, sem="acq_rel")
    last = ticket == group_size - 1
    if last:
        tl.atomic_xchg(COUNTER, 0)
    return last
