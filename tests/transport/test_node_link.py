"""The CURVE link between an engine's ranks on several nodes (transport/node_link.py), over real
ZMQ TCP sockets on 127.0.0.1: steps reach the other rank; a peer that does not speak CURVE, or
whose CURVE key is not a rank's, gets nothing through and rank 0 logs the refusal (the socket
monitor's handshake event, the ZAP handler's denial); a rank whose connection closes is lost at
once, on both ends; a group that ends on purpose loses nobody. The store the ranks meet at is a
dict here (in a deployment: torch.distributed's TCPStore)."""

from __future__ import annotations

import json
import logging
import threading
import time

import pytest
import zmq
import zmq.auth

from transport import node_link
from transport.node_link import PREFIX, LinkClient, LinkServer

BIND = "tcp://127.0.0.1:*"


class DictStore:
    """set / blocking get, as torch.distributed's stores behave."""

    def __init__(self):
        self.values: dict[str, bytes] = {}
        self.cond = threading.Condition()

    def set(self, key: str, value) -> None:
        with self.cond:
            self.values[key] = value.encode() if isinstance(value, str) else bytes(value)
            self.cond.notify_all()

    def get(self, key: str) -> bytes:
        with self.cond:
            assert self.cond.wait_for(lambda: key in self.values, timeout=20), key
            return self.values[key]


class Lost:
    def __init__(self):
        self.why: list[str] = []
        self.event = threading.Event()

    def __call__(self, why: str) -> None:
        self.why.append(why)
        self.event.set()


def _pair(key_file=None, client_key_file=None):
    """A rank 0 and a rank 1 linked through one store -> (server, client, store, lost0, lost1)."""
    store, lost0, lost1 = DictStore(), Lost(), Lost()
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("server", LinkServer(
        store, BIND, 2, key_file, on_lost=lost0, log=logging.getLogger("test.link.rank0"))))
    t.start()
    client = LinkClient(store, 1, client_key_file or key_file, {"pid": 1, "device": "cpu"}, on_lost=lost1,
                        log=logging.getLogger("test.link.rank1"))
    t.join(20)
    return box["server"], client, store, lost0, lost1


def _close(*ends):
    """The group ends on purpose: every end is told first (rank 0 publishes a stop)."""
    for end in ends:
        end.quiet()
    for end in ends:
        end.close()


