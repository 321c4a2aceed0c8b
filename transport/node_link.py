"""The link between the ranks of an engine that spans nodes: ZMQ over TCP, CURVE-authenticated
and encrypted.

Rank 0 (`LinkServer`) binds two ROUTER sockets on the one interface the deployment names (the
host of --dist-init-addr, never a wildcard): `plan`, on which every step's inputs go to each
other rank (prompts' token ids, positions, page tables), and `beat`, on which a thread pings
each rank and hears it back. The other ranks (`LinkClient`) connect a DEALER to each. Both
sockets are CURVE servers: a peer must know rank 0's public key, and its own key must be one
that rank 0 expects; ZAP (pyzmq's authenticator thread) refuses any other, and a socket monitor
reports peers that do not speak CURVE at all. Each refusal is logged as a warning.

Keys come from the torch.distributed store the ranks met at (each rank makes its own pair at
start and writes its public key there; rank 0 reads them before it binds, so no rank can be
refused for arriving early), or from a key file that every node holds (`--curve-key-file`: one
pair, used by every rank). The store is plain TCP: keys made at start keep the link's traffic
private from a network that can see it but not from one that can write to the store; a key file
also authenticates against that.

Liveness: a rank that stops answering pings for BEAT_TIMEOUT_S, or whose connection closes, is
lost: `on_lost` runs (the engine's ranks end, so a group never waits in a collective for a peer
on another node that has gone). `quiet()` first, when the group ends on purpose.

Neither side imports torch: the store is anything with `set(key, value)` and a blocking
`get(key) -> bytes`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Callable

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

BEAT_S = 0.25          # ping interval, both ways
BEAT_TIMEOUT_S = 10.0  # a peer silent this long is gone (a closed connection is seen at once); long
                       # enough for a busy rank whose beat thread waits for the GIL
HELLO_TIMEOUT_S = 120.0  # the ranks are in the group already when they say hello
ZAP_DOMAIN = "glmrt-ranks"
PREFIX = "glmrt-link/"
_REFUSALS = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "its handshake failed (no CURVE handshake with this "
                                                   "engine's key)",
             zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "its handshake broke the protocol (no CURVE handshake with this "
                                                  "engine's key)",
             zmq.EVENT_HANDSHAKE_FAILED_AUTH: "its CURVE key was refused"}
_MONITORED = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH


def load_key_file(path: str) -> tuple[bytes, bytes]:
    """(public, secret) z85 keys of a CURVE secret key file (zmq.auth.create_certificates'
    `<name>.key_secret`); ValueError says why it cannot be used."""
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the CURVE key file {path}: {e}") from None
    if not public or not secret:
        raise ValueError(f"{path} holds no CURVE secret key (give the .key_secret file, which has both keys)")
    return public, secret


def _identity(rank: int) -> bytes:
    return b"rank%d" % rank


class _LinkEnd:
    """What both ends share: the loss callback, called once, and never after `quiet`."""

    def __init__(self, on_lost: Callable[[str], None], log: logging.Logger):
        self.log = log
        self.on_lost = on_lost
        self._quiet = False
        self._closed = threading.Event()

    def quiet(self) -> None:
        """The group ends on purpose: a rank leaving from now on is not lost."""
        self._quiet = True

    def _lost(self, why: str) -> None:
        if not self._quiet and not self._closed.is_set():
            self._quiet = True
            self.on_lost(why)


class LinkServer(_LinkEnd):
    """Rank 0's end: binds `plan` and `beat` on `bind_url` ("tcp://HOST:*"), waits until ranks
    1..tp_size-1 have said hello on both, then pings them from a thread."""

    def __init__(self, store, bind_url: str, tp_size: int, key_file: str | None,
                 on_lost: Callable[[str], None], log: logging.Logger):
        super().__init__(on_lost, log)
        self.ranks = list(range(1, tp_size))
        self.ctx = zmq.Context()
        if key_file:
            public, secret = load_key_file(key_file)
            self.allowed = {public}
        else:
            log.warning("the rank link's CURVE keys are made at start and exchanged through the store, which "
                        "is not authenticated: where others can reach it, give every node --curve-key-file")
            public, secret = zmq.curve_keypair()
            store.set(PREFIX + "server_key", public)
            self.allowed = {bytes(store.get(PREFIX + f"client_key/{r}")) for r in self.ranks}
        self.auth = ThreadAuthenticator(self.ctx, log=log.getChild("zap"))
        self.auth.start()
        self.auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=self)
        self.plan, plan_url = self._bind(bind_url, public, secret)
        self.beat, beat_url = self._bind(bind_url, public, secret)
        self._monitors = [(self.plan.get_monitor_socket(_MONITORED), plan_url),
                          (self.beat.get_monitor_socket(_MONITORED), beat_url)]
        store.set(PREFIX + "addr", json.dumps({"plan": plan_url, "beat": beat_url}))
        self.peers = self._hellos()
        self._thread = threading.Thread(target=self._beats, daemon=True, name="link-beat")
        self._thread.start()

    # ZAP, on the authenticator's thread
    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.allowed:
            return True
        self.log.warning("refused a peer on the rank link: its CURVE key %s is not one of this engine's ranks",
                         key.decode(errors="replace"))
        return False

    def _bind(self, url: str, public: bytes, secret: bytes):
        s = self.ctx.socket(zmq.ROUTER)
        s.curve_server = True
        s.curve_publickey, s.curve_secretkey = public, secret
        s.zap_domain = ZAP_DOMAIN.encode()
        s.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a rank that has gone raises instead of vanishing
        s.linger = 0
        s.bind(url)
        return s, s.getsockopt_string(zmq.LAST_ENDPOINT)

    def _log_refusals(self, mon, url: str) -> None:
        while mon.poll(0):
            ev = recv_monitor_message(mon)
            why = _REFUSALS.get(ev["event"])
            if why:
                self.log.warning("refused a peer on the rank link %s: %s", url, why)

    def _hellos(self) -> dict[int, dict]:
        """Every other rank's hello on both sockets: rank -> what it said (pid, device, host)."""
        want = {_identity(r): r for r in self.ranks}
        peers: dict[int, dict] = {}
        beats: set[bytes] = set()
        poller = zmq.Poller()
        for s in (self.plan, self.beat, *(m for m, _ in self._monitors)):
            poller.register(s, zmq.POLLIN)
        deadline = time.monotonic() + HELLO_TIMEOUT_S
        while len(peers) < len(want) or len(beats) < len(want):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(want.values()) - set(peers) | {want[b] for b in set(want) - beats})
                raise RuntimeError(f"ranks {missing} did not reach the rank link within {HELLO_TIMEOUT_S:.0f} s")
            events = dict(poller.poll(min(left, 1.0) * 1000))
            for mon, url in self._monitors:
                if mon in events:
                    self._log_refusals(mon, url)
            if self.plan in events:
                ident, *rest = self.plan.recv_multipart()
                if ident in want and len(rest) == 2 and rest[0] == b"hello":
                    peers[want[ident]] = json.loads(rest[1])
            if self.beat in events:
                ident, *_ = self.beat.recv_multipart()
                if ident in want:
                    beats.add(ident)
        return peers

    def send(self, data: bytes) -> None:
        """One step's inputs to every other rank (the step thread's socket)."""
        for r in self.ranks:
            try:
                self.plan.send_multipart([_identity(r), data], copy=False)
            except zmq.ZMQError as e:
                raise RuntimeError(f"rank {r} is gone from the rank link: {e}") from None

    def _beats(self) -> None:
        poller = zmq.Poller()
        poller.register(self.beat, zmq.POLLIN)
        for mon, _ in self._monitors:
            poller.register(mon, zmq.POLLIN)
        heard = {_identity(r): time.monotonic() for r in self.ranks}
        names = {_identity(r): r for r in self.ranks}
        next_ping = 0.0
        try:
            while not self._closed.is_set():
                events = dict(poller.poll(BEAT_S * 1000))
                now = time.monotonic()
                for mon, url in self._monitors:
                    if mon in events:
                        self._log_refusals(mon, url)
                while self.beat.poll(0):
                    ident, *_ = self.beat.recv_multipart()
                    if ident in heard:
                        heard[ident] = now
                if now < next_ping:
                    continue
                next_ping = now + BEAT_S
                for ident, r in names.items():
                    try:
                        self.beat.send_multipart([ident, b"ping"], flags=zmq.NOBLOCK)
                    except zmq.ZMQError as e:
                        if e.errno == zmq.EHOSTUNREACH:
                            self._lost(f"rank {r}'s connection closed")
                    if now - heard[ident] > BEAT_TIMEOUT_S:
                        self._lost(f"rank {r} did not answer for {BEAT_TIMEOUT_S:.0f} s")
        finally:
            self.beat.close(0)
            for mon, _ in self._monitors:
                mon.close(0)

    def close(self) -> None:
        """The step thread, as the group leaves (after `quiet`)."""
        self._quiet = True
        self._closed.set()
        self._thread.join(timeout=2 * BEAT_S + 1)
        self.plan.close(0)
        self.auth.stop()
        self.ctx.term()


