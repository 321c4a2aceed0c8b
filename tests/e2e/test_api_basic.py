"""E2E: the OpenAI surface of a default-topology deployment (tokenizer, engine, detokenizer;
one each), started once for the module with `--context-length 1024`."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.e2e.conftest import has_metric, libs_mapped, metric_sum

pytestmark = pytest.mark.slow

CONTEXT = 1024
USER = [{"role": "user", "content": "Tell me about the weather in Paris."}]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def dep(start_deployment):
    d = start_deployment(["--context-length", str(CONTEXT)], name="api-basic")
    yield d
    d.stop(term_wait=5)


@pytest.fixture(scope="module")
def client(dep):
    c = dep.client()
    yield c
    c.close()


@pytest.fixture(scope="module")
def model(dep):
    return dep.model_id()


def _extra(obj, name):
    """A field the openai types do not declare (reasoning_content, token_ids, ...)."""
    v = getattr(obj, name, None)
    if v is None and getattr(obj, "model_extra", None):
        v = obj.model_extra.get(name)
    return v


def _error_json(raw: bytes) -> dict:
    body = json.loads(raw)
    assert set(body) == {"error"}, body
    err = body["error"]
    assert {"message", "type", "param", "code"} <= set(err), err
    assert isinstance(err["message"], str) and err["message"]
    return err


# ---- health and models -----------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_health_and_models(dep, client):
    status, _, raw = dep.get("/health")
    assert status == 200, raw
    assert json.loads(raw)["status"] == "ok"
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert ids == ["tiny"], ids  # served name: the checkpoint directory's name
    assert models.data[0].object == "model"
    assert _extra(models.data[0], "max_model_len") == CONTEXT


# ---- chat ----------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_chat_non_streamed_usage(client, model):
    r = client.chat.completions.create(model=model, messages=USER, max_tokens=12, **GREEDY)
    assert r.object == "chat.completion"
    assert r.id.startswith("chatcmpl-")
    assert len(r.choices) == 1
    ch = r.choices[0]
    assert ch.index == 0 and ch.message.role == "assistant"
    assert ch.finish_reason == "length"
    assert ch.message.content or _extra(ch.message, "reasoning_content")
    u = r.usage
    assert u.completion_tokens == 12
    assert u.prompt_tokens > 0
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details is not None and 0 <= u.prompt_tokens_details.cached_tokens <= u.prompt_tokens


@pytest.mark.timeout(60)
def test_chat_streamed_equals_non_streamed(client, model):
    msgs = [{"role": "user", "content": "Stream or not, the same greedy tokens."}]
    full = client.chat.completions.create(model=model, messages=msgs, max_tokens=12, **GREEDY)
    stream = client.chat.completions.create(model=model, messages=msgs, max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    assert chunks, "empty stream"
    content, reasoning, finish = [], [], []
    for c in chunks[:-1]:
        assert c.object == "chat.completion.chunk" and c.id == chunks[0].id
        assert c.usage is None  # usage only on the final chunk
        for ch in c.choices:
            if ch.delta.content:
                content.append(ch.delta.content)
            if _extra(ch.delta, "reasoning_content"):
                reasoning.append(_extra(ch.delta, "reasoning_content"))
            if ch.finish_reason:
                finish.append(ch.finish_reason)
    last = chunks[-1]
    assert last.choices == [], "the usage chunk has no choices"
    assert last.usage is not None
    assert last.usage.completion_tokens == 12 == full.usage.completion_tokens
    assert last.usage.prompt_tokens == full.usage.prompt_tokens
    assert last.usage.total_tokens == last.usage.prompt_tokens + 12
    assert finish == ["length"]
    msg = full.choices[0].message
    assert "".join(content) == (msg.content or "")
    assert "".join(reasoning) == (_extra(msg, "reasoning_content") or "")


@pytest.mark.timeout(60)
def test_chat_n3_with_seed(client, model):
    kw = dict(model=model, messages=USER, max_tokens=8, n=3, seed=1234, temperature=1.0,
              extra_body={"ignore_eos": True, "chat_template_kwargs": {"thinking": False}})
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in a.choices)
    assert a.usage.completion_tokens == 3 * 8
    texts_a = [c.message.content for c in sorted(a.choices, key=lambda c: c.index)]
    texts_b = [c.message.content for c in sorted(b.choices, key=lambda c: c.index)]
    assert texts_a == texts_b, "the same seed must give the same choices"
    one = client.chat.completions.create(**{**kw, "n": 1})
    assert a.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once
    assert len(set(texts_a)) > 1, f"the n choices of a sampled request should differ: {texts_a}"


@pytest.mark.timeout(60)
def test_chat_thinking_off_gives_content_and_default_gives_reasoning(client, model):
    msgs = [{"role": "user", "content": "Think about it."}]
    off = client.chat.completions.create(model=model, messages=msgs, max_tokens=10, temperature=0,
                                         extra_body={"ignore_eos": True, "chat_template_kwargs": {"thinking": False}})
    m = off.choices[0].message
    assert m.content, m
    assert _extra(m, "reasoning_content") is None
    on = client.chat.completions.create(model=model, messages=msgs, max_tokens=10, **GREEDY)
    m = on.choices[0].message
    assert on.choices[0].finish_reason == "length"
    assert _extra(m, "reasoning_content"), m  # cut by length inside the think block: all reasoning
    assert not m.content


@pytest.mark.timeout(60)
def test_chat_return_token_ids(client, model):
    r = client.chat.completions.create(model=model, messages=USER, max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    ids = _extra(r.choices[0], "token_ids")
    assert isinstance(ids, list) and len(ids) == 6 and all(isinstance(t, int) for t in ids)
    prompt_ids = _extra(r, "prompt_token_ids")
    assert isinstance(prompt_ids, list) and len(prompt_ids) == r.usage.prompt_tokens


@pytest.mark.timeout(60)
def test_tools_auto_accepted_required_rejected(client, model):
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model=model, messages=msgs, tools=TOOLS, tool_choice="auto", max_tokens=8,
                                       **GREEDY)
    assert r.choices[0].finish_reason in ("length", "tool_calls", "stop")
    assert r.usage.completion_tokens <= 8
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=model, messages=msgs, tools=TOOLS, tool_choice="required",
                                       max_tokens=8)
    e = ei.value
    assert e.status_code == 400
    assert "not supported yet" in e.message
    assert e.param == "tool_choice"


@pytest.mark.timeout(60)
def test_prefix_cache_repeated_and_multi_turn(client, model):
    msgs = [{"role": "system", "content": "You are a terse assistant for cache tests."},
            {"role": "user", "content": "First turn: say something about prefix caches."}]
    kw = dict(model=model, max_tokens=8, temperature=0,
              extra_body={"ignore_eos": True, "chat_template_kwargs": {"thinking": False}})
    first = client.chat.completions.create(messages=msgs, **kw)
    again = client.chat.completions.create(messages=msgs, **kw)
    assert again.usage.prompt_tokens == first.usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    turn2 = msgs + [{"role": "assistant", "content": first.choices[0].message.content},
                    {"role": "user", "content": "Second turn: and now?"}]
    r2 = client.chat.completions.create(messages=turn2, **kw)
    assert r2.usage.prompt_tokens > first.usage.prompt_tokens
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < r2.usage.prompt_tokens


@pytest.mark.timeout(60)
def test_chat_streamed_n2_usage_and_logprobs(client, model):
    base = client.chat.completions.create(model=model, messages=USER, max_tokens=5, **GREEDY)
    s = client.chat.completions.create(model=model, messages=USER, max_tokens=5, n=2, seed=7, temperature=0.9,
                                       stream=True, stream_options={"include_usage": True}, logprobs=True,
                                       top_logprobs=2, extra_body={"ignore_eos": True})
    roles, finishes, lps = {}, {}, {0: 0, 1: 0}
    usage = None
    for c in s:
        if c.usage is not None:
            usage = c.usage
        for ch in c.choices:
            if ch.delta.role:
                roles[ch.index] = ch.delta.role
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
            if ch.logprobs and ch.logprobs.content:
                for e in ch.logprobs.content:
                    assert e.logprob <= 0 and 1 <= len(e.top_logprobs) <= 2
                lps[ch.index] += len(ch.logprobs.content)
    assert roles == {0: "assistant", 1: "assistant"}
    assert finishes == {0: "length", 1: "length"}
    assert lps == {0: 5, 1: 5}
    assert usage is not None
    assert usage.completion_tokens == 2 * 5
    assert usage.prompt_tokens == base.usage.prompt_tokens  # the prompt counts once for n choices


@pytest.mark.timeout(60)
def test_chat_non_streamed_logprobs(client, model):
    r = client.chat.completions.create(model=model, messages=USER, max_tokens=4, logprobs=True, top_logprobs=3,
                                       **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for e in content:
        assert isinstance(e.token, str) and e.logprob <= 0
        assert 1 <= len(e.top_logprobs) <= 3
        assert e.logprob >= max(t.logprob for t in e.top_logprobs) - 1e-4  # greedy


# ---- completions ---------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_completion_text_prompt(client, model):
    r = client.completions.create(model=model, prompt="Once upon a time", max_tokens=7, **GREEDY)
    assert r.object == "text_completion"
    assert len(r.choices) == 1 and r.choices[0].index == 0
    assert isinstance(r.choices[0].text, str)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 7 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7


@pytest.mark.timeout(60)
def test_completion_token_id_prompt_and_return_token_ids(client, model):
    ids = [11, 22, 33, 44, 55, 66, 77, 88, 99]
    r = client.completions.create(model=model, prompt=ids, max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == 5
    ch = r.choices[0]
    out_ids = _extra(ch, "token_ids")
    assert isinstance(out_ids, list) and len(out_ids) == 5
    assert _extra(ch, "prompt_token_ids") == ids
    # greedy and deterministic: the same request again gives the same tokens
    r2 = client.completions.create(model=model, prompt=ids, max_tokens=5, temperature=0,
                                   extra_body={"ignore_eos": True, "return_token_ids": True})
    assert _extra(r2.choices[0], "token_ids") == out_ids


@pytest.mark.timeout(60)
def test_completion_list_of_prompts(client, model):
    prompts = ["The first prompt", "A second, longer prompt than the first", "Third"]
    r = client.completions.create(model=model, prompt=prompts, max_tokens=4, **GREEDY)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 3 * 4
    # each prompt alone: the prompt tokens add up, and choice i belongs to prompt i
    singles = [client.completions.create(model=model, prompt=p, max_tokens=4, **GREEDY) for p in prompts]
    assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    by_index = {c.index: c.text for c in r.choices}
    assert [by_index[i] for i in range(3)] == [s.choices[0].text for s in singles]


@pytest.mark.timeout(60)
def test_completion_streamed_equals_non_streamed_and_usage(client, model):
    prompts = ["Streaming one", "Streaming two, a little longer"]
    full = client.completions.create(model=model, prompt=prompts, max_tokens=6, **GREEDY)
    s = client.completions.create(model=model, prompt=prompts, max_tokens=6, stream=True,
                                  stream_options={"include_usage": True}, **GREEDY)
    texts = {0: "", 1: ""}
    usage = None
    finishes = {}
    for c in s:
        if c.usage is not None:
            usage = c.usage
        for ch in c.choices:
            texts[ch.index] += ch.text
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
    assert finishes == {0: "length", 1: "length"}
    assert texts == {c.index: c.text for c in full.choices}
    assert usage is not None
    assert usage.completion_tokens == 12 == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


@pytest.mark.timeout(60)
def test_completion_stop_string(client, model):
    ids = [101, 202, 303, 404, 505]
    kw = dict(model=model, prompt=ids, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    # a stop string from the middle of the greedy text (clean characters only)
    cut = None
    for k in range(3, len(full) - 2):
        piece = full[k:k + 2]
        if piece.isprintable() and "\ufffd" not in full[:k + 2] and "<" not in piece and ">" not in piece:
            cut = piece
            break
    if cut is None:
        pytest.skip(f"no clean stop string in the greedy text {full!r}")
    r = client.completions.create(stop=[cut], **kw)
    ch = r.choices[0]
    assert ch.finish_reason == "stop"
    assert ch.text == full[:full.index(cut)]
    assert r.usage.completion_tokens < 24


@pytest.mark.timeout(60)
def test_completion_logprobs_shapes(client, model):
    r = client.completions.create(model=model, prompt="Logprobs please", max_tokens=5, logprobs=2, **GREEDY)
    lp = r.choices[0].logprobs
    assert lp is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(isinstance(t, str) for t in lp.tokens)
    assert all(x <= 0.0 for x in lp.token_logprobs)
    for top in lp.top_logprobs:
        assert 1 <= len(top) <= 2 and all(v <= 0.0 for v in top.values())
    assert lp.text_offset == sorted(lp.text_offset)
    # greedy: the chosen token has the best logprob of its step
    for tok_lp, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert tok_lp >= max(top.values()) - 1e-4


# ---- errors --------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_error_malformed_json(dep):
    status, headers, raw = dep.post("/v1/chat/completions", b'{"messages": [', headers={})
    assert status == 400
    assert headers.get("Content-Type", "").startswith("application/json")
    err = _error_json(raw)
    assert err["type"] == "invalid_request_error"


@pytest.mark.timeout(60)
def test_error_bad_field_type_names_param(dep):
    status, _, raw = dep.post("/v1/chat/completions", {"messages": USER, "temperature": "hot"})
    assert status == 400
    err = _error_json(raw)
    assert err["param"] == "temperature"
    assert "temperature" in err["message"]
    status, _, raw = dep.post("/v1/completions", {"prompt": "x", "max_tokens": "many"})
    assert status == 400
    assert _error_json(raw)["param"] == "max_tokens"


@pytest.mark.timeout(60)
def test_error_unknown_model_404(client):
    with pytest.raises(openai.NotFoundError) as ei:
        client.chat.completions.create(model="no-such-model", messages=USER, max_tokens=2)
    assert ei.value.status_code == 404
    assert ei.value.code == "model_not_found"
    assert ei.value.param == "model"


@pytest.mark.timeout(60)
def test_error_unknown_route_is_json(dep):
    status, _, raw = dep.get("/v1/no-such-route")
    assert status == 404
    _error_json(raw)


@pytest.mark.timeout(60)
def test_error_prompt_beyond_context_completions(dep):
    ids = [(7 * i) % 900 + 1 for i in range(CONTEXT + 50)]
    status, headers, raw = dep.post("/v1/completions", {"prompt": ids, "max_tokens": 4})
    assert status == 400, raw[:300]
    assert headers.get("Content-Type", "").startswith("application/json")
    err = _error_json(raw)
    assert err["type"] == "invalid_request_error"
    assert err["code"] == "context_length_exceeded", err


@pytest.mark.timeout(60)
def test_error_prompt_beyond_context_chat(client, model):
    words = " ".join(f"w{i}" for i in range(CONTEXT))
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": words}], max_tokens=4)
    assert ei.value.status_code == 400
    assert ei.value.code == "context_length_exceeded", ei.value.body


@pytest.mark.timeout(90)
def test_error_body_too_large_413_json(dep):
    big = b'{"messages": "' + b"a" * (33 * 2**20) + b'"}'
    r = httpx.post(dep.url + "/v1/chat/completions", content=big, headers={"Content-Type": "application/json"},
                   timeout=60)
    assert r.status_code == 413
    assert r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["code"] == "request_too_large"

    def chunked():  # no Content-Length: the limit is hit while reading
        for _ in range(33):
            yield b"a" * 2**20
        yield b"aa"

    r = httpx.post(dep.url + "/v1/completions", content=chunked(), headers={"Content-Type": "application/json"},
                   timeout=60)
    assert r.status_code == 413
    assert r.headers["content-type"].startswith("application/json"), r.text[:200]
    assert r.json()["error"]["code"] == "request_too_large"


@pytest.mark.timeout(60)
def test_still_serving_after_errors(dep, client, model):
    status, _, _ = dep.get("/health")
    assert status == 200
    r = client.chat.completions.create(model=model, messages=USER, max_tokens=4, **GREEDY)
    assert r.usage.completion_tokens == 4
    r = client.completions.create(model=model, prompt="still alive", max_tokens=3, **GREEDY)
    assert r.usage.completion_tokens == 3


# ---- observability -------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_metrics_names_and_movement(dep, client, model):
    before = dep.metrics()
    msgs = [{"role": "user", "content": "metrics: a prompt seen twice"}]
    for _ in range(2):
        client.chat.completions.create(model=model, messages=msgs, max_tokens=5, **GREEDY)
    time.sleep(1.5)  # one EngineStats period
    after = dep.metrics()

    def moved(name, **labels):
        return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)

    assert moved("glmrt_time_to_first_token_seconds_count") >= 2
    assert moved("glmrt_requests_total", status="success") >= 2
    assert moved("glmrt_prompt_tokens_total") > 0
    assert moved("glmrt_cached_prompt_tokens_total") > 0
    assert moved("glmrt_generation_tokens_total") >= 10
    for state in ("free", "cached", "in_use"):
        assert has_metric(after, "glmrt_kv_pool_tokens", state=state), state
    for state in ("free", "checkpoint", "in_use"):
        assert has_metric(after, "glmrt_state_pool_slots", state=state), state
    assert has_metric(after, "glmrt_running_requests")
    assert metric_sum(after, "glmrt_max_running_requests") > 0
    assert metric_sum(after, "glmrt_kv_pool_tokens", state="free") > 0
    assert metric_sum(after, "glmrt_state_pool_slots", state="free") > 0
    info = dep.get_json("/server_info")
    eng = next(iter(info["engines"].values()))
    total = sum(metric_sum(after, "glmrt_kv_pool_tokens", state=s) for s in ("free", "cached", "in_use"))
    assert total == eng["kv_pool_tokens"]


@pytest.mark.timeout(60)
def test_metrics_idle_pools_hold_nothing_in_use(dep, client, model):
    """With no request running, no KV token and no state slot is 'in_use' (cache-held memory is
    'cached' / 'checkpoint')."""
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "idle pools"}],
                                   max_tokens=5, **GREEDY)
    deadline = time.monotonic() + 5
    while True:
        m = dep.metrics()
        if metric_sum(m, "glmrt_running_requests") == 0 and metric_sum(m, "glmrt_api_inflight_requests") == 0:
            break
        assert time.monotonic() < deadline, "requests still running"
        time.sleep(0.3)
    time.sleep(1.2)
    m = dep.metrics()
    assert metric_sum(m, "glmrt_state_pool_slots", state="in_use") == 0
    assert metric_sum(m, "glmrt_kv_pool_tokens", state="in_use") == 0, (
        "idle engine reports KV tokens in use: "
        f"{ {s: metric_sum(m, 'glmrt_kv_pool_tokens', state=s) for s in ('free', 'cached', 'in_use')} }")


@pytest.mark.timeout(30)
def test_server_info(dep):
    info = dep.get_json("/server_info")
    assert info["model"] == "tiny"
    assert info["context_length"] == CONTEXT
    assert len(info["engines"]) == 1
    eng = next(iter(info["engines"].values()))
    for key in ("kv_pool_tokens", "kv_pool_pages", "state_pool_slots", "max_running_requests", "page_size"):
        assert isinstance(eng[key], (int, float)) and eng[key] > 0, (key, eng)
    assert eng["kv_pool_tokens"] == eng["kv_pool_pages"] * eng["page_size"]
    deadline = time.monotonic() + 5  # the gauge appears with the engine's first stats (1 s period)
    while not has_metric(m := dep.metrics(), "glmrt_max_running_requests"):
        assert time.monotonic() < deadline, "no glmrt_max_running_requests sample"
        time.sleep(0.2)
    assert eng["max_running_requests"] == metric_sum(m, "glmrt_max_running_requests")


@pytest.mark.timeout(30)
def test_server_info_sizes_are_integers(dep):
    """Pool sizes and counts are JSON integers (339584, not 339584.0), before and after the
    engine's periodic stats have been merged in."""
    time.sleep(1.2)  # at least one EngineStats period
    eng = next(iter(dep.get_json("/server_info")["engines"].values()))
    keys = ("kv_pool_tokens", "kv_pool_pages", "state_pool_slots", "max_running_requests", "page_size",
            "context_length", "pages_free", "slots_free", "running", "waiting")
    floats = {k: eng[k] for k in keys if k in eng and not isinstance(eng[k], int)}
    assert not floats, f"integer fields rendered as floats: {floats}"