def _refused(caplog, text: str, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(text in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.timeout(60)
def test_steps_reach_the_other_rank_and_peers_without_the_key_get_nothing(caplog):
    caplog.set_level(logging.WARNING, logger="test.link")
    server, client, store, lost0, lost1 = _pair()
    assert server.peers == {1: {"pid": 1, "device": "cpu"}}
    server.send(b"step 1")
    assert client.recv() == b"step 1"
    addr = json.loads(store.get(PREFIX + "addr"))
    ctx = zmq.Context()
    try:
        plain = ctx.socket(zmq.DEALER)  # no CURVE at all, posing as rank 1
        plain.setsockopt(zmq.ROUTING_ID, b"rank1")
        plain.connect(addr["plan"])
        plain.send_multipart([b"hello", b"{}"])
        assert _refused(caplog, "no CURVE handshake with this engine's key"), caplog.text
        stranger = ctx.socket(zmq.DEALER)  # CURVE with rank 0's public key, but a key of its own
        public, secret = zmq.curve_keypair()
        stranger.curve_serverkey = bytes(store.get(PREFIX + "server_key"))
        stranger.curve_publickey, stranger.curve_secretkey = public, secret
        stranger.connect(addr["plan"])
        stranger.send_multipart([b"hello", b"{}"])
        assert _refused(caplog, f"its CURVE key {public.decode()} is not one of this engine's ranks"), caplog.text
        server.send(b"step 2")
        assert client.recv() == b"step 2"
        assert not plain.poll(300) and not stranger.poll(300)  # nothing came through to either
        assert server.plan.poll(0) == 0  # and nothing of theirs reached rank 0
    finally:
        ctx.destroy(linger=0)
    time.sleep(0.6)  # pings went both ways meanwhile: neither end is lost
    assert not lost0.why and not lost1.why
    _close(client, server)
    assert not lost0.why and not lost1.why


@pytest.mark.timeout(60)
def test_a_rank_whose_connection_closes_is_lost_at_once():
    server, client, _, lost0, _ = _pair()
    t0 = time.monotonic()
    client.close()  # no stop from rank 0: rank 1 went away
    assert lost0.event.wait(2.0), "rank 0 did not notice"
    assert time.monotonic() - t0 < 2.0 and lost0.why == ["rank 1's connection closed"]
    _close(server)

    server, client, _, _, lost1 = _pair()
    server.close()  # rank 0 went away, without quiet()
    assert lost1.event.wait(2.0) and lost1.why == ["rank 0's connection closed"]
    _close(client)


@pytest.mark.timeout(60)
def test_a_key_file_is_the_only_key_accepted(tmp_path, caplog, monkeypatch):
    caplog.set_level(logging.WARNING, logger="test.link")
    _, good = zmq.auth.create_certificates(str(tmp_path), "nodes")
    server, client, _, lost0, _ = _pair(key_file=good)
    server.send(b"step")
    assert client.recv() == b"step"
    _close(client, server)
    assert not lost0.why
    # a rank holding another key file never gets in: rank 0 waits for it and logs each refusal
    (tmp_path / "other").mkdir()
    _, other = zmq.auth.create_certificates(str(tmp_path / "other"), "nodes")
    store = DictStore()
    errors = []

    monkeypatch.setattr(node_link, "HELLO_TIMEOUT_S", 2.0)

    def serve():
        try:
            LinkServer(store, BIND, 2, good, on_lost=Lost(), log=logging.getLogger("test.link.rank0"))
        except RuntimeError as e:
            errors.append(str(e))
    t = threading.Thread(target=serve)
    t.start()
    time.sleep(0.2)
    addr = json.loads(store.get(PREFIX + "addr"))
    ctx = zmq.Context()
    try:
        public, secret = zmq.auth.load_certificate(other)
        s = ctx.socket(zmq.DEALER)
        s.curve_serverkey = zmq.auth.load_certificate(good)[0]
        s.curve_publickey, s.curve_secretkey = public, secret
        s.connect(addr["plan"])
        s.send_multipart([b"hello", b"{}"])
        assert _refused(caplog, "is not one of this engine's ranks"), caplog.text
        t.join(10)
    finally:
        ctx.destroy(linger=0)
    assert errors and "ranks [1] did not reach the rank link" in errors[0], errors


@pytest.mark.timeout(60)
def test_a_rank_that_falls_silent_is_lost_after_the_beat_timeout(tmp_path, monkeypatch):
    monkeypatch.setattr(node_link, "BEAT_TIMEOUT_S", 1.0)
    _, key_file = zmq.auth.create_certificates(str(tmp_path), "nodes")
    public, secret = zmq.auth.load_certificate(key_file)
    store, lost0, box = DictStore(), Lost(), {}
    t = threading.Thread(target=lambda: box.setdefault("server", LinkServer(
        store, BIND, 2, key_file, on_lost=lost0, log=logging.getLogger("test.link.rank0"))))
    t.start()
    addr = json.loads(store.get(PREFIX + "addr"))
    ctx = zmq.Context()
    try:
        socks = []
        for name in ("plan", "beat"):  # a rank 1 that says hello, stays connected and never beats
            s = ctx.socket(zmq.DEALER)
            s.curve_serverkey, s.curve_publickey, s.curve_secretkey = public, public, secret
            s.setsockopt(zmq.ROUTING_ID, b"rank1")
            s.connect(addr[name])
            s.send_multipart([b"hello", b"{}"] if name == "plan" else [b"hello"])
            socks.append(s)
        t.join(20)
        assert lost0.event.wait(5.0) and lost0.why == ["rank 1 did not answer for 1 s"], lost0.why
    finally:
        ctx.destroy(linger=0)
    _close(box["server"])
