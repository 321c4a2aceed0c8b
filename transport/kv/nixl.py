"""NIXL implementation of the KV/state transfer (the interface: transport/kv/__init__.py).

One NIXL agent per engine, named after the engine, with the UCX backend; it lives on the
engine's worker thread (agents in sync mode NONE are single-threaded). Pool tensors are
registered whole (DRAM_SEG for CPU tensors, VRAM_SEG for CUDA ones). `peer_info()` carries
the agent metadata plus (address, size, device) of every registered tensor; `connect` loads
it (`add_remote_agent`), warms the connection and sends the peer a Hello notification with our
own metadata, so the peer can answer checksum requests (`send_notif` needs the metadata of the
agent it answers).

A write builds two Nx3 (addr, len, dev) descriptor lists from the paired regions (one
descriptor per coalesced region), posts one NIXL WRITE whose notification is a `Notice`
(transfer id, bytes, and the remote regions when a checksum is asked for), and the worker
polls `check_xfer_state` every ~50 us until DONE or ERR. When a checksum is asked for, the
receiving worker computes the crc32 of the landed bytes on seeing the notice (NIXL delivers it
after the data) and answers with an `Ack` notification; the write completes on that ack.
The receiver's worker polls `get_new_notifs` every `idle_poll_s` when idle (which also drives
UCX progress when its transports need the target's help, e.g. tcp).

Environment: NIXL_LOG_LEVEL defaults to WARN here (NIXL logs INFO to stdout otherwise). On a
CPU-only host UCX moves DRAM with cma (process_vm_writev) and tcp/lo; pin UCX_NET_DEVICES=lo
in tests. VRAM registration fails cleanly (NIXL_ERR_BACKEND) where UCX lacks CUDA support.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import torch

from transport.kv.handles import Incoming, TransferHandle
from transport.kv.regions import Region
from transport.kv.wire import PeerInfo, TensorDesc, TransferError, describe_tensor
from transport.kv.worker import WorkerEngine, check_regions, crc32_regions

logger = logging.getLogger(__name__)

_nixl: Any = None
_unavailable: list[str | None] = []  # cached probe result: [reason or None]


def import_nixl() -> Any:
    """The NIXL module: the `nixl` meta package if installed, else `nixl_cu13` (our dependency)."""
    global _nixl
    if _nixl is None:
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
        try:
            import nixl as mod  # type: ignore[import-not-found]

            if not hasattr(mod, "nixl_agent"):
                raise ImportError("the nixl module has no nixl_agent")
        except ImportError:
            import nixl_cu13 as mod  # type: ignore[import-not-found]
        _nixl = mod
    return _nixl


def unavailable_reason() -> str | None:
    """None when NIXL imports and a UCX backend starts in this process, else why not (cached)."""
    if not _unavailable:
        try:
            nixl = import_nixl()
            agent = nixl.nixl_agent(f"glmrt-probe-{os.getpid()}",
                                    nixl.nixl_agent_config(enable_prog_thread=False, backends=[]))
            if "UCX" not in agent.get_plugin_list():
                raise RuntimeError(f"no UCX plugin (plugins: {agent.get_plugin_list()})")
            agent.create_backend("UCX", {})
            if "DRAM_SEG" not in agent.get_backend_mem_types("UCX"):
                raise RuntimeError("the UCX backend cannot move DRAM here")
            del agent
            _unavailable.append(None)
        except Exception as e:  # noqa: BLE001 - ImportError, nixlBackendError, ...
            _unavailable.append(f"{type(e).__name__}: {e}")
    return _unavailable[0]


# ---- notifications (msgpack, tagged) ---------------------------------------------------------


class _Note(msgspec.Struct, tag_field="t", tag=True, array_like=True):
    pass


class Hello(_Note):
    """Sent on connect: our metadata, so the peer can send notifications back."""

    name: str
    metadata: bytes


class Notice(_Note):
    """The notification of a WRITE (delivered after its bytes landed)."""

    transfer_id: str
    source: str
    num_bytes: int
    checksum: bool = False
    regions: list[tuple[str, int, int]] = []  # the receiver's regions, only with checksum


class Ack(_Note):
    transfer_id: str
    ok: bool
    checksum: int | None = None
    error: str | None = None


_note_encoder = msgspec.msgpack.Encoder()
_note_decoder = msgspec.msgpack.Decoder(Hello | Notice | Ack)


@dataclass(eq=False)
class _Inflight:
    handle: TransferHandle
    xfer: Any  # nixl_xfer_handle until DONE, then None
    crc: int | None = None  # our crc of the source bytes
    ack: Ack | None = None


class NixlTransferEngine(WorkerEngine):
    backend = "nixl"

    def __init__(self, name: str, *, enable_prog_thread: bool = False, ucx_params: dict[str, str] | None = None,
                 poll_interval_s: float = 50e-6, idle_poll_s: float = 1e-3, call_timeout: float = 30.0):
        """`enable_prog_thread`: NIXL's own progress thread (off by default: on 2 cores it made
        notification round trips 30-40 ms and halved throughput). `ucx_params`:
        UCX backend init params (e.g. {"ucx_error_handling_mode": "none"} for shm-only UCX_TLS,
        at the cost of dead-peer detection)."""
        self._prog_thread = enable_prog_thread
        self._ucx_params = dict(ucx_params or {})
        self._poll_s = poll_interval_s
        self._idle_s = idle_poll_s
        self._agent: Any = None
        self._regs: dict[str, Any] = {}
        self._wdescs: dict[str, TensorDesc] = {}  # worker-side copy of our table
        self._wtensors: dict[str, torch.Tensor] = {}
        self._wpeers: dict[str, PeerInfo] = {}
        self._remote_md: dict[str, bytes] = {}  # agent name -> loaded metadata
        self._inflight: dict[str, _Inflight] = {}
        self._zombies: list[Any] = []  # xfer handles whose abort failed; released later
        super().__init__(name, call_timeout=call_timeout)

    # ---- worker thread ------------------------------------------------------------------------
    def _setup(self) -> None:
        nixl = import_nixl()
        cfg = nixl.nixl_agent_config(enable_prog_thread=self._prog_thread, backends=[])
        self._agent = nixl.nixl_agent(self.name, cfg)
        plugins = self._agent.get_plugin_list()
        if "UCX" not in plugins:
            raise TransferError(f"NIXL has no UCX plugin here (plugins: {plugins})")
        self._agent.create_backend("UCX", self._ucx_params)

    def _loop_once(self) -> None:
        busy = bool(self._inflight)
        self._exec_pending(self._poll_s if busy else self._idle_s)
        if self._inflight or self._zombies:
            self._poll_transfers()
        self._poll_notifs()

    def _teardown(self) -> None:
        for rec in list(self._inflight.values()):
            self._release(rec.xfer)
            self._complete(rec.handle, False, f"transfer engine {self.name!r} closed")
        self._inflight.clear()
        for z in self._zombies:
            self._release(z)
        for name in list(self._remote_md):
            try:
                self._agent.remove_remote_agent(name)
            except Exception:  # noqa: BLE001
                pass
        for reg in self._regs.values():
            try:
                self._agent.deregister_memory(reg)
            except Exception as e:  # noqa: BLE001
                logger.warning("NIXL deregister failed: %s", e)
        self._regs.clear()
        self._agent = None

    def _release(self, xfer: Any) -> bool:
        if xfer is None:
            return True
        try:
            xfer.release()
            return True
        except Exception:  # noqa: BLE001 - still in flight and not abortable
            return False

    def _poll_transfers(self) -> None:
        self._zombies = [z for z in self._zombies if not self._release(z)]
        for tid, rec in list(self._inflight.items()):
            h = rec.handle
            if h.done():  # abandoned by a timed-out waiter (or finished by an ack)
                if not self._release(rec.xfer):
                    self._zombies.append(rec.xfer)
                del self._inflight[tid]
                continue
            if rec.xfer is not None:
                try:
                    state = self._agent.check_xfer_state(rec.xfer)
                except Exception as e:  # noqa: BLE001
                    state, err = "ERR", str(e)
                else:
                    err = "NIXL reported ERR (is the peer alive?)"
                if state == "PROC":
                    continue
                if not self._release(rec.xfer):
                    self._zombies.append(rec.xfer)
                rec.xfer = None
                if state != "DONE":
                    del self._inflight[tid]
                    self._complete(h, False, f"write to {h.peer!r} failed: {err}")
                    continue
                if not h.checksum:
                    del self._inflight[tid]
                    self._complete(h, True)
                    continue
            if rec.ack is not None:  # DONE and acknowledged
                del self._inflight[tid]
                self._settle(rec)

    def _settle(self, rec: _Inflight) -> None:
        ack, h = rec.ack, rec.handle
        assert ack is not None
        if not ack.ok:
            self._complete(h, False, f"{h.peer!r} rejected the write: {ack.error}")
        elif ack.checksum != rec.crc:
            self._complete(h, False, f"checksum mismatch: sent crc32 {rec.crc}, {h.peer!r} has {ack.checksum}")
        else:
            self._complete(h, True, checksum=rec.crc)

    def _poll_notifs(self) -> None:
        try:
            notifs = self._agent.get_new_notifs()
        except Exception as e:  # noqa: BLE001
            logger.warning("NIXL get_new_notifs failed: %s", e)
            return
        for src, msgs in notifs.items():
            src = src.decode() if isinstance(src, bytes) else src
            for raw in msgs:
                try:
                    note = _note_decoder.decode(raw)
                except msgspec.DecodeError:
                    logger.warning("ignoring a foreign NIXL notification from %s (%d bytes)", src, len(raw))
                    continue
                if isinstance(note, Hello):
                    try:
                        self._load_remote(note.name, note.metadata)
                    except Exception as e:  # noqa: BLE001
                        logger.warning("could not load the metadata of NIXL peer %s: %s", note.name, e)
                elif isinstance(note, Notice):
                    self._on_notice(src, note)
                else:
                    rec = self._inflight.get(note.transfer_id)
                    if rec is not None:
                        rec.ack = note
                        if rec.xfer is None:  # already DONE on our side
                            del self._inflight[note.transfer_id]
                            self._settle(rec)

    def _on_notice(self, src: str, note: Notice) -> None:
        crc = None
        if note.checksum:
            regions = [Region(t, o, n) for t, o, n in note.regions]
            try:
                check_regions(regions, self._wdescs, "target")
                crc = crc32_regions(self._wtensors, regions)
                ack = Ack(note.transfer_id, True, crc)
            except TransferError as e:
                ack = Ack(note.transfer_id, False, error=str(e))
            try:
                self._agent.send_notif(src, _note_encoder.encode(ack))
            except Exception as e:  # noqa: BLE001
                logger.warning("cannot acknowledge transfer %s to %s (did it connect to us?): %s",
                               note.transfer_id, src, e)
        self._incoming.append(Incoming(note.transfer_id, note.source, note.num_bytes, crc))

    def _load_remote(self, agent_name: str, metadata: bytes) -> None:
        if self._remote_md.get(agent_name) == metadata:
            return
        if agent_name in self._remote_md:
            try:
                self._agent.remove_remote_agent(agent_name)
            except Exception:  # noqa: BLE001
                pass
            self._remote_md.pop(agent_name, None)
        self._agent.add_remote_agent(metadata)
        self._remote_md[agent_name] = metadata

    # ---- commands -----------------------------------------------------------------------------
    def _do_register(self, tensor_id: str, tensor: torch.Tensor) -> TensorDesc:
        dev = tensor.get_device()  # -1 on the CPU
        mem = "DRAM" if dev < 0 else "VRAM"
        reg = self._agent.register_memory(tensor)  # DRAM_SEG / VRAM_SEG from the tensor's device
        self._regs[tensor_id] = reg
        desc = describe_tensor(tensor_id, tensor, addr=tensor.data_ptr(), dev_id=max(dev, 0), mem_type=mem)
        self._wdescs[tensor_id] = desc
        self._wtensors[tensor_id] = tensor
        return desc

    def _do_peer_info(self) -> PeerInfo:
        return PeerInfo(backend=self.backend, name=self.name, tensors=list(self._wdescs.values()),
                        agent_metadata=self._agent.get_agent_metadata())

    def _do_connect(self, peer_name: str, info: PeerInfo) -> None:
        self._load_remote(info.name, info.agent_metadata)
        self._wpeers[peer_name] = info
        try:
            self._agent.make_connection(info.name)
        except Exception as e:  # noqa: BLE001 - optional warm-up
            logger.debug("NIXL make_connection(%s) failed: %s", info.name, e)
        self._agent.send_notif(info.name, _note_encoder.encode(Hello(self.name, self._agent.get_agent_metadata())))

    def _check_write(self, peer: PeerInfo, local: list[Region], remote: list[Region]) -> None:
        lm = {self._descs[r.tensor_id].mem_type for r in local}
        rm = {peer.tensor(r.tensor_id).mem_type for r in remote}
        if len(lm) > 1 or len(rm) > 1:
            raise TransferError(f"one NIXL write moves one memory type per side (local {lm}, remote {rm}); "
                                "split it by device")

    def _do_write(self, h: TransferHandle) -> None:
        if h.done():
            return
        peer = self._wpeers[h.peer]
        rdescs = {t.tensor_id: t for t in peer.tensors}
        ld = self._wdescs[h.local_regions[0].tensor_id]
        rd = rdescs[h.remote_regions[0].tensor_id]
        local = np.array([(self._wdescs[r.tensor_id].addr + r.offset_bytes, r.num_bytes,
                           self._wdescs[r.tensor_id].dev_id) for r in h.local_regions], dtype=np.uint64)
        remote = np.array([(rdescs[r.tensor_id].addr + r.offset_bytes, r.num_bytes, rdescs[r.tensor_id].dev_id)
                           for r in h.remote_regions], dtype=np.uint64)
        notice = Notice(h.transfer_id, self.name, h.num_bytes, h.checksum,
                        [(r.tensor_id, r.offset_bytes, r.num_bytes) for r in h.remote_regions] if h.checksum else [])
        h.posted_at = time.perf_counter()
        xfer = None
        try:
            ldl = self._agent.get_xfer_descs(local, ld.mem_type)
            rdl = self._agent.get_xfer_descs(remote, rd.mem_type)
            xfer = self._agent.initialize_xfer("WRITE", ldl, rdl, peer.name, _note_encoder.encode(notice))
            state = self._agent.transfer(xfer)
        except Exception as e:  # noqa: BLE001
            if xfer is not None and not self._release(xfer):
                self._zombies.append(xfer)
            self._complete(h, False, f"NIXL could not post the write to {h.peer!r}: {type(e).__name__}: {e}")
            return
        if state == "ERR":
            if not self._release(xfer):
                self._zombies.append(xfer)
            self._complete(h, False, f"NIXL failed to post the write to {h.peer!r} (is the peer alive?)")
            return
        rec = _Inflight(h, xfer)
        if h.checksum:  # while the bytes move
            rec.crc = crc32_regions(self._wtensors, h.local_regions)
        self._inflight[h.transfer_id] = rec
        self._poll_transfers()

    def _do_abandon(self, h: TransferHandle) -> None:
        rec = self._inflight.pop(h.transfer_id, None)
        if rec is not None and not self._release(rec.xfer):
            self._zombies.append(rec.xfer)
