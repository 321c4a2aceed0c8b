"""Requests the engine actor holds before they run: one whose abort overtook it is dropped (the
api aborts at the engine directly, while the request may still be one hop back at the tokenizer)
and the rest are served; one whose embeddings never come from a vision actor fails."""

from __future__ import annotations

import time

from glmrt import protocol as P
from glmrt.actor_config import EngineActorConfig
from glmrt.engine.config import EngineConfig
from glmrt.sampling_params import SamplingParams
from tests.actors.conftest import run_spec


def _request(rid: str) -> P.EngineRequest:
    return P.EngineRequest(key=P.RequestKey(rid=rid), prompt_ids=[5, 6, 7, 8, 9], detokenizer="detokenizer/0",
                           sampling=SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))


async def _run(engine, steps: int = 20) -> list[P.TokenOut]:
    outs = []
    for _ in range(steps):
        errors, batches = engine._step()
        assert errors == []
        outs += [t for _, items in batches for t in items]
        if not engine.engine.has_work():
            break
    return outs


async def test_an_abort_that_overtakes_its_request_drops_it(ckpt, tmp_path):
    from actors.engine import EngineActor

    engine = EngineActor(run_spec("engine", tmp_path, EngineActorConfig(
        engine=EngineConfig(model=ckpt, dtype="float32", page_size=8))))
    await engine.setup()
    try:
        await engine.handle(P.Abort(key=P.RequestKey(rid="gone")), [])
        await engine.handle(_request("gone"), [])
        await engine.handle(_request("kept"), [])
        outs = await _run(engine)
        assert {t.key.rid for t in outs} == {"kept"}
        assert sum(len(t.token_ids) for t in outs) == 4 and outs[-1].finished
        # a choice-only abort (a stop string in one choice) is never remembered for later
        await engine.handle(P.Abort(key=P.RequestKey(rid="later"), choice_only=True), [])
        await engine.handle(_request("later"), [])
        assert {t.key.rid for t in await _run(engine)} == {"later"}
        assert not engine._routes and not engine.busy()
    finally:
        await engine.teardown()


async def test_a_request_whose_embeddings_never_come_fails(ckpt, tmp_path, monkeypatch):
    import actors.engine as engine_actor
    from actors.engine import EngineActor

    engine = EngineActor(run_spec("engine", tmp_path, EngineActorConfig(
        engine=EngineConfig(model=ckpt, dtype="float32", page_size=8))))
    await engine.setup()
    sent = []

    async def capture(peer_id, msg, tensors=()):
        sent.append((peer_id, msg))
    monkeypatch.setattr(engine, "send", capture)
    try:
        item = P.MMItem(kind="image", grid_thw=[1, 2, 2], num_tokens=1)  # no pixels: a vision actor has them
        waiting = _request("img")
        waiting.mm_items = [item]
        await engine.handle(waiting, [])
        await engine._expire_vision(time.monotonic())
        assert sent == []  # still within the timeout
        monkeypatch.setattr(engine_actor, "VISION_TIMEOUT_S", 0.0)
        await engine._expire_vision(time.monotonic() + 1.0)
        ((peer, err),) = sent
        assert peer == "detokenizer/0" and isinstance(err, P.EngineError) and err.status == 503
        assert err.key == P.RequestKey(rid="img") and "embeddings" in err.message
        assert not engine._vision_wait and not engine._vision_since
    finally:
        await engine.teardown()
