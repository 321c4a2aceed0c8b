"""zmq fallback of the KV/state transfer (the interface: transport/kv/__init__.py), for hosts without NIXL.

Every engine binds one ROUTER (`address`, default tcp://127.0.0.1 on a free port; use an
`ipc://` path on one host, a routable tcp address across hosts) and opens one DEALER per peer
it writes to. A write is one multipart message: a msgpack `WriteMsg` header (transfer id,
source, the receiver's regions, checksum flag) followed by one frame per paired region, sent
zero-copy from the source tensor (CUDA regions are copied to host first). The receiver's
worker validates the header against its registered tensors, copies every frame into place
(numpy copy for CPU tensors, `copy_` for CUDA ones), optionally computes the crc32 of the
landed bytes, and answers with an `AckMsg`; the write completes on that ack.

A timed-out write resets the connection to its peer (closing the DEALER drops whatever is
still queued, so stale bytes are not delivered later; writes in flight to that peer fail
too). A dead peer never acks, so its writes end by the waiter's timeout. All sockets live on
the engine's worker thread, which waits on a zmq poller (plus a pipe that wakes it for
commands).
"""

from __future__ import annotations

import logging
import os
import time
import warnings
import zlib
from dataclasses import dataclass

import msgspec
import numpy as np
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from transport.kv.handles import Incoming, TransferHandle
from transport.kv.regions import Region
from transport.kv.wire import PeerInfo, TensorDesc, TransferError, describe_tensor
from transport.kv.worker import WorkerEngine, check_regions, crc32_regions, flat_bytes

logger = logging.getLogger(__name__)


class WriteMsg(msgspec.Struct, array_like=True):
    transfer_id: str
    source: str
    regions: list[tuple[str, int, int]]  # receiver's (tensor_id, offset, bytes), one per frame
    checksum: bool = False


class AckMsg(msgspec.Struct, array_like=True):
    transfer_id: str
    ok: bool
    num_bytes: int = 0
    checksum: int | None = None
    error: str | None = None


_enc = msgspec.msgpack.Encoder()
_write_dec = msgspec.msgpack.Decoder(WriteMsg)
_ack_dec = msgspec.msgpack.Decoder(AckMsg)


@dataclass(eq=False)
class _Inflight:
    handle: TransferHandle
    crc: int | None = None