# ---- client disconnect ---------------------------------------------------------------------


def _wait_idle(dep, timeout: float) -> float:
    t0 = time.monotonic()
    while True:
        m = dep.metrics()
        eng = dep.actors("engine")
        if (metric_sum(m, "glmrt_running_requests") == 0 and metric_sum(m, "glmrt_api_inflight_requests") == 0
                and all(a["running"] == 0 and a["waiting"] == 0 for a in eng)):
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"the request was not aborted within {timeout} s: running="
                        f"{metric_sum(m, 'glmrt_running_requests')}, api inflight="
                        f"{metric_sum(m, 'glmrt_api_inflight_requests')}, engines={eng}")
        time.sleep(0.2)


@pytest.mark.timeout(90)
def test_client_disconnect_aborts_request(dep, client, model):
    _wait_idle(dep, 10)
    body = {"model": model, "messages": [{"role": "user", "content": "a very long answer please"}],
            "max_tokens": 900, "temperature": 0, "ignore_eos": True, "stream": True}
    got = 0
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", dep.url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    got += 1
                    if got >= 2:
                        break
    assert got == 2
    # it would run ~900 decode steps (tens of seconds here) if it were not aborted
    took = _wait_idle(dep, 6)
    assert took < 6
    r = client.chat.completions.create(model=model, messages=USER, max_tokens=4, **GREEDY)
    assert r.usage.completion_tokens == 4


