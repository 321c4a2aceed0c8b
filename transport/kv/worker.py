"""The machinery both backends share: one worker thread per engine owns all I/O; tensor and
peer tables, validation, handles and `wait` live here, the backends fill in the `_do_*`
commands (transport/kv/nixl.py, transport/kv/zmq.py)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
import uuid
import zlib
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgspec
import numpy as np
import torch

from glmrt.protocol import StateComponent
from transport.kv.handles import DEFAULT_TIMEOUT_S, Incoming, TransferHandle, TransferResult
from transport.kv.regions import Region, component_regions, pair_components, pair_regions, region_bytes
from transport.kv.wire import WIRE_VERSION, PeerInfo, TensorDesc, TransferError, decode_peer_info

logger = logging.getLogger(__name__)


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

    def _peer(self, peer_name: str) -> PeerInfo:
        peer = self._peers.get(peer_name)
        if peer is None:
            raise TransferError(f"not connected to {peer_name!r} (connected: {sorted(self._peers)})")
        return peer

    def _local_tensor(self, tensor_id: str) -> TensorDesc:
        desc = self._descs.get(tensor_id)
        if desc is None:
            raise TransferError(f"local tensor {tensor_id!r} is not registered (known: {sorted(self._descs)})")
        return desc

    def peer_tensor(self, peer_name: str, tensor_id: str) -> TensorDesc:
        return self._peer(peer_name).tensor(tensor_id)

    def write(self, peer_name: str, local_regions: Sequence[Region], remote_regions: Sequence[Region],
              checksum: bool = False, *, transfer_id: str | None = None) -> TransferHandle:
        if self._closed:
            raise TransferError(f"transfer engine {self.name!r} is closed")
        peer = self._peer(peer_name)
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

    def write_components(self, peer_name: str, local: Sequence[StateComponent], remote: Sequence[StateComponent],
                         checksum: bool = False, *, transfer_id: str | None = None) -> TransferHandle:
        pair_components(local, remote)
        peer = self._peer(peer_name)
        loc = component_regions(local, self._local_tensor)
        rem = component_regions(remote, peer.tensor)
        for c in local:  # the component's own size must be what its rows hold here
            held = region_bytes(component_regions([c], self._local_tensor))
            if held != c.num_bytes:
                raise TransferError(f"{c.kind} says {c.num_bytes} bytes, its rows hold {held} here")
        return self.write(peer_name, loc, rem, checksum, transfer_id=transfer_id)

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
            return self.abandon(handle, timeout)

    def abandon(self, handle: TransferHandle, timeout: float) -> TransferResult:
        """Give up on a write not done within `timeout` (from any thread, without a loop: a rank
        that polls its writes) -> its result: the timeout's failure, or what it ended with first."""
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

