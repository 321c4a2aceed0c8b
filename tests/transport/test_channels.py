"""PUSH/PULL channels over inproc, ipc (tasks and real processes) and tcp."""

import asyncio
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import zmq
import zmq.asyncio

from glmrt import protocol as P
from transport.channels import Inbox, Outbox, Peers, address_for, address_id, make_run_dir
from transport.codec import Codec, ProtocolError, describe, tensor_from_frame

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def ctx():
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def run_dir():
    path = make_run_dir(tempfile.mkdtemp(prefix="glmrt-t"))  # short: ipc paths are capped
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def _exchange(ctx, address, n=50):
    """Producer and consumer tasks; returns the consumer's messages."""
    inbox = Inbox(ctx, address, Codec(P.DETOK_IN))
    outbox = Outbox(ctx, inbox.address, Codec(P.DETOK_IN))

    async def produce():
        for i in range(n):
            out = P.TokenOut(key=P.RequestKey(rid=f"r{i}"), token_ids=[i], first_index=i)
            await outbox.send(P.TokenBatch(items=[out]))
        await outbox.send(P.Shutdown())

    async def consume():
        got = []
        while True:
            msg, frames = await inbox.recv()
            assert frames == []
            if isinstance(msg, P.Shutdown):
                return got
            got.append(msg)

    _, got = await asyncio.wait_for(asyncio.gather(produce(), consume()), 10)
    outbox.close()
    inbox.close()
    assert [m.items[0].token_ids for m in got] == [[i] for i in range(n)]  # in order, one sender
    return got


async def test_inproc_between_tasks(ctx):
    await _exchange(ctx, address_for("detokenizer", 0, "process"))


async def test_ipc_between_tasks(ctx, run_dir):
    address = address_for("detokenizer", 0, "host", run_dir)
    assert address == f"ipc://{run_dir}/det0"
    await _exchange(ctx, address)


async def test_tcp_ephemeral_port(ctx):
    inbox = Inbox(ctx, address_for("engine", 0, "remote", host="127.0.0.1", port=0), Codec(P.ENGINE_IN))
    assert inbox.address.startswith("tcp://127.0.0.1:") and not inbox.address.endswith(":0")
    outbox = Outbox(ctx, inbox.address, Codec(P.ENGINE_IN))
    emb = np.random.default_rng(0).standard_normal((16, 32)).astype(np.float32)
    await outbox.send(P.VisionResult(key=P.RequestKey(rid="v"), embeddings=[describe(emb, 0)]), [emb])
    msg, frames = await asyncio.wait_for(inbox.recv(), 5)
    assert np.array_equal(tensor_from_frame(msg.embeddings[0], frames[0]), emb)
    outbox.close()
    inbox.close()


CHILD = """
import asyncio, sys
import numpy as np, zmq.asyncio
from glmrt import protocol as P
from transport.channels import Inbox, Outbox
from transport.codec import Codec, describe

async def main(parent, mine):
    ctx = zmq.asyncio.Context()
    inbox = Inbox(ctx, mine, Codec(P.CONTROL))
    out = Outbox(ctx, parent, Codec(P.ENGINE_IN))
    emb = np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024)  # 4 MiB
    await out.send(P.VisionResult(key=P.RequestKey(rid="mp"), embeddings=[describe(emb, 0)]), [emb])
    msg, _ = await asyncio.wait_for(inbox.recv(), 10)  # the parent's ack: linger 0 is safe now
    assert isinstance(msg, P.Shutdown), msg
    out.close(); inbox.close(); ctx.term()

asyncio.run(main(*sys.argv[1:]))
"""


async def test_ipc_between_processes_zero_copy(ctx, run_dir):
    inbox = Inbox(ctx, address_for("engine", 0, "host", run_dir), Codec(P.ENGINE_IN))
    child_address = address_for("vision", 0, "host", run_dir)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", CHILD, inbox.address, child_address,
                                                cwd=ROOT, env=env)
    try:
        msg, frames = await asyncio.wait_for(inbox.recv(), 15)
        assert isinstance(msg, P.VisionResult) and msg.key.rid == "mp"
        assert msg.embeddings[0] == P.TensorRef(dtype="float32", shape=[1024, 1024], frame=0)
        assert frames[0].nbytes == 4 << 20
        arr = tensor_from_frame(msg.embeddings[0], frames[0])
        assert np.array_equal(arr.reshape(-1), np.arange(1 << 20, dtype=np.float32))
        # zero-copy: the array views the received zmq frame, it owns no memory of its own
        assert not arr.flags.owndata and isinstance(frames[0].obj, zmq.Frame)
        assert np.shares_memory(arr, np.frombuffer(frames[0], np.uint8))
        async with Outbox(ctx, child_address, Codec(P.CONTROL)) as ack:
            await ack.send(P.Shutdown())
            assert await asyncio.wait_for(proc.wait(), 15) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        inbox.close()


