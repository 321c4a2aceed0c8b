"""KV and state transfer between engine processes: one interface, two backends.

A prefill engine hands a request's state (the named components of glmrt.protocol: MLA latent
pages, pooled indexer-key pages, indexer tail, KDA conv and recurrent state) to a decode
engine. Both engines register their pool tensors once, exchange `peer_info()` in the handoff
messages (HandoffOffer / HandoffAccept), and from then on the prefill side *writes* the rows of
its components into the rows of the decode side's components:

    src = make_transfer_engine("prefill-0")              # NIXL when it works here, else zmq
    src.register("latent", kv.latent)                    # once, whole pool tensors
    src.connect("decode-0", decode_info)
    h = src.write_components("decode-0", mine, theirs, checksum=True)
    res = await src.wait(h, timeout=5.0)                 # TransferResult, never raises

Underneath, components become byte regions of registered tensors (transport/kv/regions.py):
`page_regions` emits one region per layer per run of consecutive rows, and `pair_regions`
merges neighbours adjacent on both sides, so each transfer posts the fewest descriptors
(NIXL's cost is per descriptor: 1 GiB in one descriptor ran at ~390 GB/s between H200s,
2,048 x 256 KiB at ~50 GB/s). `write` takes regions directly.

Two implementations behind the same calls (`available_backends()`):
  nixl  transport/kv/nixl.py: NIXL agent + UCX, one-sided WRITE into the peer's registered
        memory (DRAM on CPU, VRAM on GPUs); fastest, needs the nixl-cu13 wheel.
  zmq   transport/kv/zmq.py: the bytes travel as zero-copy zmq frames (DEALER -> ROUTER) and
        the receiver copies them into its registered tensors, then acks.

Both run all their I/O on one worker thread per engine (NIXL agents are single-threaded, zmq
sockets are not thread-safe). The receiver needs no calls of its own to receive: its worker
lands (zmq) or acknowledges (NIXL checksum) writes while the engine does other work.
`incoming()` lists the writes that have landed in our memory since the last call.

Checksums: with `checksum=True` both ends compute zlib.crc32 over the moved bytes (in region
order; the sender over its source bytes, the receiver over its destination bytes after they
landed); a mismatch fails the transfer. CUDA tensors are copied to host only for checksums.

The source regions must not change until `wait` returns (zmq sends them zero-copy, NIXL reads
them in place); the remote regions are the caller's to reserve (the decode allocates its pages
and slot first and tells the prefill which, in HandoffAccept).

Failures: `wait` returns `TransferResult(ok=False, error=...)` when the peer is gone, rejects
the write, or does not finish within the timeout; it never raises and never waits longer than
its timeout. A timed-out write is abandoned (NIXL: the request is released/aborted; zmq: the
connection to the peer is reset, failing its other in-flight writes too); bytes it already
sent may still land, so do not reuse the remote pages for another request until the peer is
known to be healthy again. `TransferError` is raised for programming errors (unknown tensor,
out-of-bounds region, mismatched sizes or components, not connected, closed engine).

Threading: call an engine's methods from one thread at a time (the engine actor calls them from
its step thread, never while a step runs); `wait` may be awaited from any event loop. transport/ imports only glmrt.protocol of ours: pools come in as
plain tensors.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from transport.kv.handles import DEFAULT_TIMEOUT_S, Incoming, TransferEngine, TransferHandle, TransferResult
from transport.kv.regions import (
    Region,
    coalesce,
    component_regions,
    page_regions,
    pair_components,
    pair_regions,
    region_bytes,
    slot_regions,
)
from transport.kv.wire import PeerInfo, TensorDesc, TransferError
from transport.kv.worker import WorkerEngine

__all__ = ["DEFAULT_TIMEOUT_S", "Incoming", "PeerInfo", "Region", "TensorDesc", "TransferEngine", "TransferError",
           "TransferHandle", "TransferResult", "WorkerEngine", "available_backends", "coalesce",
           "component_regions", "make_transfer_engine", "page_regions", "pair_components", "pair_regions",
           "region_bytes", "slot_regions"]

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "nixl", "zmq")


def available_backends() -> list[str]:
    """Backends that work in this process: "nixl" when NIXL imports and its UCX backend starts."""
    from transport.kv import nixl

    return (["nixl"] if nixl.unavailable_reason() is None else []) + ["zmq"]


def make_transfer_engine(name: str, prefer: Literal["auto", "nixl", "zmq"] = "auto", **options: Any) -> WorkerEngine:
    """A transfer engine named `name` (unique per deployment: it is the NIXL agent name).

    prefer="auto" picks NIXL when it imports and its UCX backend starts here, else zmq;
    "nixl" raises TransferError when NIXL is unusable. `options` go to the backend's constructor
    (NixlTransferEngine: enable_prog_thread, ucx_params, ...; ZmqTransferEngine: address, ...).
    """
    if prefer not in BACKENDS:
        raise TransferError(f"unknown transfer backend {prefer!r}; expected auto, nixl or zmq")
    if prefer in ("auto", "nixl"):
        from transport.kv import nixl

        reason = nixl.unavailable_reason()
        if reason is None:
            try:
                return nixl.NixlTransferEngine(name, **options)
            except Exception as e:  # noqa: BLE001
                if prefer == "nixl":
                    raise TransferError(f"NIXL transfer engine failed to start: {e}") from e
                logger.warning("NIXL transfer engine failed to start (%s); using the zmq fallback", e)
        elif prefer == "nixl":
            raise TransferError(f"NIXL is unavailable: {reason}")
        else:
            logger.info("NIXL is unavailable (%s); using the zmq transfer fallback", reason)
        options = {k: v for k, v in options.items() if k in ("address", "call_timeout", "sndhwm")}
    from transport.kv.zmq import ZmqTransferEngine

    return ZmqTransferEngine(name, **options)