@pytest.mark.timeout(90)
def test_openai_client_stream_close_aborts_request(dep, client, model):
    _wait_idle(dep, 10)
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "long again"}],
                                            max_tokens=900, stream=True, **GREEDY)
    it = iter(stream)
    next(it)
    next(it)
    stream.close()
    _wait_idle(dep, 6)
    r = client.completions.create(model=model, prompt="after the disconnect", max_tokens=3, **GREEDY)
    assert r.usage.completion_tokens == 3


# ---- process hygiene -----------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_torch_only_in_engine_processes(dep):
    r = dep.cli("status", "--json")
    assert r.returncode == 0, r.stderr
    actors = json.loads(r.stdout)["actors"]
    kinds = {a["kind"] for a in actors}
    assert kinds == {"tokenizer", "engine", "detokenizer"}, actors
    assert not libs_mapped(dep.proc.pid), "`glmrt up` (supervisor + api) loaded torch"
    for a in actors:
        assert a["pid"], a
        if a["kind"] == "engine":
            assert libs_mapped(a["pid"]), f"engine pid {a['pid']} has no libtorch mapped"
        else:
            assert not libs_mapped(a["pid"]), f"{a['kind']}/{a['replica']} (pid {a['pid']}) loaded torch"


@pytest.mark.timeout(90)
def test_non_streamed_client_disconnect_aborts_request(dep, client, model):
    """A non-streamed request whose client goes away (here: a client-side timeout) is aborted
    too, not decoded to its end for nobody. Last in the module: when it fails, the orphan
    request runs on (a few seconds) and the deployment is torn down right after."""
    _wait_idle(dep, 10)
    body = {"model": model, "prompt": "nobody will read this", "max_tokens": 200, "temperature": 0,
            "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(dep.url + "/v1/completions", json=body, timeout=1.0)
    took = _wait_idle(dep, 3)  # its natural end is ~200 decode steps (several seconds) away
    assert took < 3
