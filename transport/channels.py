"""asyncio ZeroMQ channels between actors: an actor binds one `Inbox` (PULL) and connects an
`Outbox` (PUSH) to each peer it sends to; every channel is bound to a `Codec` and its union.

Addresses follow placement (`address_for`): peers in one process use `inproc://` (they must
share one zmq Context), peers on one host `ipc://` under the run directory, other hosts
`tcp://`. The supervisor hands addresses out; actors never invent them.

Backpressure: both ends have bounded high-water marks, so `Outbox.send` waits when the peer
falls behind instead of growing memory without bound. Sockets close with linger 0: whatever
is unsent at close is dropped (shutdown is a `Shutdown`/`Drained` exchange, not a flush).

Threading: zmq sockets are not thread-safe and live on the actor's event loop thread only.
Socket I/O stays off the compute path: the engine actor runs its step (schedule -> forward
-> sample) in a worker thread (`loop.run_in_executor` or a dedicated thread) and passes
inputs and outputs through the loop (`call_soon_threadsafe`), so sends and receives overlap
with GPU work and a slow peer never stalls a forward pass.
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import zmq
import zmq.asyncio

from transport.codec import Codec, ProtocolError

logger = logging.getLogger(__name__)

Placement = Literal["process", "host", "remote"]
"""Where the peers of an inbox live relative to it: same process, same host, other hosts."""

DEFAULT_HWM = 4096  # messages queued per socket before senders wait
IPC_PATH_MAX = 107  # sockaddr_un.sun_path is 108 bytes including the NUL

_SHORT = {"api": "api", "tokenizer": "tok", "vision": "vis", "engine": "eng", "unified": "eng",
          "prefill": "pre", "decode": "dec", "detokenizer": "det", "supervisor": "sup"}


def address_id(kind: str, replica: int = 0) -> str:
    """The id under which an actor's inbox is known ("detokenizer/0"), e.g. in `reply_to`."""
    return f"{kind}/{replica}"


def make_run_dir(base: str | os.PathLike | None = None) -> Path:
    """The run directory for ipc sockets, mode 0700: a new /tmp/glmrt-<pid>-XXXXXXXX/, or `base`.

    Whoever can write into it can talk to every actor's inbox, so a fresh name is made atomically
    (mkdtemp: no other user can have made it first), and a `base` that already exists must be a
    directory of ours that no one else can enter; anything else raises PermissionError."""
    if base is None:
        return Path(tempfile.mkdtemp(prefix=f"glmrt-{os.getpid()}-"))
    path = Path(base)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"run directory {path}: must be a directory owned by this user with mode 0700 "
                              f"(found mode {stat.S_IMODE(st.st_mode):o}, owner uid {st.st_uid}"
                              f"{', a symbolic link' if stat.S_ISLNK(st.st_mode) else ''})")
    return path


def address_for(kind: str, replica: int, placement: Placement, run_dir: str | os.PathLike | None = None,
                *, host: str = "127.0.0.1", port: int = 0) -> str:
    """The address an actor's inbox binds to, given where its peers live.

    `remote` binds `tcp://host:port`; port 0 picks a free port at bind time (read the real
    one from `Inbox.address` and publish that).
    """
    if placement == "process":
        return f"inproc://glmrt-{kind}-{replica}"
    if placement == "host":
        if run_dir is None:
            raise ValueError("ipc addresses need the run directory (make_run_dir())")
        addr = f"ipc://{Path(run_dir) / (_SHORT.get(kind, kind[:8]) + str(replica))}"
        if len(addr.removeprefix("ipc://").encode()) > IPC_PATH_MAX:
            raise ValueError(f"ipc path {addr} is longer than {IPC_PATH_MAX} bytes; use a shorter run_dir")
        return addr
    if placement == "remote":
        return f"tcp://{host}:{port}"
    raise ValueError(f"unknown placement {placement!r}; expected 'process', 'host' or 'remote'")


