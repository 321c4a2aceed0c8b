"""E2E: one engine of tp 2 over two "nodes" on 127.0.0.1 (two `glmrt up` processes, gloo on the
CPU): node 0 runs the deployment and rank 0, node 1 (`--node-rank 1`) runs rank 1 alone; they
meet at --dist-init-addr and the step inputs go on the CURVE link. The greedy tokens are one
rank's; node 1 killed with SIGKILL takes the engine down within 5 s (its held stream fails at
once), the supervisor restarts rank 0, which serves again once node 1 is back; rank 0 killed makes
node 1 exit with status 1 within 5 s; a node whose engine settings differ from rank 0's is refused
by name; node 0 stopping makes node 1 exit with status 0."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.e2e.conftest import Deployment, free_port, libs_mapped, process_alive
from tests.e2e.test_tensor_parallel import MAX_TOKENS, one_rank, prompts  # noqa: F401 (a fixture)

pytestmark = pytest.mark.slow

BOUND_S = 5.0
READY_S = 90.0


class Nodes:
    def __init__(self, start_deployment, e2e_tmp, e2e_env, tiny_checkpoint):
        self.flags = ["--model", tiny_checkpoint, "--tp-size", "2", "--dtype", "float32", "--nnodes", "2",
                      "--dist-init-addr", f"127.0.0.1:{free_port()}"]
        self.tmp, self.env = e2e_tmp, e2e_env
        self.starts = 0
        self.node1 = self.start_node1()  # first: its rank waits for rank 0's store
        self.node0 = start_deployment(self.flags, name="node0")

    def start_node1(self, *extra: str) -> Deployment:
        self.starts += 1
        d = Deployment([*self.flags, "--node-rank", "1", *extra], log_path=self.tmp / f"node1-{self.starts}.log",
                       env=self.env)
        return d.start()

    def engine(self) -> dict:
        (row,) = self.node0.actors("engine")
        return row

    def wait_engine(self, old_pid: int | None = None) -> dict:
        deadline = time.monotonic() + READY_S
        while time.monotonic() < deadline:
            row = self.engine()
            if row["state"] == "ready" and row["pid"] != old_pid and len(row["ranks"]) == 2:
                return row
            time.sleep(0.2)
        self.node0.fail(f"the engine was not ready with both ranks: {self.engine()}\n---- node 1 ----\n"
                        f"{self.node1.output()[-5000:]}")

    def tokens(self, prompt) -> list[int]:
        r = self.node0.client().completions.create(model=self.node0.model_id(), prompt=prompt, max_tokens=MAX_TOKENS,
                                                   temperature=0, extra_body={"ignore_eos": True,
                                                                              "return_token_ids": True})
        return r.choices[0].model_extra["token_ids"]


@pytest.fixture(scope="module")
def nodes(start_deployment, e2e_tmp, e2e_env, tiny_checkpoint):
    n = Nodes(start_deployment, e2e_tmp, e2e_env, tiny_checkpoint)
    yield n
    n.node0.stop(term_wait=10)
    n.node1.stop(term_wait=5)


def _gone_within(pids: list[int], bound: float) -> bool:
    deadline = time.monotonic() + bound
    while any(process_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(process_alive(p) for p in pids)


def _listening(pid: int) -> set[tuple[str, int]]:
    """(local address as /proc/net writes it, port) of every TCP socket `pid` listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = set()
    for table in ("tcp", "tcp6"):
        for line in open(f"/proc/{pid}/net/{table}", encoding="ascii").read().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                addr, port = cols[1].split(":")
                out.add((addr, int(port, 16)))
    return out


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


@pytest.mark.timeout(240)
def test_two_nodes_serve_one_ranks_greedy_tokens(nodes, one_rank):  # noqa: F811
    row = nodes.wait_engine()
    ranks = row["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and ranks[0]["pid"] == row["pid"]
    assert ranks[1]["node"] == 1 and _parent(ranks[1]["pid"]) == nodes.node1.proc.pid  # started by node 1
    assert not libs_mapped(nodes.node1.proc.pid)  # node 1's glmrt up, like node 0's, never imports torch
    # rank 0 listens on the named host only: the store on its port, the link, gloo; none on a wildcard
    listening = _listening(row["pid"])
    store_port = int(nodes.flags[nodes.flags.index("--dist-init-addr") + 1].rsplit(":", 1)[1])
    assert ("0100007F", store_port) in listening and len(listening) >= 3, listening
    assert {addr for addr, _ in listening} == {"0100007F"}, listening
    out = nodes.node0.cli("status")
    assert out.returncode == 0, out.stderr
    assert f"rank 1: pid {ranks[1]['pid']} on cpu of node 1 ({ranks[1]['host']})" in out.stdout, out.stdout
    for prompt, ref in zip(prompts(), one_rank):
        assert nodes.tokens(prompt) == ref.output_ids


@pytest.mark.timeout(120)
def test_a_peer_without_the_key_is_refused_and_logged(nodes, one_rank):  # noqa: F811
    import datetime

    import torch.distributed as dist
    import zmq

    host, port = nodes.flags[nodes.flags.index("--dist-init-addr") + 1].rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=10))
    addr = json.loads(bytes(store.get("glmrt-link/addr")))  # the store is open: the link is what is keyed
    ctx = zmq.Context()
    try:
        plain = ctx.socket(zmq.DEALER)
        plain.setsockopt(zmq.ROUTING_ID, b"rank1")  # posing as rank 1, without CURVE
        plain.connect(addr["plan"])
        plain.send_multipart([b"hello", b"{}"])
        deadline = time.monotonic() + BOUND_S
        while "refused a peer on the rank link" not in nodes.node0.output() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "refused a peer on the rank link" in nodes.node0.output(), nodes.node0.output()[-3000:]
        assert nodes.tokens(prompts()[1]) == one_rank[1].output_ids  # the ranks went on undisturbed
        assert not plain.poll(200)  # and none of their steps reached the stranger
    finally:
        ctx.destroy(linger=0)
    assert nodes.engine()["restarts"] == 0


