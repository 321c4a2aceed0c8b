"""Every SamplingParams field, set by a client, reaches the engine's sampler unchanged.

The hops are the real ones: the api parses the JSON body into SamplingParams and builds the
TokenizeRequest; the wire codec of each inbox carries it; the tokenizer actor (on the tiny
checkpoint's tokenizer) sends the EngineRequest and the DetokenizeRequest; the engine actor
adds the request to a real Engine, whose Sampler is watched as it samples. The table below
must name every field, so a new field fails here until it is set by a client and seen by the
sampler (or, for the detokenizer's fields, seen by the detokenizer).
"""

from __future__ import annotations

import json


from actors.base import codec_for
from glmrt.actor_config import EngineActorConfig, TokenizerActorConfig
from glmrt.config import load_model_config
from glmrt.engine.config import EngineConfig
from glmrt import protocol as P
from glmrt.sampling_params import SamplingParams
from glmrt.serving import openai_api as A
from tests.actors.conftest import run_spec
from tests.serving.openai_cases import MODEL, USER

# a value other than the default for each field (all valid together)
NON_DEFAULT = {
    "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.01, "frequency_penalty": 0.25,
    "presence_penalty": -0.5, "repetition_penalty": 1.2, "seed": 11, "stop_token_ids": [3, 4],
    "ignore_eos": True, "max_tokens": 3, "min_tokens": 2, "logprobs": True, "top_logprobs": 2, "n": 2,
    "stop": ["zz"], "include_stop_str_in_output": True, "skip_special_tokens": False, "max_thinking_tokens": 4,
}


def test_the_table_names_every_field():
    defaults = SamplingParams()
    assert set(NON_DEFAULT) == set(SamplingParams.__struct_fields__)
    for name, value in NON_DEFAULT.items():
        assert getattr(defaults, name) != value, name
    SamplingParams(**NON_DEFAULT).validate()


def _diff(seen: SamplingParams, want: SamplingParams, names) -> list[str]:
    return [f"{n}: {getattr(seen, n)!r} != {getattr(want, n)!r}" for n in names if getattr(seen, n) != getattr(want, n)]


def _through(codec_owner: str, msg):
    codec = codec_for(codec_owner)
    back, _ = codec.decode([bytes(f) for f in codec.encode(msg)])
    return back


def test_body_fields_parse_into_sampling_params():
    """Every field a client can send, include_stop_str_in_output and skip_special_tokens too
    (vLLM's and SGLang's extras), reaches SamplingParams."""
    req = A.parse_chat_request(json.dumps({"model": MODEL, "messages": USER, **NON_DEFAULT}), MODEL)
    params = A.to_sampling_params(req)
    assert _diff(params, SamplingParams(**NON_DEFAULT), NON_DEFAULT) == []


async def test_every_field_reaches_the_sampler(ckpt, tmp_path, monkeypatch):
    from actors.engine import EngineActor
    from actors.tokenizer import TokenizerActor
    from glmrt.engine.sampler import Sampler

    req = A.parse_chat_request(json.dumps({"model": MODEL, "messages": USER, **NON_DEFAULT}), MODEL)
    params = A.to_sampling_params(req)
    want = SamplingParams(**NON_DEFAULT)
    assert params == want
    (tokenize,) = A.to_tokenize_requests(req, "chatcmpl-flow", "detokenizer/0", sampling=params)
    tokenize.engine = "engine/0"

    vocab_size = load_model_config(ckpt).text.vocab_size
    tokenizer = TokenizerActor(run_spec("tokenizer", tmp_path, TokenizerActorConfig(model_path=ckpt, vocab_size=vocab_size)))
    await tokenizer.setup()
    sent: dict[str, list] = {}

    async def capture(peer_id, msg, tensors=()):
        sent.setdefault(peer_id, []).append(_through(peer_id, msg))
    monkeypatch.setattr(tokenizer, "send", capture)
    await tokenizer.handle(_through("tokenizer/0", tokenize), [])
    await tokenizer.run_queued()  # what the actor's worker does with its queue
    (detok_req,) = sent["detokenizer/0"]
    (engine_req,) = sent["engine/0"]
    assert _diff(detok_req.sampling, want, NON_DEFAULT) == [], "tokenizer -> detokenizer"
    assert _diff(engine_req.sampling, want, NON_DEFAULT) == [], "tokenizer -> engine"

    seen: list[SamplingParams] = []
    for name in ("sample", "sample_async"):
        original = getattr(Sampler, name)

        def watch(self, logits, rows, _original=original):
            seen.extend(r.params for r in rows)
            return _original(self, logits, rows)
        monkeypatch.setattr(Sampler, name, watch)

    engine = EngineActor(run_spec("engine", tmp_path, EngineActorConfig(
        engine=EngineConfig(model=ckpt, dtype="float32", page_size=8))))
    await engine.setup()
    try:
        await engine.handle(engine_req, [])
        batches = []
        for _ in range(20):
            errors, out = engine._step()
            assert errors == []
            batches += [item for _, items in out for item in items]
            if sum(t.finished for t in batches) == want.n:
                break
    finally:
        await engine.teardown()
    assert {t.key for t in batches} == {P.RequestKey(rid="chatcmpl-flow", choice=i) for i in range(want.n)}
    assert seen, "the sampler never ran"
    engine_fields = set(NON_DEFAULT) - {"seed"}  # choice i samples with seed + i
    for p in seen:
        assert _diff(p, want, engine_fields) == [], "engine -> sampler"
    assert sorted({p.seed for p in seen}) == [want.seed + i for i in range(want.n)]
    assert any(p == want for p in seen)  # choice 0 samples with the very values the client sent


async def test_a_request_the_tokenizer_fails_on_is_answered_not_dropped(ckpt, tmp_path, monkeypatch):
    """Content it cannot render (too deep for the renderer) is a 400; any other failure a 500: never
    silence, which would leave the client waiting."""
    import glmrt.serving.chat_template as chat_template
    from actors.tokenizer import TokenizerActor

    req = A.parse_chat_request(json.dumps({"model": MODEL, "messages": USER}), MODEL)
    (tokenize,) = A.to_tokenize_requests(req, "chatcmpl-fail", "detokenizer/0")
    vocab_size = load_model_config(ckpt).text.vocab_size
    tokenizer = TokenizerActor(run_spec("tokenizer", tmp_path, TokenizerActorConfig(model_path=ckpt, vocab_size=vocab_size)))
    await tokenizer.setup()
    sent: list = []

    async def capture(peer_id, msg, tensors=()):
        sent.append((peer_id, msg))
    monkeypatch.setattr(tokenizer, "send", capture)
    for raised, status in ((RecursionError("maximum recursion depth exceeded"), 400), (KeyError("x"), 500)):
        def render(*a, exc=raised, **k):
            raise exc
        monkeypatch.setattr(chat_template, "render_chat", render)
        sent.clear()
        await tokenizer.handle(_through("tokenizer/0", tokenize), [])
        await tokenizer.run_queued()
        ((peer, err),) = sent
        assert peer == "api/0" and isinstance(err, P.TokenizerError) and err.status == status, err
        assert err.key == tokenize.key
