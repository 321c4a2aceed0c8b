"""The actor base: one inbox, an async shell around a synchronous core.

Life of an actor: `setup()` (load the model, the tokenizer...) -> `Ready` to the supervisor
-> receive loop (`handle(msg, frames)`) with a heartbeat task beside it -> on `Shutdown`:
stop taking work; with `drain`, wait until `busy()` is False; send `Drained`; close.
Addresses are not invented here: an actor finds every peer by its address id
("engine/1") through the run spec the supervisor gave it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from glmrt import protocol as P
from glmrt.actor_config import ActorConfig, ActorLogConfig
from glmrt.actor_kinds import KINDS, kind_of
from transport.channels import Inbox, Peers, address_for
from transport.codec import Codec, ProtocolError

INBOX_UNION = {"api": P.API_IN, "supervisor": P.SUPERVISOR_IN, **{k.name: k.inbox for k in KINDS}}
HEARTBEAT_S = 0.5
DRAIN_QUIET_S = 1.0  # a draining actor exits only after this long without new messages


@dataclass
class RunSpec:
    """What the supervisor hands an actor process (JSON on its command line, encode_run_specs)."""

    kind: str
    replica: int
    run_dir: str
    config: ActorConfig
    """The kind's typed config section (glmrt.actor_kinds: config_type)."""
    gpus: list[int] = field(default_factory=list)
    colocated: list[str] = field(default_factory=list)   # actor ids sharing this process
    log: ActorLogConfig = field(default_factory=ActorLogConfig)
    """How the process logs (one level for all the actors it runs)."""

    @property
    def actor_id(self) -> str:
        return f"{self.kind}/{self.replica}"


def encode_run_specs(specs: list[RunSpec]) -> str:
    """The command-line argument of one actor process running `specs` (msgspec JSON)."""
    return msgspec.json.encode({"actors": specs}).decode()


def decode_run_specs(text: str) -> list[RunSpec]:
    """encode_run_specs' inverse: each config decoded into its kind's config type."""
    specs = []
    for d in msgspec.json.decode(text)["actors"]:
        d["config"] = msgspec.convert(d["config"], kind_of(d["kind"]).config_type)
        d["log"] = msgspec.convert(d.get("log", {}), ActorLogConfig)
        specs.append(RunSpec(**d))
    return specs


def inbox_address(run_dir: str, actor_id: str) -> str:
    kind, replica = actor_id.split("/")
    return address_for(kind, int(replica), "host", run_dir)


def local_address(actor_id: str) -> str:
    kind, replica = actor_id.split("/")
    return address_for(kind, int(replica), "process")


def codec_for(actor_id: str) -> Codec:
    return Codec(INBOX_UNION[actor_id.split("/")[0]])


class Actor:
    kind = "actor"

    def __init__(self, spec: RunSpec, ctx: zmq.asyncio.Context | None = None):
        self.spec = spec
        self.log = logging.getLogger(spec.actor_id)   # its lines read `... INFO engine/0: ...`
        self.ctx = ctx or zmq.asyncio.Context()
        local = set(spec.colocated)
        self.peers = Peers(self.ctx, lambda pid: (local_address(pid) if pid in local
                                                  else inbox_address(spec.run_dir, pid), codec_for(pid)))
        self.inbox: Inbox | None = None
        self.accepting = True
        self._stop = asyncio.Event()
        self._drain = False
        self._last_msg = 0.0

    # ---- to override ---------------------------------------------------------------------
    async def setup(self) -> dict[str, Any]:
        """Load what the actor needs; returns facts for its Ready message."""
        return {}

    async def handle(self, msg: Any, frames: list) -> None:
        raise NotImplementedError

    def busy(self) -> bool:
        """True while the actor holds requests (drain waits for False)."""
        return False

    def load(self) -> tuple[float, int, int]:
        return 0.0, 0, 0

    async def background(self) -> None:
        """Extra work beside the receive loop (the engine's compute loop)."""
        await self._stop.wait()

    async def teardown(self) -> None:
        pass

    # ---- the shell -----------------------------------------------------------------------
    async def send(self, peer_id: str, msg: Any, tensors=()) -> None:
        await self.peers.send(peer_id, msg, tensors)

    async def run(self) -> None:
        spec = self.spec
        self.inbox = Inbox(self.ctx, inbox_address(spec.run_dir, spec.actor_id), codec_for(spec.actor_id))
        if len(spec.colocated) > 1:  # peers in this process reach it without a syscall round trip
            self.inbox._sock.bind(local_address(spec.actor_id))
        info = await self.setup()
        await self.send("supervisor/0", P.Ready(actor=spec.kind, replica=spec.replica, pid=os.getpid(),
                                                host=socket.gethostname(), gpus=list(spec.gpus), info=info))
        tasks = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._heartbeat()),
                 asyncio.create_task(self.background())]
        stop = asyncio.create_task(self._stop.wait())
        await asyncio.wait([stop, *tasks], return_when=asyncio.FIRST_COMPLETED)
        crashed = next((t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None), None)
        if crashed is not None:
            # NOTE: a loop that died leaves an actor whose heartbeat still says alive while its
            # requests wait forever: the process exits instead, and the supervisor fails what it
            # held and restarts it.
            for t in (stop, *tasks):
                t.cancel()
            raise RuntimeError(f"{spec.actor_id}: {crashed.get_coro().__qualname__} failed") from crashed.exception()
        if self._drain:
            # NOTE: requests routed to us before the api stopped routing here can still be in
            # flight (a tokenizer hop away): serve them too, and leave only once quiet and idle.
            loop = asyncio.get_running_loop()
            while self.busy() or loop.time() - self._last_msg < DRAIN_QUIET_S:
                await asyncio.sleep(0.05)
        await self.send("supervisor/0", P.Drained(actor=spec.kind, replica=spec.replica))
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.teardown()
        await asyncio.sleep(0.05)  # let the Drained frame leave (linger 0 on close)
        self.inbox.close()
        self.peers.close()

    async def _recv_loop(self) -> None:
        while True:
            try:
                msg, frames = await self.inbox.recv()
            except ProtocolError as e:
                self.log.warning("dropped a bad message: %s", e)
                continue
            self._last_msg = asyncio.get_running_loop().time()
            if isinstance(msg, P.Shutdown):
                self.accepting = False
                self._drain = msg.drain
                self._stop.set()
                continue
            try:
                await self.handle(msg, frames)
            except Exception:  # one bad request must not kill the actor
                self.log.exception("failed handling %s", type(msg).__name__)

    async def _heartbeat(self) -> None:
        while True:
            load, running, waiting = self.load()
            await self.send("supervisor/0", P.Heartbeat(actor=self.spec.kind, replica=self.spec.replica,
                                                        load=load, running=running, waiting=waiting))
            await asyncio.sleep(HEARTBEAT_S)