class ZmqTransferEngine(WorkerEngine):
    backend = "zmq"

    def __init__(self, name: str, *, address: str = "tcp://127.0.0.1:*", sndhwm: int = 1000,
                 call_timeout: float = 30.0):
        self._bind_to = address[:-2] + ":*" if address.startswith("tcp://") and address.endswith(":0") else address
        self._sndhwm = sndhwm
        self.address = ""
        self._ctx: zmq.Context | None = None
        self._router: zmq.Socket | None = None
        self._poller = zmq.Poller()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._dealers: dict[str, zmq.Socket] = {}
        self._monitors: dict[zmq.Socket, str] = {}  # dealer monitor socket -> peer name
        self._down: set[str] = set()  # peers whose connection dropped (writes fail at once)
        self._wpeers: dict[str, PeerInfo] = {}
        self._wdescs: dict[str, TensorDesc] = {}
        self._wtensors: dict[str, torch.Tensor] = {}
        self._np_bytes: dict[str, np.ndarray] = {}  # flat uint8 numpy views of CPU tensors
        self._inflight: dict[str, _Inflight] = {}
        super().__init__(name, call_timeout=call_timeout)

    # ---- worker thread ------------------------------------------------------------------------
    def _setup(self) -> None:
        self._ctx = zmq.Context(io_threads=1)
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.RCVHWM, 0)
        self._router.bind(self._bind_to)
        self.address = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._poller.register(self._router, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)

    def _wake(self) -> None:
        if self._wake_w < 0:
            return
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # the pipe is full (the worker will wake anyway) or closed

    def _loop_once(self) -> None:
        events = dict(self._poller.poll(timeout=200))
        if self._wake_r in events:
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
        self._exec_pending()
        if self._router in events:
            self._recv_writes()
        for peer, sock in list(self._dealers.items()):
            if events.get(sock) and self._dealers.get(peer) is sock:
                self._recv_acks(sock)
        for mon, peer in list(self._monitors.items()):
            if events.get(mon) and self._monitors.get(mon) == peer:
                self._on_monitor(mon, peer)

    def _teardown(self) -> None:
        for rec in self._inflight.values():
            self._complete(rec.handle, False, f"transfer engine {self.name!r} closed")
        self._inflight.clear()
        for peer in list(self._dealers):
            self._close_dealer(peer)
        if self._router is not None:
            self._router.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
        fds, self._wake_r, self._wake_w = (self._wake_r, self._wake_w), -1, -1
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass

    # ---- receiving ----------------------------------------------------------------------------
    def _recv_writes(self) -> None:
        assert self._router is not None
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) < 2:
                continue
            ident, data = frames[0], frames[2:]
            try:
                msg = _write_dec.decode(frames[1].buffer)
            except msgspec.DecodeError as e:
                logger.warning("dropping an undecodable transfer message: %s", e)
                continue
            ack = self._land(msg, data)
            try:
                self._router.send_multipart([ident, _enc.encode(ack)], zmq.NOBLOCK)
            except zmq.ZMQError as e:  # the writer is gone
                logger.debug("cannot ack transfer %s: %s", msg.transfer_id, e)
            if ack.ok:
                self._incoming.append(Incoming(msg.transfer_id, msg.source, ack.num_bytes, ack.checksum))

    def _land(self, msg: WriteMsg, data: list[zmq.Frame]) -> AckMsg:
        regions = [Region(t, o, n) for t, o, n in msg.regions]
        try:
            check_regions(regions, self._wdescs, "target")
            if len(data) != len(regions):
                raise TransferError(f"{len(data)} data frames for {len(regions)} regions")
            for r, f in zip(regions, data):
                if f.buffer.nbytes != r.num_bytes:
                    raise TransferError(f"frame of {f.buffer.nbytes} bytes for region {r}")
        except TransferError as e:
            return AckMsg(msg.transfer_id, False, error=str(e))
        crc = 0
        total = 0
        for r, f in zip(regions, data):
            src = np.frombuffer(f.buffer, dtype=np.uint8)
            dst_np = self._np_bytes.get(r.tensor_id)
            if dst_np is not None:
                dst = dst_np[r.offset_bytes:r.end]
                np.copyto(dst, src)
                if msg.checksum:
                    crc = zlib.crc32(dst, crc)
            else:  # CUDA
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # read-only frame buffer: we only read it
                    src_t = torch.frombuffer(f.buffer, dtype=torch.uint8)
                dst_t = flat_bytes(self._wtensors[r.tensor_id])[r.offset_bytes:r.end]
                dst_t.copy_(src_t)
                if msg.checksum:
                    crc = zlib.crc32(dst_t.cpu().numpy(), crc)
            total += r.num_bytes
        return AckMsg(msg.transfer_id, True, total, crc if msg.checksum else None)

    def _recv_acks(self, sock: zmq.Socket) -> None:
        while True:
            try:
                raw = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                ack = _ack_dec.decode(raw)
            except msgspec.DecodeError:
                logger.warning("dropping an undecodable transfer ack")
                continue
            rec = self._inflight.pop(ack.transfer_id, None)
            if rec is None or rec.handle.done():
                continue
            h = rec.handle
            if not ack.ok:
                self._complete(h, False, f"{h.peer!r} rejected the write: {ack.error}")
            elif ack.num_bytes != h.num_bytes:
                self._complete(h, False, f"{h.peer!r} landed {ack.num_bytes} of {h.num_bytes} bytes")
            elif h.checksum and ack.checksum != rec.crc:
                self._complete(h, False, f"checksum mismatch: sent crc32 {rec.crc}, {h.peer!r} has {ack.checksum}")
            else:
                self._complete(h, True, checksum=rec.crc)

    # ---- commands -----------------------------------------------------------------------------
    def _do_register(self, tensor_id: str, tensor: torch.Tensor) -> TensorDesc:
        desc = describe_tensor(tensor_id, tensor)
        self._wdescs[tensor_id] = desc
        self._wtensors[tensor_id] = tensor
        if tensor.device.type == "cpu":
            self._np_bytes[tensor_id] = flat_bytes(tensor).numpy()
        return desc

    def _do_peer_info(self) -> PeerInfo:
        return PeerInfo(backend=self.backend, name=self.name, tensors=list(self._wdescs.values()),
                        address=self.address)

    def _open_dealer(self, peer_name: str, info: PeerInfo) -> None:
        assert self._ctx is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self._sndhwm)
        mon = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sock.connect(info.address)
        self._dealers[peer_name] = sock
        self._monitors[mon] = peer_name
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(mon, zmq.POLLIN)

    def _close_dealer(self, peer_name: str) -> None:
        sock = self._dealers.pop(peer_name, None)
        if sock is None:
            return
        for mon, peer in list(self._monitors.items()):
            if peer == peer_name:
                del self._monitors[mon]
                self._poller.unregister(mon)
                try:
                    sock.disable_monitor()
                except zmq.ZMQError:
                    pass
                mon.close(linger=0)
        self._poller.unregister(sock)
        sock.close(linger=0)

    def _on_monitor(self, mon: zmq.Socket, peer_name: str) -> None:
        while True:
            try:
                event = recv_monitor_message(mon, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            if event == zmq.EVENT_CONNECTED:
                self._down.discard(peer_name)
            elif event == zmq.EVENT_DISCONNECTED:
                # zmq would replay the queued writes into whatever listens there next: drop them
                self._reset_peer(peer_name, f"connection to {peer_name!r} dropped (peer gone?)")
                self._down.add(peer_name)
                return  # `mon` is closed now

    def _reset_peer(self, peer_name: str, reason: str) -> None:
        """Close the link to a peer (dropping what is queued), fail its writes, reconnect."""
        self._close_dealer(peer_name)
        for tid, rec in list(self._inflight.items()):
            if rec.handle.peer == peer_name:
                del self._inflight[tid]
                self._complete(rec.handle, False, reason)
        info = self._wpeers.get(peer_name)
        if info is not None:
            self._open_dealer(peer_name, info)

    def _do_connect(self, peer_name: str, info: PeerInfo) -> None:
        self._wpeers[peer_name] = info
        self._down.discard(peer_name)
        self._reset_peer(peer_name, f"reconnected to {peer_name!r}")

    def _do_write(self, h: TransferHandle) -> None:
        if h.done():
            return
        if h.peer in self._down:
            self._complete(h, False, f"{h.peer!r} is disconnected (peer gone?)")
            return
        sock = self._dealers[h.peer]
        header = WriteMsg(h.transfer_id, self.name, [(r.tensor_id, r.offset_bytes, r.num_bytes)
                                                     for r in h.remote_regions], h.checksum)
        frames: list = [_enc.encode(header)]
        for r in h.local_regions:
            np_view = self._np_bytes.get(r.tensor_id)
            if np_view is not None:
                frames.append(np_view[r.offset_bytes:r.end])  # zero-copy
            else:
                frames.append(flat_bytes(self._wtensors[r.tensor_id])[r.offset_bytes:r.end].cpu().numpy())
        h.posted_at = time.perf_counter()
        try:
            sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self._complete(h, False, f"send queue to {h.peer!r} is full (peer not reading?)")
            return
        except zmq.ZMQError as e:
            self._complete(h, False, f"cannot send to {h.peer!r}: {e}")
            return
        rec = _Inflight(h)
        if h.checksum:  # while the frames go out
            rec.crc = crc32_regions(self._wtensors, h.local_regions)
        self._inflight[h.transfer_id] = rec

    def _do_abandon(self, h: TransferHandle) -> None:
        if self._inflight.pop(h.transfer_id, None) is not None:
            self._reset_peer(h.peer, f"connection to {h.peer!r} reset: transfer {h.transfer_id} timed out")
