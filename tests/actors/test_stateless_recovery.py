"""A dead tokenizer or detokenizer loses no request: the engine actor admits each request once and
replays what a restarted detokenizer lost; the detokenizer rebuilds a stream from that replay and
continues it without a gap or a repeated delta."""

from __future__ import annotations

from actors.request_ledger import RequestLedger
from glmrt import protocol as P
from glmrt.actor_config import DetokenizerActorConfig, EngineActorConfig
from glmrt.engine.config import EngineConfig
from glmrt.sampling_params import SamplingParams
from tests.actors.conftest import run_spec

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
# multi-byte characters split across byte-level tokens, a think block, a stop-string prefix
TEXT = "<think>je réfléchis, 日本語 ok</think>Voilà 🙂 — la ré ponse, pas de STO mais STOP ici"


def _request(rid: str, max_tokens: int = 4) -> P.EngineRequest:
    key = P.RequestKey(rid=rid)
    sampling = GREEDY.replace(max_tokens=max_tokens)
    return P.EngineRequest(key=key, prompt_ids=[5, 6, 7, 8, 9], detokenizer="detokenizer/0", sampling=sampling,
                           detokenize=P.DetokenizeRequest(key=key, sampling=sampling, prompt_tokens=5, stream=True))


def _step(engine) -> tuple[list, list[P.TokenOut]]:
    messages, batches = engine._step()
    return messages, [t for _, items in batches for t in items]


async def test_the_engine_runs_a_request_sent_twice_once_and_replays_what_it_holds(ckpt, tmp_path):
    from actors.engine import EngineActor

    engine = EngineActor(run_spec("engine", tmp_path, EngineActorConfig(
        engine=EngineConfig(model=ckpt, dtype="float32", page_size=8))))
    await engine.setup()
    try:
        await engine.handle(_request("twice"), [])
        await engine.handle(_request("twice"), [])  # re-sent by the api: the first copy got here
        outs = []
        for _ in range(10):
            outs += _step(engine)[1]
        assert sum(len(t.token_ids) for t in outs) == 4 and sum(t.finished for t in outs) == 1
        finished_ids = [tid for t in outs for tid in t.token_ids]
        await engine.handle(_request("twice"), [])  # a copy that comes after the request finished
        assert _step(engine)[1] == [] and not engine._routes

        await engine.handle(_request("live", max_tokens=8), [])
        live = []
        for _ in range(3):
            live += _step(engine)[1]
        progress = [P.ChoiceProgress(key=P.RequestKey(rid="live"), received=1),
                    P.ChoiceProgress(key=P.RequestKey(rid="twice"), received=2),
                    P.ChoiceProgress(key=P.RequestKey(rid="unknown"))]
        await engine.handle(P.ReplayRequest(detokenizer="detokenizer/0", progress=progress), [])
        messages, after = _step(engine)
        replays = {m.request.key.rid: m for dest, m in messages if isinstance(m, P.DetokenizeReplay)}
        assert set(replays) == {"live", "twice"} and all(d == "detokenizer/0" for d, _ in messages)
        (running,) = replays["live"].choices
        assert running.received == 1 and not running.tokens.finished and running.tokens.first_index == 0
        assert running.tokens.token_ids == [tid for t in live for tid in t.token_ids]
        assert after[0].first_index == len(running.tokens.token_ids)  # the stream goes on from there
        (done,) = replays["twice"].choices
        assert done.received == 2 and done.tokens.finished and done.tokens.finish_reason == "length"
        assert done.tokens.token_ids == finished_ids and done.tokens.completion_tokens == 4
    finally:
        await engine.teardown()


def test_the_ledger_forgets_an_ended_request_after_its_keep_time():
    ledger = RequestLedger(keep_s=0.0)
    key = P.RequestKey(rid="r")
    assert ledger.accept(key, None) and not ledger.accept(key, None)
    ledger.end(key)
    assert ledger.accept(key, None)  # kept 0 s: a later request of that id is new


