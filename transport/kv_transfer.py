"""KV and state transfer between engine processes: the planning logic and one interface.

A prefill engine hands a request's typed state (MLA latent pages, pooled indexer-key pages,
indexer tail, KDA conv and recurrent state) to a decode engine. Both engines register their
pool tensors once, exchange `peer_info()` out of band (the Bootstrap handshake), and from then
on the prefill side *writes* byte ranges of its tensors into the decode side's tensors:

    src = make_transfer_engine("prefill/0")            # NIXL when it works here, else zmq
    src.register("latent", kv.latent)                    # once, whole pool tensors
    dst.connect(...) / src.connect("decode/0", decode_info)
    local = page_regions(kv.latent, "latent", src_pages)    # + pooled, slot_regions(...)
    remote = page_regions(peer_latent_shape, "latent", dst_pages)
    h = src.write("decode/0", local, remote, checksum=True)
    res = await src.wait(h, timeout=5.0)                 # TransferResult, never raises

Regions are byte ranges of registered tensors. The i-th byte of the concatenated local regions
lands on the i-th byte of the concatenated remote regions; `pair_regions` cuts both lists at
every boundary and merges neighbours that are adjacent on *both* sides, so each transfer posts
the fewest descriptors possible (NIXL's cost is per descriptor: 1 GiB in one descriptor ran at
~390 GB/s between H200s, 2,048 x 256 KiB at ~50 GB/s). `page_regions` emits one region per
layer per run of consecutive pages, so pages that are adjacent in memory always travel together.

Two implementations (`available_backends()`):
  nixl  transport/nixl_backend.py: NIXL agent + UCX, one-sided WRITE into the peer's
        registered memory (DRAM on CPU, VRAM on GPUs); fastest, needs the nixl-cu13 wheel.
  zmq   transport/zmq_backend.py: the bytes travel as zero-copy zmq frames (DEALER -> ROUTER)
        and the receiver copies them into its registered tensors, then acks.

Both run all their I/O on one worker thread per engine (NIXL agents are single-threaded, zmq
sockets are not thread-safe). The receiver needs no calls of its own to receive: its worker
lands (zmq) or acknowledges (NIXL checksum) writes while the engine does other work.
`incoming()` lists the writes that have landed in our memory since the last call.

Checksums: with `checksum=True` both ends compute zlib.crc32 over the moved bytes (in region
order; the sender over its source bytes, the receiver over its destination bytes after they
landed); a mismatch fails the transfer. CUDA tensors are copied to host only for checksums.

The source regions must not change until `wait` returns (zmq sends them zero-copy, NIXL reads
them in place); the remote regions are the caller's to reserve (e.g. decode allocates its pages
first and tells prefill which, or prefill owns a staging range on the decode side).

Failures: `wait` returns `TransferResult(ok=False, error=...)` when the peer is gone, rejects
the write, or does not finish within the timeout; it never raises and never waits longer than
its timeout. A timed-out write is abandoned (NIXL: the request is released/aborted; zmq: the
connection to the peer is reset, failing its other in-flight writes too); bytes it already
sent may still land, so do not reuse the remote pages for another request until the peer is
known to be healthy again. `TransferError` is raised for programming errors (unknown tensor,
out-of-bounds region, mismatched sizes, not connected, closed engine).

Threading: call an engine's methods from one thread (the actor's event loop); `wait` may be
awaited from any event loop. transport/ imports only glmrt.protocol of ours: pools come in as
plain tensors.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import queue
import threading
import time
import uuid
import zlib
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import msgspec
import numpy as np
import torch

from glmrt.protocol import StateComponent, StateKind

logger = logging.getLogger(__name__)

BackendName = Literal["nixl", "zmq"]
DEFAULT_TIMEOUT_S = 30.0


class TransferError(RuntimeError):
    """A programming error: bad regions, unknown tensor or peer, closed engine, ..."""


# ---------------------------------------------------------------------------------------------
# planning: regions
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Region:
    """`num_bytes` bytes at `offset_bytes` of registered tensor `tensor_id`."""

    tensor_id: str
    offset_bytes: int
    num_bytes: int

    @property
    def end(self) -> int:
        return self.offset_bytes + self.num_bytes


def coalesce(regions: Iterable[Region], *, sort: bool = False) -> list[Region]:
    """Merge consecutive regions of the same tensor that touch (a.end == b.offset_bytes).

    Order is kept (it decides which local byte goes to which remote byte), so only neighbours
    in the list merge; `sort=True` sorts by (tensor_id, offset) first, for a set of regions
    whose order does not matter. Empty regions are dropped.
    """
    items = list(regions)
    for r in items:
        if r.num_bytes < 0 or r.offset_bytes < 0:
            raise TransferError(f"negative offset or size in {r}")
    items = [r for r in items if r.num_bytes > 0]
    if sort:
        items.sort(key=lambda r: (r.tensor_id, r.offset_bytes))
    out: list[Region] = []
    for r in items:
        last = out[-1] if out else None
        if last is not None and last.tensor_id == r.tensor_id and last.end == r.offset_bytes:
            out[-1] = Region(r.tensor_id, last.offset_bytes, last.num_bytes + r.num_bytes)
        else:
            out.append(r)
    return out


def pair_regions(local: Sequence[Region], remote: Sequence[Region]) -> tuple[list[Region], list[Region]]:
    """Cut `local` and `remote` at every boundary of either and merge neighbouring pairs that
    are adjacent on both sides: the descriptor lists a transfer posts (same length, pair i has
    equal sizes). Raises TransferError when the two lists do not hold the same number of bytes."""
    lsz, rsz = region_bytes(local), region_bytes(remote)
    if lsz != rsz:
        raise TransferError(f"local regions hold {lsz} bytes but remote regions {rsz}")
    ls = [r for r in local if r.num_bytes > 0]
    rs = [r for r in remote if r.num_bytes > 0]
    out_l: list[Region] = []
    out_r: list[Region] = []
    i = j = lo = ro = 0
    while i < len(ls) and j < len(rs):
        a, b = ls[i], rs[j]
        n = min(a.num_bytes - lo, b.num_bytes - ro)
        sa, sb = Region(a.tensor_id, a.offset_bytes + lo, n), Region(b.tensor_id, b.offset_bytes + ro, n)
        if (out_l and out_l[-1].tensor_id == sa.tensor_id and out_l[-1].end == sa.offset_bytes
                and out_r[-1].tensor_id == sb.tensor_id and out_r[-1].end == sb.offset_bytes):
            pl, pr = out_l[-1], out_r[-1]
            out_l[-1] = Region(pl.tensor_id, pl.offset_bytes, pl.num_bytes + n)
            out_r[-1] = Region(pr.tensor_id, pr.offset_bytes, pr.num_bytes + n)
        else:
            out_l.append(sa)
            out_r.append(sb)
        lo += n
        ro += n
        if lo == a.num_bytes:
            i, lo = i + 1, 0
        if ro == b.num_bytes:
            j, ro = j + 1, 0
    return out_l, out_r


def region_bytes(regions: Iterable[Region]) -> int:
    return sum(r.num_bytes for r in regions)


def _shape_itemsize(tensor: Any) -> tuple[tuple[int, ...], int]:
    """(shape, itemsize) of a contiguous torch tensor or numpy array, or of a TensorDesc."""
    if isinstance(tensor, TensorDesc):
        return tuple(tensor.shape), tensor.num_bytes // max(1, math.prod(tensor.shape))
    if isinstance(tensor, torch.Tensor):
        if not tensor.is_contiguous():
            raise TransferError("pool tensors must be contiguous")
        return tuple(tensor.shape), tensor.element_size()
    if isinstance(tensor, np.ndarray):
        if not tensor.flags.c_contiguous:
            raise TransferError("pool tensors must be C-contiguous")
        return tuple(tensor.shape), tensor.itemsize
    raise TransferError(f"expected a torch tensor, numpy array or TensorDesc, got {type(tensor).__name__}")


def _runs(rows: Sequence[int]) -> list[tuple[int, int]]:
    """(start, count) of runs of consecutive increasing rows, in the given order."""
    out: list[tuple[int, int]] = []
    for p in rows:
        if out and out[-1][0] + out[-1][1] == p:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((p, 1))
    return out


def page_regions(tensor: Any, tensor_id: str, pages: Sequence[int]) -> list[Region]:
    """Regions of rows `pages` (axis 1) of every layer (axis 0) of a pool tensor [L, N, ...].

    One region per layer per run of consecutive pages (in the order given: the order pairs
    pages with the peer's pages), coalesced, so a run that spans the tail of one layer and the
    head of the next also becomes one region. `tensor` may be the torch tensor, a numpy array
    or the peer's TensorDesc (from its peer_info), so remote regions are planned the same way.
    """
    shape, itemsize = _shape_itemsize(tensor)
    if len(shape) < 2:
        raise TransferError(f"pool tensor {tensor_id!r} must be [layers, rows, ...], got shape {list(shape)}")
    layers, rows = shape[0], shape[1]
    row_bytes = math.prod(shape[2:]) * itemsize
    pages = [int(p) for p in pages]
    for p in pages:
        if not 0 <= p < rows:
            raise TransferError(f"row {p} is out of range for {tensor_id!r} with {rows} rows")
    layer_bytes = rows * row_bytes
    runs = _runs(pages)
    return coalesce(Region(tensor_id, layer * layer_bytes + start * row_bytes, count * row_bytes)
                    for layer in range(layers) for start, count in runs)


def slot_regions(tensor: Any, tensor_id: str, slot: int | Sequence[int]) -> list[Region]:
    """Regions of state slot(s) `slot` (axis 1) of every layer of a state tensor [L, slots, ...]."""
    return page_regions(tensor, tensor_id, [slot] if isinstance(slot, int) else slot)


def describe_component(kind: StateKind, tensor: Any, rows: Sequence[int], checksum: int | None = None) -> StateComponent:
    """The StateComponent (for KVHandoff) of rows `rows` of pool tensor `tensor` moved out of band."""
    shape, itemsize = _shape_itemsize(tensor)
    moved = [shape[0], len(rows), *shape[2:]]
    dtype = str(getattr(tensor, "dtype", "uint8")).removeprefix("torch.")
    return StateComponent(kind=kind, dtype=dtype, shape=moved, num_bytes=math.prod(moved) * itemsize,
                          checksum=checksum)


# ---------------------------------------------------------------------------------------------
# wire structs (peer info and backend messages; never pickled)
# ---------------------------------------------------------------------------------------------


class TensorDesc(msgspec.Struct, array_like=True, frozen=True):
    """What a peer needs to know about one registered tensor (the result of `register`)."""

    tensor_id: str
    num_bytes: int
    dtype: str
    shape: list[int]
    device: str = "cpu"
    addr: int = 0  # NIXL only: base address in the owner's address space
    dev_id: int = 0
    mem_type: str = "DRAM"  # NIXL: "DRAM" | "VRAM"


class PeerInfo(msgspec.Struct, array_like=True):
    """Everything a peer needs to connect to an engine (`peer_info()` encodes it)."""

    backend: str
    name: str
    tensors: list[TensorDesc]
    address: str = ""  # zmq: the ROUTER endpoint receiving writes
    agent_metadata: bytes = b""  # NIXL: get_agent_metadata()
    version: int = 1

    def tensor(self, tensor_id: str) -> TensorDesc:
        for t in self.tensors:
            if t.tensor_id == tensor_id:
                return t
        raise TransferError(f"peer {self.name!r} has no registered tensor {tensor_id!r}")


WIRE_VERSION = 1
_peer_decoder = msgspec.msgpack.Decoder(PeerInfo)


def decode_peer_info(info: bytes | PeerInfo) -> PeerInfo:
    if isinstance(info, PeerInfo):
        return info
    try:
        return _peer_decoder.decode(info)
    except msgspec.DecodeError as e:
        raise TransferError(f"undecodable peer info: {e}") from e


# ---------------------------------------------------------------------------------------------
# handles and results
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# the interface
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# shared machinery: one worker thread per engine owns all I/O
# ---------------------------------------------------------------------------------------------


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 view of a contiguous tensor (any dtype, any device)."""
    return tensor.detach().reshape(-1).view(torch.uint8)


def crc32_regions(tensors: Mapping[str, torch.Tensor], regions: Iterable[Region], crc: int = 0) -> int:
    """zlib.crc32 over `regions` of `tensors`, in order (CUDA bytes are copied to host)."""
    for r in regions:
        view = flat_bytes(tensors[r.tensor_id])[r.offset_bytes:r.end]
        if view.device.type != "cpu":
            view = view.cpu()
        crc = zlib.crc32(view.numpy(), crc)
    return crc


def check_regions(regions: Iterable[Region], table: Mapping[str, TensorDesc], whose: str) -> None:
    for r in regions:
        desc = table.get(r.tensor_id)
        if desc is None:
            raise TransferError(f"{whose} tensor {r.tensor_id!r} is not registered (known: {sorted(table)})")
        if r.offset_bytes < 0 or r.num_bytes < 0 or r.end > desc.num_bytes:
            raise TransferError(f"{whose} region {r} is outside tensor {r.tensor_id!r} of {desc.num_bytes} bytes")


class WorkerEngine:
    """Base of both backends: tensor/peer tables, validation, handles, `wait`, the worker thread.

    Subclasses implement `_setup`, `_loop_once` (wait for work, then do it; call
    `_exec_pending` for commands), `_teardown`, `_wake` and the `_do_*` commands, which all
    run on the worker thread.
    """

    backend = "?"

    def __init__(self, name: str, *, call_timeout: float = 30.0):
        self.name = name
        self._call_timeout = call_timeout
        self._tensors: dict[str, torch.Tensor] = {}
        self._descs: dict[str, TensorDesc] = {}
        self._peers: dict[str, PeerInfo] = {}
        self._incoming: deque[Incoming] = deque()
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = False
        self._closed = False
        ready: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._main, args=(ready,), name=f"kvx-{self.backend}-{name}",
                                         daemon=True)
        self._thread.start()
        try:
            ready.result(timeout=call_timeout)
        except concurrent.futures.TimeoutError:
            self._stop = True
            raise TransferError(f"{self.backend} transfer engine {name!r} did not start in {call_timeout} s") from None

    # ---- worker thread ------------------------------------------------------------------------
    def _main(self, ready: concurrent.futures.Future) -> None:
        try:
            self._setup()
        except BaseException as e:  # noqa: BLE001 - handed to the constructor
            ready.set_exception(e)
            return
        ready.set_result(None)
        try:
            while not self._stop:
                self._loop_once()
        except BaseException:  # noqa: BLE001
            logger.exception("%s transfer worker %s crashed", self.backend, self.name)
        finally:
            self._closed = True  # a crashed worker refuses new work instead of letting it hang
            self._exec_pending()
            try:
                self._teardown()
            except Exception:  # noqa: BLE001
                logger.exception("%s transfer engine %s: teardown failed", self.backend, self.name)

    def _exec_pending(self, block_s: float | None = None) -> bool:
        """Run queued commands (waiting up to block_s for the first one); True if any ran."""
        ran = False
        while True:
            try:
                if block_s is not None and not ran:
                    item = self._cmds.get(timeout=block_s)
                else:
                    item = self._cmds.get_nowait()
            except queue.Empty:
                return ran
            ran = True
            fn, args, fut = item
            try:
                res = fn(*args)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                if fut is not None:
                    fut.set_exception(e)
                else:
                    logger.exception("%s transfer engine %s: %s failed", self.backend, self.name, fn.__name__)
            else:
                if fut is not None:
                    fut.set_result(res)

    def _setup(self) -> None:
        raise NotImplementedError

    def _loop_once(self) -> None:
        raise NotImplementedError

    def _teardown(self) -> None:
        raise NotImplementedError

    def _wake(self) -> None:
        """Wake the worker when it may be blocked on something other than the command queue."""

    def _complete(self, handle: TransferHandle, ok: bool, error: str | None = None,
                  checksum: int | None = None) -> None:
        seconds = time.perf_counter() - handle.posted_at if handle.posted_at else 0.0
        handle._finish(TransferResult(ok, handle.num_bytes if ok else 0, seconds, checksum, error))

    # ---- caller side --------------------------------------------------------------------------
    def _submit(self, fn: Any, *args: Any, reply: bool = True) -> concurrent.futures.Future | None:
        if self._closed:
            raise TransferError(f"transfer engine {self.name!r} is closed")
        fut: concurrent.futures.Future | None = concurrent.futures.Future() if reply else None
        self._cmds.put((fn, args, fut))
        self._wake()
        return fut

    def _call(self, fn: Any, *args: Any) -> Any:
        fut = self._submit(fn, *args)
        try:
            return fut.result(timeout=self._call_timeout)
        except concurrent.futures.TimeoutError:
            raise TransferError(f"{self.backend} worker of {self.name!r} did not answer {fn.__name__} "
                                f"within {self._call_timeout} s") from None

    def register(self, tensor_id: str, tensor: Any) -> TensorDesc:
        if isinstance(tensor, np.ndarray):
            tensor = torch.from_numpy(tensor)
        if not isinstance(tensor, torch.Tensor):
            raise TransferError(f"register needs a torch tensor, got {type(tensor).__name__}")
        if not tensor.is_contiguous() or tensor.numel() == 0:
            raise TransferError(f"tensor {tensor_id!r} must be contiguous and non-empty")
        if tensor_id in self._descs:
            raise TransferError(f"tensor {tensor_id!r} is already registered")
        desc = self._call(self._do_register, tensor_id, tensor)
        self._tensors[tensor_id] = tensor
        self._descs[tensor_id] = desc
        return desc

    def peer_info(self) -> bytes:
        return msgspec.msgpack.encode(self._call(self._do_peer_info))

    def connect(self, peer_name: str, info: bytes | PeerInfo) -> None:
        pinfo = decode_peer_info(info)
        if pinfo.backend != self.backend:
            raise TransferError(f"peer {peer_name!r} uses the {pinfo.backend} transfer backend, we use {self.backend}")
        if pinfo.version != WIRE_VERSION:
            raise TransferError(f"peer {peer_name!r} speaks transfer wire version {pinfo.version}, we {WIRE_VERSION}")
        self._call(self._do_connect, peer_name, pinfo)
        self._peers[peer_name] = pinfo

    def peer_tensor(self, peer_name: str, tensor_id: str) -> TensorDesc:
        peer = self._peers.get(peer_name)
        if peer is None:
            raise TransferError(f"not connected to {peer_name!r} (connected: {sorted(self._peers)})")
        return peer.tensor(tensor_id)

    def write(self, peer_name: str, local_regions: Sequence[Region], remote_regions: Sequence[Region],
              checksum: bool = False, *, transfer_id: str | None = None) -> TransferHandle:
        if self._closed:
            raise TransferError(f"transfer engine {self.name!r} is closed")
        peer = self._peers.get(peer_name)
        if peer is None:
            raise TransferError(f"not connected to {peer_name!r} (connected: {sorted(self._peers)})")
        check_regions(local_regions, self._descs, "local")
        check_regions(remote_regions, {t.tensor_id: t for t in peer.tensors}, f"{peer_name}'s")
        loc, rem = pair_regions(local_regions, remote_regions)
        self._check_write(peer, loc, rem)
        handle = TransferHandle(transfer_id or uuid.uuid4().hex[:16], peer_name, region_bytes(loc), len(loc),
                                loc, rem, bool(checksum), _engine=self)
        if not loc:  # nothing to move
            handle._finish(TransferResult(True, 0, 0.0, 0 if checksum else None))
            return handle
        self._submit(self._do_write, handle, reply=False)
        return handle

    def _check_write(self, peer: PeerInfo, local: list[Region], remote: list[Region]) -> None:
        """Backend-specific validation of a planned write (raise TransferError)."""

    async def wait(self, handle: TransferHandle, timeout: float = DEFAULT_TIMEOUT_S) -> TransferResult:
        if handle._engine is not self:
            raise TransferError("this handle belongs to another transfer engine")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with handle._lock:
            if handle._result is not None:
                return handle._result
            handle._waiters.append((loop, fut))
        try:
            return await asyncio.wait_for(fut, timeout)
        except (TimeoutError, asyncio.TimeoutError):
            seconds = time.perf_counter() - handle.posted_at if handle.posted_at else float(timeout)
            failed = TransferResult(False, 0, seconds, None,
                                    f"timed out after {timeout:g} s writing {handle.num_bytes} bytes to {handle.peer!r}")
            if handle._finish(failed):
                try:
                    self._submit(self._do_abandon, handle, reply=False)
                except TransferError:
                    pass
            return handle._result  # type: ignore[return-value]

    def incoming(self) -> list[Incoming]:
        out: list[Incoming] = []
        while self._incoming:
            out.append(self._incoming.popleft())
        return out

    def checksum(self, regions: Sequence[Region]) -> int:
        check_regions(regions, self._descs, "local")
        return crc32_regions(self._tensors, regions)

    def close(self) -> None:
        if self._closed and not self._thread.is_alive():
            return
        self._stop = True
        self._wake()
        self._cmds.put((lambda: None, (), None))  # unblock a queue wait
        self._closed = True
        self._thread.join(timeout=self._call_timeout)
        if self._thread.is_alive():
            logger.warning("%s transfer worker %s did not stop within %s s", self.backend, self.name,
                           self._call_timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # commands implemented by backends (worker thread)
    def _do_register(self, tensor_id: str, tensor: torch.Tensor) -> TensorDesc:
        raise NotImplementedError

    def _do_peer_info(self) -> PeerInfo:
        raise NotImplementedError

    def _do_connect(self, peer_name: str, info: PeerInfo) -> None:
        raise NotImplementedError

    def _do_write(self, handle: TransferHandle) -> None:
        raise NotImplementedError

    def _do_abandon(self, handle: TransferHandle) -> None:
        raise NotImplementedError


def describe_tensor(tensor_id: str, tensor: torch.Tensor, **extra: Any) -> TensorDesc:
    return TensorDesc(tensor_id=tensor_id, num_bytes=tensor.numel() * tensor.element_size(),
                      dtype=str(tensor.dtype).removeprefix("torch."), shape=[int(s) for s in tensor.shape],
                      device=str(tensor.device), **extra)


# ---------------------------------------------------------------------------------------------
# choosing a backend
# ---------------------------------------------------------------------------------------------


def available_backends() -> list[str]:
    """Backends that work in this process: "nixl" when NIXL imports and its UCX backend starts."""
    from transport import nixl_backend

    return (["nixl"] if nixl_backend.unavailable_reason() is None else []) + ["zmq"]


def make_transfer_engine(name: str, prefer: Literal["auto", "nixl", "zmq"] = "auto", **options: Any) -> WorkerEngine:
    """A transfer engine named `name` (unique per deployment: it is the NIXL agent name).

    prefer="auto" picks NIXL when it imports and its UCX backend starts here, else zmq;
    "nixl" raises TransferError when NIXL is unusable. `options` go to the backend's constructor
    (NixlTransferEngine: enable_prog_thread, ucx_params, ...; ZmqTransferEngine: address, ...).
    """
    if prefer not in ("auto", "nixl", "zmq"):
        raise TransferError(f"unknown transfer backend {prefer!r}; expected auto, nixl or zmq")
    if prefer in ("auto", "nixl"):
        from transport import nixl_backend

        reason = nixl_backend.unavailable_reason()
        if reason is None:
            try:
                return nixl_backend.NixlTransferEngine(name, **options)
            except Exception as e:  # noqa: BLE001
                if prefer == "nixl":
                    raise TransferError(f"NIXL transfer engine failed to start: {e}") from e
                logger.warning("NIXL transfer engine failed to start (%s); using the zmq fallback", e)
        elif prefer == "nixl":
            raise TransferError(f"NIXL is unavailable: {reason}")
        else:
            logger.info("NIXL is unavailable (%s); using the zmq transfer fallback", reason)
        options = {k: v for k, v in options.items() if k in ("address", "call_timeout", "sndhwm")}
    from transport.zmq_backend import ZmqTransferEngine

    return ZmqTransferEngine(name, **options)
