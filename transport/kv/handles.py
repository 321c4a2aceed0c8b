"""What a posted write gives back: its handle, its result, the writes that landed here, and
the `TransferEngine` interface every backend implements."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from glmrt.protocol import StateComponent
from transport.kv.regions import Region
from transport.kv.wire import TensorDesc

DEFAULT_TIMEOUT_S = 30.0


@dataclass(slots=True)
class TransferResult:
    ok: bool
    num_bytes: int  # bytes moved (0 when not ok)
    seconds: float  # from posting to completion (or to the failure)
    checksum: int | None = None  # crc32 of the moved bytes when requested (sender's view)
    error: str | None = None

    @property
    def mb_per_s(self) -> float:
        return self.num_bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0


@dataclass(frozen=True, slots=True)
class Incoming:
    """A write that landed in our registered tensors."""

    transfer_id: str
    source: str  # the writer's engine name
    num_bytes: int
    checksum: int | None = None  # receiver-side crc32, when the writer asked for checksums


@dataclass(eq=False)
class TransferHandle:
    """One posted write. `num_descriptors` = descriptors (NIXL) or frames (zmq) it posted."""

    transfer_id: str
    peer: str
    num_bytes: int
    num_descriptors: int
    local_regions: list[Region]
    remote_regions: list[Region]
    checksum: bool = False
    posted_at: float = 0.0
    _engine: Any = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _result: TransferResult | None = field(default=None, repr=False)
    _waiters: list = field(default_factory=list, repr=False)

    def done(self) -> bool:
        return self._result is not None

    @property
    def result(self) -> TransferResult | None:
        return self._result

    def _finish(self, result: TransferResult) -> bool:
        """Set the result once (worker completion and waiter timeout race); True if we won."""
        with self._lock:
            if self._result is not None:
                return False
            self._result = result
            waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            try:
                loop.call_soon_threadsafe(_resolve, fut, result)
            except RuntimeError:  # that loop is closed; nobody waits there any more
                pass
        return True


def _resolve(fut: asyncio.Future, result: TransferResult) -> None:
    if not fut.done():
        fut.set_result(result)


@runtime_checkable
class TransferEngine(Protocol):
    name: str
    backend: str

    def register(self, tensor_id: str, tensor: Any) -> TensorDesc:
        """Register a contiguous CPU or CUDA tensor (a whole pool, once); returns its description."""
        ...

    def peer_info(self) -> bytes:
        """What a peer needs to `connect` to us (call after registering every tensor)."""
        ...

    def connect(self, peer_name: str, info: bytes) -> None:
        """Get ready to write into peer `peer_name` (info = its peer_info()); again to refresh."""
        ...

    def peer_tensor(self, peer_name: str, tensor_id: str) -> TensorDesc:
        """A connected peer's registered tensor (plan remote regions with page_regions on it)."""
        ...

    def write(self, peer_name: str, local_regions: Sequence[Region], remote_regions: Sequence[Region],
              checksum: bool = False, *, transfer_id: str | None = None) -> TransferHandle:
        """Post a one-sided write of our bytes into the peer's registered tensors."""
        ...

    def write_components(self, peer_name: str, local: Sequence[StateComponent], remote: Sequence[StateComponent],
                         checksum: bool = False, *, transfer_id: str | None = None) -> TransferHandle:
        """Post the write of our state components into the peer's (same kinds, rows and bytes)."""
        ...

    async def wait(self, handle: TransferHandle, timeout: float = DEFAULT_TIMEOUT_S) -> TransferResult:
        """Completion of `handle`; ok=False (never an exception) on failure or timeout."""
        ...

    def incoming(self) -> list[Incoming]:
        """Writes that landed in our tensors since the last call."""
        ...

    def checksum(self, regions: Sequence[Region]) -> int:
        """crc32 of our registered bytes in `regions` (in order)."""
        ...

    def close(self) -> None:
        ...