async def _detokenizer(ckpt, tmp_path, monkeypatch):
    from actors.detokenizer import DetokenizerActor

    detok = DetokenizerActor(run_spec("detokenizer", tmp_path, DetokenizerActorConfig(model_path=ckpt)))
    await detok.setup()
    sent: list[P.TextOut] = []

    async def capture(peer_id, msg, tensors=()):
        if isinstance(msg, P.TextBatch):
            sent.extend(msg.items)
    monkeypatch.setattr(detok, "send", capture)
    return detok, sent


def _token(key: P.RequestKey, ids: list[int], i: int) -> P.TokenOut:
    last = i == len(ids) - 1
    return P.TokenOut(key=key, token_ids=[ids[i]], first_index=i, finished=last,
                      finish_reason="length" if last else None, completion_tokens=i + 1)


def _fields(outs: list[P.TextOut]) -> tuple[str, str, list[int]]:
    return "".join(o.text for o in outs), "".join(o.reasoning for o in outs), [t for o in outs for t in o.token_ids]


async def test_a_replayed_stream_continues_without_a_gap_or_a_repeat(ckpt, tmp_path, monkeypatch):
    detok, sent = await _detokenizer(ckpt, tmp_path, monkeypatch)
    ids = detok.tok.encode(TEXT, add_special_tokens=False).ids
    sampling = GREEDY.replace(max_tokens=len(ids), stop=["STOP"])

    def request(rid: str, stream: bool = True) -> P.DetokenizeRequest:
        return P.DetokenizeRequest(key=P.RequestKey(rid=rid), sampling=sampling, prompt_tokens=5, stream=stream,
                                   reasoning=True)

    await detok.handle(request("whole"), [])
    for i in range(len(ids)):
        await detok.handle(_token(P.RequestKey(rid="whole"), ids, i), [])
    whole = list(sent)
    assert whole[-1].finished and "STOP" not in _fields(whole)[0] and _fields(whole)[1]
    cut = len(_fields(whole)[2])  # the tokens up to the stop string
    for received in range(0, cut, 3):
        for produced in {received, min(cut, received + 2), cut}:
            rid = f"cut-{received}-{produced}"
            key = P.RequestKey(rid=rid)
            before = whole[:received]  # what the api had: one delta per token
            sent.clear()
            replay = P.DetokenizeReplay(request=request(rid), choices=[P.ReplayedChoice(
                tokens=P.TokenOut(key=key, token_ids=ids[:produced], first_index=0), received=received)])
            await detok.handle(_token(key, ids, max(0, produced - 1)), [])  # a stale copy that beat the replay
            await detok.handle(replay, [])
            await detok.handle(request(rid), [])  # a late copy of the first registration: ignored
            for i in range(produced, len(ids)):
                await detok.handle(_token(key, ids, i), [])
            assert _fields(before + sent) == _fields(whole), (received, produced)
            assert sum(o.finished for o in sent) == 1 and not detok.busy()


async def test_a_replayed_non_streamed_request_answers_once_with_the_whole_text(ckpt, tmp_path, monkeypatch):
    detok, sent = await _detokenizer(ckpt, tmp_path, monkeypatch)
    ids = detok.tok.encode(TEXT, add_special_tokens=False).ids[:12]
    answers = []
    for rid, replayed in (("undisturbed", 0), ("replayed", 5)):
        key = P.RequestKey(rid=rid)
        cfg = P.DetokenizeRequest(key=key, sampling=GREEDY.replace(max_tokens=12), prompt_tokens=5, reasoning=True)
        if replayed:
            await detok.handle(P.DetokenizeReplay(request=cfg, choices=[P.ReplayedChoice(
                tokens=P.TokenOut(key=key, token_ids=ids[:replayed], first_index=0))]), [])
        else:
            await detok.handle(cfg, [])
        for i in range(replayed, len(ids)):
            await detok.handle(_token(key, ids, i), [])
        (out,) = sent
        sent.clear()
        assert out.finished and out.token_ids == ids and out.reasoning
        answers.append((out.text, out.reasoning, out.finish_reason))
    assert answers[0] == answers[1]