def _held_stream(nodes, result: dict, started: threading.Event) -> None:
    body = {"model": nodes.node0.model_id(), "prompt": "a long story", "max_tokens": 3000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as h, h.stream("POST", nodes.node0.url + "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if "error" in event:
                    result.update(error=event["error"], t=time.monotonic())
                    return
                started.set()
    result.update(t=time.monotonic())


@pytest.mark.timeout(240)
def test_node_1_killed_fails_the_engine_fast_and_it_serves_again_with_node_1_back(nodes, one_rank):  # noqa: F811
    row = nodes.wait_engine()
    result, started = {}, threading.Event()
    t = threading.Thread(target=_held_stream, args=(nodes, result, started), daemon=True)
    t.start()
    assert started.wait(60), "the held stream did not start"
    killed = time.monotonic()
    os.kill(nodes.node1.proc.pid, signal.SIGKILL)  # node 1's glmrt up alone: its rank dies with it
    assert _gone_within([r["pid"] for r in row["ranks"]], BOUND_S), row["ranks"]
    t.join(BOUND_S)
    assert "error" in result and result["t"] - killed < BOUND_S, result
    assert result["error"]["code"] == "actor_failed", result
    status, _, raw = nodes.node0.post("/v1/completions", {"model": nodes.node0.model_id(), "prompt": "x",
                                                          "max_tokens": 2}, timeout=BOUND_S)
    assert status == 503, raw[:300]  # rank 0 waits for node 1: refused at once, not held
    nodes.node1.stop(term_wait=1)
    nodes.node1 = nodes.start_node1()
    new = nodes.wait_engine(old_pid=row["pid"])
    assert new["restarts"] == 1
    assert nodes.tokens(prompts()[0]) == one_rank[0].output_ids


@pytest.mark.timeout(240)
def test_node_1_exits_when_its_group_fails(nodes):
    row = nodes.wait_engine()
    os.kill(row["pid"], signal.SIGKILL)  # rank 0
    killed = time.monotonic()
    try:
        rc = nodes.node1.proc.wait(BOUND_S)
    except Exception:
        nodes.node1.fail("node 1 did not exit within 5 s of rank 0's death")
    assert rc == 1 and time.monotonic() - killed < BOUND_S
    assert _gone_within([row["ranks"][1]["pid"]], 1.0)
    assert "rank 0's connection closed; rank 1 exits" in nodes.node1.output()


@pytest.mark.timeout(240)
def test_a_node_started_with_other_settings_is_refused_by_name(nodes):
    deadline = time.monotonic() + READY_S
    while (before := nodes.engine())["state"] != "starting" and time.monotonic() < deadline:
        time.sleep(0.1)  # rank 0, restarted since the last test, waits at the store for a rank 1
    import zmq.auth
    _, key_file = zmq.auth.create_certificates(str(nodes.tmp), "node1-only")  # a key node 0 does not use
    public = zmq.auth.load_certificate(key_file)[0].decode()
    nodes.node1 = nodes.start_node1("--chunked-prefill-size", "512", "--curve-key-file", key_file)
    assert nodes.node1.proc.wait(60) == 2, nodes.node1.output()[-3000:]
    assert (f"rank 1 runs other engine settings than rank 0: chunked_prefill_size 512 (rank 0: 8192), "
            f"curve_key_file public key {public!r} (rank 0: None); every node must run glmrt up with the same "
            "topology and flags") in nodes.node1.output(), nodes.node1.output()[-3000:]
    after = nodes.engine()  # rank 0 was not disturbed: it still waits for a rank 1 of its settings
    assert (after["pid"], after["restarts"], after["state"]) == (before["pid"], before["restarts"], before["state"])


@pytest.mark.timeout(240)
def test_node_1_stops_with_node_0(nodes):
    nodes.node1.stop(term_wait=1)
    nodes.node1 = nodes.start_node1()
    row = nodes.wait_engine()
    nodes.node0.stop(term_wait=20)
    assert nodes.node0.proc.returncode == 0, nodes.node0.output()[-3000:]
    assert nodes.node1.proc.wait(10) == 0, nodes.node1.output()[-3000:]
    assert _gone_within([r["pid"] for r in row["ranks"]], 1.0)
