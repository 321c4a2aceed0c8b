"""E2E: the OpenAI surface of a default-topology deployment (tokenizer, engine, detokenizer;
one each), started once for the module with `--context-length 1024 --log-interval 1`: models,
chat and completions, and the log lines of what it serves."""

from __future__ import annotations

import json
import re
import time

import openai
import pytest

from tests.e2e.api_cases import CONTEXT, GREEDY, TOOLS, USER, extra_field, log_lines, wait_for_log_lines
from tests.e2e.api_cases import client, dep, model  # noqa: F401  (fixtures)

pytestmark = pytest.mark.slow
DEPLOY_FLAGS = ["--log-interval", "1"]
STATS = "INFO engine/0: running "


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
    assert extra_field(models.data[0], "max_model_len") == CONTEXT


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
    assert ch.message.content or extra_field(ch.message, "reasoning_content")
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
            if extra_field(ch.delta, "reasoning_content"):
                reasoning.append(extra_field(ch.delta, "reasoning_content"))
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
    assert "".join(reasoning) == (extra_field(msg, "reasoning_content") or "")


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
    assert extra_field(m, "reasoning_content") is None
    on = client.chat.completions.create(model=model, messages=msgs, max_tokens=10, **GREEDY)
    m = on.choices[0].message
    assert on.choices[0].finish_reason == "length"
    assert extra_field(m, "reasoning_content"), m  # cut by length inside the think block: all reasoning
    assert not m.content
    # a null thinking is the default, in the prompt the tokenizer renders and in the reply's parsing
    null = client.chat.completions.create(model=model, messages=msgs, max_tokens=10, temperature=0,
                                          extra_body={"ignore_eos": True, "chat_template_kwargs": {"thinking": None}})
    assert null.usage.prompt_tokens == on.usage.prompt_tokens
    assert extra_field(null.choices[0].message, "reasoning_content") == extra_field(m, "reasoning_content")


@pytest.mark.timeout(60)
def test_chat_return_token_ids(client, model):
    r = client.chat.completions.create(model=model, messages=USER, max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    ids = extra_field(r.choices[0], "token_ids")
    assert isinstance(ids, list) and len(ids) == 6 and all(isinstance(t, int) for t in ids)
    prompt_ids = extra_field(r, "prompt_token_ids")
    assert isinstance(prompt_ids, list) and len(prompt_ids) == r.usage.prompt_tokens


@pytest.mark.timeout(60)
def test_tools_auto_accepted_allowed_tools_rejected(client, model):
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model=model, messages=msgs, tools=TOOLS, tool_choice="auto", max_tokens=8,
                                       **GREEDY)
    assert r.choices[0].finish_reason in ("length", "tool_calls", "stop")
    assert r.usage.completion_tokens <= 8
    with pytest.raises(openai.BadRequestError) as ei:  # "required" and named: tests/e2e/test_structured_output.py
        client.chat.completions.create(model=model, messages=msgs, tools=TOOLS, max_tokens=8, tool_choice={
            "type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": []}})
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
    out_ids = extra_field(ch, "token_ids")
    assert isinstance(out_ids, list) and len(out_ids) == 5
    assert extra_field(ch, "prompt_token_ids") == ids
    # greedy and deterministic: the same request again gives the same tokens
    r2 = client.completions.create(model=model, prompt=ids, max_tokens=5, temperature=0,
                                   extra_body={"ignore_eos": True, "return_token_ids": True})
    assert extra_field(r2.choices[0], "token_ids") == out_ids
    # every choice carries its prompt's ids, whole and streamed
    r3 = client.completions.create(model=model, prompt=ids, max_tokens=3, n=2, seed=5,
                                   extra_body={"ignore_eos": True, "return_token_ids": True})
    assert [extra_field(c, "prompt_token_ids") for c in r3.choices] == [ids, ids]
    seen = {}
    for chunk in client.completions.create(model=model, prompt=ids, max_tokens=3, n=2, seed=5, stream=True,
                                           extra_body={"ignore_eos": True, "return_token_ids": True}):
        for c in chunk.choices:
            if extra_field(c, "prompt_token_ids") is not None:
                seen[c.index] = extra_field(c, "prompt_token_ids")
    assert seen == {0: ids, 1: ids}


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
    # vLLM's stop_reason: the stop string that ended it (None when the length limit did), streamed too
    assert extra_field(ch, "stop_reason") == cut
    last = list(client.completions.create(stop=[cut], stream=True, **kw))[-1].choices[0]
    assert last.finish_reason == "stop" and extra_field(last, "stop_reason") == cut
    assert extra_field(client.completions.create(**kw).choices[0], "stop_reason") is None


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


# ---- logs ----------------------------------------------------------------------------------


def _request_line(dep, rid: str) -> str:
    lines = wait_for_log_lines(dep, f"INFO api/0: request {rid}: ")
    assert len(lines) == 1, (rid, lines, dep.output()[-3000:])
    return lines[0]


@pytest.mark.timeout(60)
def test_a_finished_request_logs_one_line_with_its_id_and_tokens(dep, client, model):
    r = client.chat.completions.create(model=model, messages=USER, max_tokens=6, **GREEDY)
    line = _request_line(dep, r.id)
    u = r.usage
    assert (f"status=200 prompt_tokens={u.prompt_tokens} cached_tokens={u.prompt_tokens_details.cached_tokens} "
            f"output_tokens=6 duration=") in line and line.endswith(" finish=length"), line
    assert "ttft=" not in line   # a non-streamed answer reaches the api whole
    stream = client.completions.create(model=model, prompt="Logged once, streamed.", max_tokens=5, n=2, stream=True,
                                       stream_options={"include_usage": True}, temperature=0,
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    line = _request_line(dep, chunks[0].id)
    u = chunks[-1].usage
    assert re.search(rf"status=200 prompt_tokens={u.prompt_tokens} cached_tokens=\d+ output_tokens=10 "
                     r"ttft=\d+\.\d{3}s duration=\d+\.\d{3}s finish=length,length$", line), line
    before = len(log_lines(dep, "status=400"))
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="x", max_tokens=CONTEXT * 4)
    lines = wait_for_log_lines(dep, "status=400", before + 1)
    assert len(lines) == before + 1 and lines[-1].endswith(" error=context_length_exceeded"), lines


def _stats_lines(dep) -> list[str]:
    return log_lines(dep, STATS)


@pytest.mark.timeout(90)
def test_engine_stats_line_while_serving_and_not_while_idle(dep, client, model):
    before = len(_stats_lines(dep))
    t0 = time.monotonic()
    seen = None
    stream = client.completions.create(model=model, prompt="Count the engine's lines.", max_tokens=400, stream=True,
                                       temperature=0, extra_body={"ignore_eos": True})
    for _ in stream:
        if seen is None and len(_stats_lines(dep)) > before:
            seen = time.monotonic() - t0
    assert seen is not None and seen < 2.5, (seen, time.monotonic() - t0, dep.output()[-3000:])
    line = _stats_lines(dep)[before]
    assert re.search(r"running 1, queued 0, KV pool \d+\.\d%.*, state slots \d+\.\d%, gen \d+\.\d tok/s, "
                     r"prompt \d+\.\d tok/s, cache hit rate \d+\.\d%$", line), line
    assert float(re.search(r"gen (\S+) tok/s", line).group(1)) > 0
    time.sleep(2.5)   # the line after the last step may still come; then the idle engine is silent
    idle = len(_stats_lines(dep))
    time.sleep(3.0)
    assert len(_stats_lines(dep)) == idle, _stats_lines(dep)[idle:]