class Inbox:
    """An actor's one inbound socket (PULL, bound). `recv` gives (message, tensor frames)."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, codec: Codec, *, hwm: int = DEFAULT_HWM):
        self.codec = codec
        self.num_rejected = 0
        self._sock = ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, hwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        # NOTE: libzmq drops the connection of a peer that sends an oversize frame (checked per
        # frame on ipc/tcp, not on inproc); the codec checks again for every transport.
        self._sock.setsockopt(zmq.MAXMSGSIZE, codec.max_message_bytes)
        if address.startswith("tcp://") and address.endswith(":0"):
            address = address[:-2] + ":*"
        self._sock.bind(address)
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)

    async def recv(self) -> tuple[Any, list[memoryview]]:
        """Next message and its tensor frames (zero-copy views); raises ProtocolError on a bad
        message, which is consumed, so the caller may log it and receive again."""
        frames = await self._sock.recv_multipart(copy=False)
        try:
            return self.codec.decode(frames)
        except ProtocolError:
            self.num_rejected += 1
            raise

    async def drain(self, limit: int | None = None) -> list[tuple[Any, list[memoryview]]]:
        """Every message already queued (up to `limit`) without waiting: the engine step's
        "drain the inbox". Bad messages are logged, counted in `num_rejected` and skipped."""
        out: list[tuple[Any, list[memoryview]]] = []
        while limit is None or len(out) < limit:
            try:
                frames = await self._sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            try:
                out.append(self.codec.decode(frames))
            except ProtocolError as e:
                self.num_rejected += 1
                logger.warning("inbox %s dropped a message: %s", self.address, e)
        return out

    def close(self) -> None:
        self._sock.close(linger=0)

    async def __aenter__(self) -> Inbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class Outbox:
    """A connection to one peer's inbox (PUSH, connected). `send` waits when the peer's queue
    and ours are full (high-water marks)."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, codec: Codec, *, hwm: int = DEFAULT_HWM):
        self.address = address
        self.codec = codec
        self._sock = ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)

    async def send(self, msg: Any, tensors: Sequence[Any] = ()) -> None:
        """Send `msg` with `tensors` as out-of-band frames (see codec.py). Tensor memory is
        shared with zmq, not copied: do not modify it until this returns and zmq has sent it
        (pass a copy when the buffer is reused right away)."""
        await self._sock.send_multipart(self.codec.encode(msg, tensors), copy=False)

    def close(self) -> None:
        self._sock.close(linger=0)

    async def __aenter__(self) -> Outbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class Peers:
    """Outboxes by address id ("detokenizer/0"), connected on first use.

    `resolve(peer_id)` returns the peer's (address, codec); the supervisor's address table
    provides it. Replies (`reply_to`, `EngineRequest.detokenizer`) go through here.
    """

    def __init__(self, ctx: zmq.asyncio.Context, resolve: Callable[[str], tuple[str, Codec]],
                 *, hwm: int = DEFAULT_HWM):
        self._ctx = ctx
        self._resolve = resolve
        self._hwm = hwm
        self._outboxes: dict[str, Outbox] = {}

    def get(self, peer_id: str) -> Outbox:
        box = self._outboxes.get(peer_id)
        if box is None:
            address, codec = self._resolve(peer_id)
            box = self._outboxes[peer_id] = Outbox(self._ctx, address, codec, hwm=self._hwm)
        return box

    async def send(self, peer_id: str, msg: Any, tensors: Sequence[Any] = ()) -> None:
        await self.get(peer_id).send(msg, tensors)

    def forget(self, peer_id: str) -> None:
        """Close the link to a retired replica (the next send reconnects to its new address)."""
        box = self._outboxes.pop(peer_id, None)
        if box is not None:
            box.close()

    def close(self) -> None:
        for box in self._outboxes.values():
            box.close()
        self._outboxes.clear()
