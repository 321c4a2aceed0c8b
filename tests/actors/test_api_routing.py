"""The api's routing on a real Supervisor's actor table (no processes started): each kind's
ready replicas take requests in turn; a dead engine fails only the requests routed through it,
a dead tokenizer's requests go to a live replica (or wait for the restarted one), and a
restarted detokenizer's requests are replayed to it by their engines."""

from __future__ import annotations

import asyncio

import pytest

from actors.api import ApiServer, Inflight
from actors.supervisor import ActorProc, Supervisor
from glmrt import protocol as P
from glmrt.sampling_params import SamplingParams
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


def test_each_prompt_of_a_request_counts_against_the_queue(api):
    """max_queued_requests 16: a completions request of 17 prompts could never be admitted (400); with
    10 engine requests in flight, 7 more wait for room (503), 6 fit."""
    from glmrt.serving.openai_api import APIError
    with pytest.raises(APIError) as e:
        api._route(17)
    assert e.value.status == 400 and "makes 17 engine requests" in e.value.message
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(10):
        _inflight(api, f"r{i}", "tokenizer/0", "detokenizer/0", queue)
    with pytest.raises(APIError) as e:
        api._route(7)
    assert e.value.status == 503
    api._route(6)


def _inflight(api, rid: str, tokenizer: str, detok: str, queue: asyncio.Queue) -> Inflight:
    key = P.RequestKey(rid=rid)
    tokenize = P.TokenizeRequest(key=key, kind="completion", sampling=SamplingParams(), reply_to=detok, prompt="x")
    st = api.inflight[key] = Inflight(key, queue, "engine/0", tokenizer, detok, tokenize=tokenize)
    return st


@pytest.fixture
def sent(api, monkeypatch):
    out: list[tuple[str, P.Msg]] = []

    async def capture(dest, msg, tensors=()):
        out.append((dest, msg))
    monkeypatch.setattr(api.peers, "send", capture)
    return out


async def test_a_detokenizer_given_up_on_fails_only_its_own_requests(api):
    queue: asyncio.Queue = asyncio.Queue()
    for i, detok in enumerate(("detokenizer/0", "detokenizer/1")):
        _inflight(api, f"r{i}", "tokenizer/0", detok, queue)
    api.sup.actors["detokenizer/1"].state = "failed"
    api.fail_actor("detokenizer/1")
    assert queue.qsize() == 1 and "detokenizer/1 failed" in str(queue.get_nowait())
    api.fail_actor("engine/0")
    assert queue.qsize() == 2


async def test_a_restarted_detokenizer_gets_its_requests_replayed(api, sent):
    queue: asyncio.Queue = asyncio.Queue()
    mine = _inflight(api, "mine", "tokenizer/0", "detokenizer/1", queue)
    _inflight(api, "other", "tokenizer/0", "detokenizer/0", queue)
    api._deliver(P.TextOut(key=P.RequestKey(rid="mine", choice=1), text="ab", token_ids=[3, 4]))
    api._deliver(P.TextOut(key=P.RequestKey(rid="mine", choice=1), token_ids=[5]))
    api.sup.actors["detokenizer/1"].state = "restarting"
    api.fail_actor("detokenizer/1")
    assert queue.qsize() == 2 and not any(isinstance(queue.get_nowait(), Exception) for _ in range(2))
    api.actor_restarted("detokenizer/1")
    await asyncio.sleep(0)
    (dest, replay), = sent
    assert dest == "engine/0" and replay.detokenizer == "detokenizer/1"
    assert [(p.key, p.received) for p in replay.progress] == [(mine.key, 0), (mine.key.with_choice(1), 3)]


async def test_a_dead_tokenizers_requests_go_to_a_live_replica(api, sent):
    queue: asyncio.Queue = asyncio.Queue()
    waiting = _inflight(api, "waiting", "tokenizer/1", "detokenizer/0", queue)
    streaming = _inflight(api, "streaming", "tokenizer/1", "detokenizer/0", queue)
    api._deliver(P.TextOut(key=streaming.key, text="a", token_ids=[3]))  # it was sent on already
    _inflight(api, "elsewhere", "tokenizer/0", "detokenizer/0", queue)
    api.sup.actors["tokenizer/1"].state = "restarting"
    api.fail_actor("tokenizer/1")
    await asyncio.sleep(0)
    assert sent == [("tokenizer/0", waiting.tokenize)] and waiting.tokenizer == "tokenizer/0"
    assert queue.qsize() == 1  # the TextOut only: nothing failed


async def test_with_no_live_tokenizer_the_requests_wait_for_the_restarted_one(api, sent):
    queue: asyncio.Queue = asyncio.Queue()
    st = _inflight(api, "r", "tokenizer/0", "detokenizer/0", queue)
    for i in (0, 1):
        api.sup.actors[f"tokenizer/{i}"].state = "restarting"
    api.fail_actor("tokenizer/0")
    await asyncio.sleep(0)
    assert sent == [] and queue.empty()
    api.sup.actors["tokenizer/0"].state = "ready"
    api.actor_restarted("tokenizer/0")
    await asyncio.sleep(0)
    assert sent == [("tokenizer/0", st.tokenize)]


@pytest.mark.timeout(30)
async def test_a_stream_that_fails_after_its_200_ends_with_an_error_event(api, sent, monkeypatch):
    """Once the 200 and the first chunk are out, a failure of the api's own code can no longer be a
    JSON error: the stream carries an SSE error event and [DONE] instead of breaking off."""
    from aiohttp.test_utils import TestClient, TestServer

    from glmrt.serving import openai_api as oa

    calls = []

    def on_text(self, item):
        calls.append(item)
        if len(calls) > 1:
            raise RuntimeError("a bug in the stream's chunking")
        return []
    monkeypatch.setattr(oa.CompletionStream, "on_text", on_text)
    async with TestClient(TestServer(api.app())) as client:
        post = asyncio.create_task(client.post("/v1/completions", json={"model": "m", "prompt": "x", "stream": True,
                                                                         "max_tokens": 4}))
        for _ in range(200):
            if api.inflight:
                break
            await asyncio.sleep(0.01)
        (st,) = api.inflight.values()
        key = st.key.with_choice(0)
        await st.queue.put(P.TextOut(key=key, text="a"))
        await st.queue.put(P.TextOut(key=key, text="b"))
        resp = await post
        assert resp.status == 200
        text = await resp.text()
    assert "internal error: RuntimeError" in text and text.rstrip().endswith("data: [DONE]"), text
    assert [d for d, m in sent if isinstance(m, P.TokenizeRequest)] == ["tokenizer/0"]
    assert any(isinstance(m, P.Abort) for _, m in sent)   # what the request held is let go everywhere
    assert not api.inflight


async def test_health_while_starting_names_states_not_processes(api):
    """/health answers without a key: while an actor is not ready it says which kind and replica
    and in what state, never pids, hosts or GPUs (those are /admin/status's, behind the key)."""
    import json
    import types

    api.sup.actors["engine/0"].proc = types.SimpleNamespace(pid=4242)
    api.sup.actors["engine/0"].state = "restarting"
    resp = await api.health(None)
    body = json.loads(resp.body)
    assert resp.status == 503 and body["status"] == "starting"
    assert {"kind": "engine", "replica": 0, "state": "restarting"} in body["actors"]
    assert all(set(a) == {"kind", "replica", "state"} for a in body["actors"])
    assert "4242" not in resp.body.decode()
    api.sup.actors["engine/0"].state = "ready"
    resp = await api.health(None)
    assert resp.status == 200 and json.loads(resp.body) == {"status": "ok"}
