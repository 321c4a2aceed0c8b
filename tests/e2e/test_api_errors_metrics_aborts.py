"""E2E: error answers, metrics and server info, client disconnects and process hygiene of a
default-topology deployment (one actor each), started once for the module with
`--context-length 1024 --disable-log-requests`: no request logs a line."""

from __future__ import annotations

import json
import re
import time

import httpx
import openai
import pytest

from tests.e2e.api_cases import CONTEXT, GREEDY, USER, error_json, log_lines
from tests.e2e.api_cases import client, dep, model  # noqa: F401  (fixtures)
from tests.e2e.conftest import has_metric, libs_mapped, metric_sum

pytestmark = pytest.mark.slow
DEPLOY_FLAGS = ["--disable-log-requests"]


# ---- errors --------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_error_malformed_json(dep):
    status, headers, raw = dep.post("/v1/chat/completions", b'{"messages": [', headers={})
    assert status == 400
    assert headers.get("Content-Type", "").startswith("application/json")
    err = error_json(raw)
    assert err["type"] == "invalid_request_error"


@pytest.mark.timeout(60)
def test_error_bad_field_type_names_param(dep):
    status, _, raw = dep.post("/v1/chat/completions", {"messages": USER, "temperature": "hot"})
    assert status == 400
    err = error_json(raw)
    assert err["param"] == "temperature"
    assert "temperature" in err["message"]
    status, _, raw = dep.post("/v1/completions", {"prompt": "x", "max_tokens": "many"})
    assert status == 400
    assert error_json(raw)["param"] == "max_tokens"


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
    error_json(raw)


@pytest.mark.timeout(60)
def test_error_prompt_beyond_context_completions(dep):
    ids = [(7 * i) % 900 + 1 for i in range(CONTEXT + 50)]
    status, headers, raw = dep.post("/v1/completions", {"prompt": ids, "max_tokens": 4})
    assert status == 400, raw[:300]
    assert headers.get("Content-Type", "").startswith("application/json")
    err = error_json(raw)
    assert err["type"] == "invalid_request_error"
    assert err["code"] == "context_length_exceeded", err


@pytest.mark.timeout(60)
def test_error_prompt_beyond_context_chat(client, model):
    words = " ".join(f"w{i}" for i in range(CONTEXT))
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": words}], max_tokens=4)
    assert ei.value.status_code == 400
    assert ei.value.code == "context_length_exceeded", ei.value.body


def _context_refusal(err, prompt_part: str, completion: int) -> int:
    """Check OpenAI's / vLLM's shape of a max_tokens beyond the context; returns the prompt's tokens."""
    assert err.code == "context_length_exceeded", err.body
    m = re.fullmatch(rf"This model's maximum context length is {CONTEXT} tokens\. However, you requested (\d+) "
                     rf"tokens \((\d+) in the {prompt_part}, {completion} in the completion\)\. Please reduce the "
                     rf"length of the {prompt_part} or completion\.", err.body["message"])
    assert m, err.body["message"]
    assert int(m.group(1)) == int(m.group(2)) + completion
    return int(m.group(2))


# A prompt a few tokens short of the context: the largest max_tokens that fits then takes the
# request to the context's last position in a few decode steps rather than a thousand.
LONG_WORDS = " ".join(f"w{i}" for i in range(280))   # ~990 prompt tokens with the template


@pytest.mark.timeout(60)
@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_chat_max_tokens_beyond_the_context_is_400(client, model, field):
    for words in ("hi", LONG_WORDS):
        messages = [{"role": "user", "content": words}]
        for asked in (10**12, CONTEXT):   # far beyond, and the context itself (the prompt no longer fits)
            with pytest.raises(openai.BadRequestError) as ei:
                client.chat.completions.create(model=model, messages=messages, **{field: asked})
            assert ei.value.status_code == 400 and ei.value.param == "messages"
            prompt = _context_refusal(ei.value, "messages", asked)
    assert CONTEXT - 64 < prompt < CONTEXT - 1, prompt
    # the largest that fits is served (the engine stops at the context's end)
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=CONTEXT - prompt, **GREEDY)
    assert r.usage.prompt_tokens == prompt and r.usage.completion_tokens == CONTEXT - prompt


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [False, True])
def test_completions_max_tokens_beyond_the_context_is_400(client, model, stream):
    for ids in ([5, 6, 7, 8], [(7 * i) % 900 + 1 for i in range(CONTEXT - 6)]):
        with pytest.raises(openai.BadRequestError) as ei:
            client.completions.create(model=model, prompt=ids, max_tokens=CONTEXT - len(ids) + 1, stream=stream)
        assert ei.value.status_code == 400 and ei.value.param == "prompt"
        assert _context_refusal(ei.value, "prompt", CONTEXT - len(ids) + 1) == len(ids)
    # exactly the context: served to its end (the long prompt reaches it in a few steps)
    r = client.completions.create(model=model, prompt=ids, max_tokens=CONTEXT - len(ids), stream=stream,
                                  stream_options={"include_usage": True} if stream else None, **GREEDY)
    if stream:
        chunks = list(r)
        assert "".join(c.choices[0].text for c in chunks if c.choices)
        usage = chunks[-1].usage
    else:
        usage = r.usage
    assert usage.completion_tokens == CONTEXT - len(ids)


@pytest.mark.timeout(60)
def test_retrieve_model_and_unknown_model_404(client, model):
    m = client.models.retrieve(model)
    assert m.id == model and m.object == "model" and m.owned_by == "glmrt"
    assert m.model_dump() == client.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError) as ei:
        client.models.retrieve("no-such-model")
    assert ei.value.status_code == 404
    assert ei.value.body == {"message": "The model `no-such-model` does not exist.", "type": "invalid_request_error",
                             "param": "model", "code": "model_not_found"}


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
def test_disable_log_requests_logs_no_request_line(dep, client, model):
    served = metric_sum(dep.metrics(), "glmrt_requests_total")
    client.completions.create(model=model, prompt="not logged", max_tokens=3)
    assert metric_sum(dep.metrics(), "glmrt_requests_total") > served >= 1   # the earlier tests' requests too
    time.sleep(0.5)
    assert log_lines(dep, "INFO supervisor/0: engine/0 ready"), dep.output()[-3000:]   # info lines are on
    assert not log_lines(dep, "api/0: request "), log_lines(dep, "api/0: request ")[:3]


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
