"""The api's routing on a real Supervisor's actor table (no processes started): each kind's
ready replicas take requests in turn, and a dead actor fails only the requests routed through it."""

from __future__ import annotations

import asyncio

import pytest

from actors.api import ApiServer, Inflight
from actors.supervisor import ActorProc, Supervisor
from glmrt import protocol as P
from glmrt.topology import parse_topology


@pytest.fixture
def api(tmp_path):
    topo = parse_topology({"actors": [{"kind": "tokenizer", "replicas": 2}, {"kind": "engine"},
                                      {"kind": "detokenizer", "replicas": 2}]})
    sup = Supervisor(topo, str(tmp_path), "/models/m", vocab_size=512)
    for kind, n in (("tokenizer", 2), ("engine", 1), ("detokenizer", 2)):
        for i in range(n):
            sup.actors[f"{kind}/{i}"] = ActorProc(kind, i, [], state="ready")
    server = ApiServer(sup, served_model="m", host="127.0.0.1", port=0, api_key=None, max_request_mb=1,
                       max_queued_requests=16, generation_config={})
    yield server
    server.inbox.close()
    sup.inbox.close()
    sup.peers.close()


def test_every_replica_takes_its_turn(api):
    routes = [api._route() for _ in range(4)]
    assert [r[0] for r in routes] == ["tokenizer/0", "tokenizer/1", "tokenizer/0", "tokenizer/1"]
    assert [r[2] for r in routes] == ["detokenizer/0", "detokenizer/1", "detokenizer/0", "detokenizer/1"]


async def test_a_dead_detokenizer_fails_only_its_own_requests(api):
    queue: asyncio.Queue = asyncio.Queue()
    for i, detok in enumerate(("detokenizer/0", "detokenizer/1")):
        key = P.RequestKey(rid=f"r{i}")
        api.inflight[key] = Inflight(key, queue, "engine/0", "tokenizer/0", detok)
    api.fail_actor("detokenizer/1")
    assert queue.qsize() == 1 and "detokenizer/1 failed" in str(queue.get_nowait())
    api.fail_actor("engine/0")
    assert queue.qsize() == 2
