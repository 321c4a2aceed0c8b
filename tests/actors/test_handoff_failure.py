"""A handoff whose state write fails on any rank fails the request on both sides: a prefill and a
decode engine actor in this process (tp 1, the zmq transfer engines on 127.0.0.1), messages
carried between them by hand. Rank 0's write done but another rank's part failed, or rank 0's
own write unable to land (the decode's transfer engine is gone): the prefill tells the
decode (HandoffDone ok=False) and the detokenizer (a 503), neither waits past the timeout, and
neither side keeps a page or slot for the request."""

from __future__ import annotations

import asyncio
import time

from glmrt import protocol as P
from glmrt.actor_config import EngineActorConfig
from glmrt.engine.config import EngineConfig
from glmrt.engine.ranks import RankReport
from glmrt.sampling_params import SamplingParams
from tests.actors.conftest import run_spec


def _actor(kind: str, ckpt, run_dir):
    from actors.engine import EngineActor
    return EngineActor(run_spec(kind, run_dir, EngineActorConfig(
        engine=EngineConfig(model=ckpt, dtype="float32", page_size=8, role=kind))))


def _request(rid: str) -> P.EngineRequest:
    return P.EngineRequest(key=P.RequestKey(rid=rid), prompt_ids=list(range(5, 26)), detokenizer="detokenizer/0",
                           decode="decode/0", sampling=SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))


def _sent(actor, kind) -> list:
    errors, _ = actor._step()
    return [(dest, m) for dest, m in errors if isinstance(m, kind)]


def _nothing_held(actor) -> None:
    info = actor.engine.info()
    assert info["running"] == info["waiting"] == info["slots_live"] == 0, info
    assert info["pages_free"] + info["cached_pages"] + info["checkpoint_pages"] == info["kv_pool_pages"], info
    assert not actor.engine.handoffs and not actor.engine.imports and not actor._routes and not actor._moving


async def _until_accepted(prefill, decode, rid: str) -> P.HandoffAccept:
    await prefill.handle(_request(rid), [])
    for _ in range(10):
        offers = _sent(prefill, P.HandoffOffer)
        if offers:
            break
    ((dest, offer),) = offers
    assert dest == "decode/0"
    await decode.handle(offer, [])
    ((dest, accept),) = _sent(decode, P.HandoffAccept)
    assert dest == "prefill/0" and accept.ok, accept
    return accept


async def _failed_on_both_sides(prefill, decode, rid: str, why: str) -> None:
    await asyncio.gather(*prefill._transfer_tasks)
    errors, _ = prefill._step()
    (done,) = [m for d, m in errors if d == "decode/0"]
    (err,) = [m for d, m in errors if d == "detokenizer/0"]
    assert isinstance(done, P.HandoffDone) and not done.ok and why in done.reason, done
    assert isinstance(err, P.EngineError) and err.status == 503 and why in err.message, err
    await decode.handle(done, [])
    assert _sent(decode, P.Msg) == []
    _nothing_held(prefill)
    _nothing_held(decode)


async def test_a_write_failed_on_any_rank_fails_the_request_on_both_sides(ckpt, tmp_path, monkeypatch):
    import actors.engine_handoff as engine_handoff
    monkeypatch.setenv("GLMRT_KV_TRANSFER", "zmq")
    prefill, decode = _actor("prefill", ckpt, tmp_path), _actor("decode", ckpt, tmp_path)
    await prefill.setup()
    await decode.setup()
    try:
        # rank 0's write lands; another rank's part fails: the request still fails everywhere
        accept = await _until_accepted(prefill, decode, "a")
        await prefill.handle(accept, [])
        assert _sent(prefill, P.Msg) == []
        prefill._watch_transfers()
        (rid,) = prefill._moving
        moving = prefill._moving[rid]
        moving.parts += 1  # as if the engine had a rank 1, whose report comes now
        moving.rank_parts += 1
        assert prefill._pd_part(RankReport(rid, False, error="rank 1: peer gone"), rank_part=True) == []
        await _failed_on_both_sides(prefill, decode, "a", "rank 1: peer gone")

        # rank 0's own write cannot land (the decode's transfer engine is gone): it fails (the
        # connection drops, or at the latest the timeout ends it)
        monkeypatch.setattr(engine_handoff, "HANDOFF_TIMEOUT_S", 0.5)
        accept = await _until_accepted(prefill, decode, "b")
        decode.xfer.close()
        await prefill.handle(accept, [])
        t0 = time.monotonic()
        assert _sent(prefill, P.Msg) == []
        prefill._watch_transfers()
        await _failed_on_both_sides(prefill, decode, "b", "state transfer failed: ")
        assert time.monotonic() - t0 < 5
    finally:
        await prefill.teardown()
        await decode.teardown()