class LinkClient(_LinkEnd):
    """Another rank's end: connects to rank 0's `plan` and `beat`, says hello (`info`: its pid,
    device, host), answers pings from a thread, and receives the steps' inputs."""

    def __init__(self, store, rank: int, key_file: str | None, info: dict,
                 on_lost: Callable[[str], None], log: logging.Logger):
        super().__init__(on_lost, log)
        if key_file:
            public, secret = load_key_file(key_file)
            server = public
        else:
            public, secret = zmq.curve_keypair()
            store.set(PREFIX + f"client_key/{rank}", public)
            server = bytes(store.get(PREFIX + "server_key"))
        addr = json.loads(bytes(store.get(PREFIX + "addr")))
        self.ctx = zmq.Context()
        self.plan = self._connect(addr["plan"], rank, server, public, secret)
        self.beat = self._connect(addr["beat"], rank, server, public, secret)
        self._monitor = self.beat.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.plan.send_multipart([b"hello", json.dumps(info).encode()])
        self.beat.send(b"hello")
        self._thread = threading.Thread(target=self._beats, daemon=True, name="link-beat")
        self._thread.start()

    def _connect(self, url: str, rank: int, server: bytes, public: bytes, secret: bytes):
        s = self.ctx.socket(zmq.DEALER)
        s.curve_serverkey = server
        s.curve_publickey, s.curve_secretkey = public, secret
        s.setsockopt(zmq.ROUTING_ID, _identity(rank))
        s.linger = 0
        s.connect(url)
        return s

    def recv(self) -> bytes:
        """The next step's inputs (this rank's main thread)."""
        return self.plan.recv()

    def _beats(self) -> None:
        poller = zmq.Poller()
        poller.register(self.beat, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        heard, timeout = time.monotonic(), HELLO_TIMEOUT_S  # rank 0 pings once every rank said hello
        next_beat = 0.0
        try:
            while not self._closed.is_set():
                events = dict(poller.poll(BEAT_S * 1000))
                now = time.monotonic()
                if self._monitor in events:
                    recv_monitor_message(self._monitor)
                    self._lost("rank 0's connection closed")
                while self.beat.poll(0):
                    self.beat.recv()
                    heard, timeout = now, BEAT_TIMEOUT_S
                if now >= next_beat:
                    next_beat = now + BEAT_S
                    try:
                        self.beat.send(b"beat", flags=zmq.NOBLOCK)
                    except zmq.ZMQError:
                        pass  # queue full while rank 0 is away: the silence below decides
                if now - heard > timeout:
                    self._lost(f"rank 0 did not answer for {timeout:.0f} s")
        finally:
            self.beat.close(0)
            self._monitor.close(0)

    def close(self) -> None:
        self._quiet = True
        self._closed.set()
        self._thread.join(timeout=2 * BEAT_S + 1)
        self.plan.close(0)
        self.ctx.term()