async def test_recv_rejects_bad_message_and_continues(ctx):
    inbox = Inbox(ctx, "inproc://bad", Codec(P.ENGINE_IN))
    raw = ctx.socket(zmq.PUSH)
    raw.connect(inbox.address)
    await raw.send_multipart([b"\x80\x04garbage"])
    await raw.send_multipart(Codec(P.ENGINE_IN).encode(P.Abort(key=P.RequestKey(rid="ok"))))
    with pytest.raises(ProtocolError):
        await asyncio.wait_for(inbox.recv(), 5)
    msg, _ = await asyncio.wait_for(inbox.recv(), 5)
    assert msg == P.Abort(key=P.RequestKey(rid="ok")) and inbox.num_rejected == 1
    raw.close(linger=0)
    inbox.close()


async def test_drain_skips_bad_messages(ctx):
    inbox = Inbox(ctx, "inproc://drain", Codec(P.ENGINE_IN))
    raw = ctx.socket(zmq.PUSH)
    raw.connect(inbox.address)
    codec = Codec(P.ENGINE_IN)
    for i in range(5):
        await raw.send_multipart(codec.encode(P.Abort(key=P.RequestKey(rid=str(i)))))
        if i == 2:
            not_for_engines = Codec(P.API_IN).encode(P.TextOut(key=P.RequestKey(rid="x")))[0]
            await raw.send_multipart([not_for_engines])
    first, _ = await asyncio.wait_for(inbox.recv(), 5)
    await asyncio.sleep(0.05)
    rest = await inbox.drain()
    assert [first.key.rid] + [m.key.rid for m, _ in rest] == ["0", "1", "2", "3", "4"]
    assert inbox.num_rejected == 1 and await inbox.drain() == []
    raw.close(linger=0)
    inbox.close()


async def test_oversize_over_ipc_is_dropped(ctx, run_dir):
    inbox = Inbox(ctx, address_for("api", 0, "host", run_dir), Codec(P.API_IN, max_message_bytes=1024))
    raw = ctx.socket(zmq.PUSH)
    raw.setsockopt(zmq.RECONNECT_IVL, 20)
    raw.connect(inbox.address)
    small = Codec(P.API_IN).encode(P.TextOut(key=P.RequestKey(rid="small")))
    await raw.send_multipart(Codec(P.API_IN).encode(P.TextOut(key=P.RequestKey(rid="x" * 4096))))  # > MAXMSGSIZE

    async def first_message():
        while True:  # libzmq drops the sender's connection; it reconnects and later sends arrive
            await raw.send_multipart(small)
            try:
                return await asyncio.wait_for(inbox.recv(), 0.2)
            except TimeoutError:
                pass

    msg, _ = await asyncio.wait_for(first_message(), 5)
    assert msg.key.rid == "small"
    raw.close(linger=0)
    inbox.close()


async def test_peers_by_address_id(ctx):
    inboxes = {address_id("detokenizer", i): Inbox(ctx, address_for("detokenizer", i, "process"),
                                                    Codec(P.DETOK_IN)) for i in range(2)}
    peers = Peers(ctx, lambda pid: (inboxes[pid].address, inboxes[pid].codec))
    await peers.send("detokenizer/1", P.Abort(key=P.RequestKey(rid="b")))
    await peers.send("detokenizer/0", P.Abort(key=P.RequestKey(rid="a")))
    assert peers.get("detokenizer/0") is peers.get("detokenizer/0")
    with pytest.raises(TypeError):
        await peers.send("detokenizer/0", P.TextOut(key=P.RequestKey(rid="wrong inbox")))
    assert (await asyncio.wait_for(inboxes["detokenizer/0"].recv(), 5))[0].key.rid == "a"
    assert (await asyncio.wait_for(inboxes["detokenizer/1"].recv(), 5))[0].key.rid == "b"
    peers.forget("detokenizer/1")
    peers.close()
    for box in inboxes.values():
        box.close()


def test_address_for():
    assert address_for("engine", 2, "process") == "inproc://glmrt-engine-2"
    assert address_for("prefill", 1, "host", "/tmp/glmrt-42") == "ipc:///tmp/glmrt-42/pre1"
    assert address_for("decode", 0, "remote", host="10.0.0.5", port=5555) == "tcp://10.0.0.5:5555"
    with pytest.raises(ValueError, match="longer"):
        address_for("engine", 0, "host", "/tmp/" + "x" * 120)
    with pytest.raises(ValueError, match="run directory"):
        address_for("engine", 0, "host")
    with pytest.raises(ValueError, match="placement"):
        address_for("engine", 0, "gpu")
    default = make_run_dir()
    assert default.name.startswith(f"glmrt-{os.getpid()}-") and default.stat().st_mode & 0o777 == 0o700
    other = make_run_dir()
    assert other != default   # a fresh directory each time: none another user made first
    default.rmdir()
    other.rmdir()


def test_a_run_directory_another_user_could_enter_is_refused(tmp_path):
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o777)
    open_dir.chmod(0o777)
    with pytest.raises(PermissionError, match="mode 0700 \\(found mode 777"):
        make_run_dir(open_dir)
    (tmp_path / "link").symlink_to(open_dir)
    with pytest.raises(PermissionError, match="a symbolic link"):
        make_run_dir(tmp_path / "link")
    assert make_run_dir(tmp_path / "new").stat().st_mode & 0o777 == 0o700
