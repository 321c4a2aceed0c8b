"""glmrt.serving.openai_api responses and streams, checked against the official openai
client's types (and the client itself, over a mock transport)."""

from __future__ import annotations

import json

import httpx
import msgspec
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from glmrt import protocol as P
from glmrt.serving import openai_api as A
from tests.serving.openai_cases import LP, LP2, MODEL, TOOLS, USER, outs_chat


# =============================================================================================
# responses, validated by the client's types
# =============================================================================================


def test_chat_completion_non_streamed_with_tools():
    acc = A.ChoiceAccumulator(0, return_token_ids=True)
    for out in outs_chat():
        acc.add(out)
    assert acc.finished
    usage = A.UsageTotals()
    usage.add("r1", acc.usage)
    resp = A.chat_completion_response("chatcmpl-1", MODEL, 1700000000, [acc.chat_choice()], usage.to_json(),
                                      prompt_token_ids=acc.prompt_token_ids)
    cc = ChatCompletion.model_validate(resp)
    ch = cc.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.content == "Calling."
    assert ch.message.model_extra["reasoning_content"] == "Let me think."
    assert [(t.id, t.function.name, json.loads(t.function.arguments)) for t in ch.message.tool_calls] == [
        ("call_abc", "get_weather", {"city": "Paris"}), ("call_def", "get_weather", {"city": "Rome"})]
    assert ch.model_extra["token_ids"] == [1, 2, 3, 4, 5, 6, 7]
    assert cc.model_extra["prompt_token_ids"] == [100, 101]
    assert cc.usage.prompt_tokens == 12 and cc.usage.completion_tokens == 7 and cc.usage.total_tokens == 19
    assert cc.usage.prompt_tokens_details.cached_tokens == 8
    assert ch.logprobs is None
    # through a JSON round trip too (what the client really sees)
    assert ChatCompletion.model_validate_json(msgspec.json.encode(resp)) == cc


def test_chat_parallel_tool_calls_false_keeps_first_call():
    acc = A.ChoiceAccumulator(0, parallel_tool_calls=False)
    for out in outs_chat():
        acc.add(out)
    ch = ChatCompletion.model_validate(A.chat_completion_response("c", MODEL, 1, [acc.chat_choice()], None)).choices[0]
    assert [t.id for t in ch.message.tool_calls] == ["call_abc"] and ch.finish_reason == "tool_calls"


def test_chat_finish_reasons():
    def final(reason, calls=()):
        acc = A.ChoiceAccumulator(0)
        acc.add(P.TextOut(key=P.RequestKey(rid="r"), text="x" if not calls else "", tool_calls=list(calls),
                          finished=True, finish_reason=reason))
        return ChatCompletion.model_validate(A.chat_completion_response("c", MODEL, 1, [acc.chat_choice()], None))
    call = P.ToolCallDelta(index=0, id="call_1", name="f", arguments="{}")
    assert final("stop").choices[0].finish_reason == "stop"
    assert final("length").choices[0].finish_reason == "length"
    assert final("abort").choices[0].finish_reason == "stop"
    assert final("stop", [call]).choices[0].finish_reason == "tool_calls"
    assert final("tool_calls", [call]).choices[0].finish_reason == "tool_calls"
    assert final("length", [call]).choices[0].finish_reason == "length"
    cc = final("stop", [call])
    assert cc.choices[0].message.content is None and cc.choices[0].message.model_extra["reasoning_content"] is None
    assert final("stop").choices[0].message.content == "x"


def test_chat_logprobs_shape():
    acc = A.ChoiceAccumulator(0, logprobs=True)
    acc.add(P.TextOut(key=P.RequestKey(rid="r"), text="Hello", logprobs=LP))
    acc.add(P.TextOut(key=P.RequestKey(rid="r"), text="\u4f60", logprobs=LP2, finished=True, finish_reason="length"))
    cc = ChatCompletion.model_validate(A.chat_completion_response("c", MODEL, 1, [acc.chat_choice()], None))
    content = cc.choices[0].logprobs.content
    assert [c.token for c in content] == ["Hel", "lo", "bytes:\\xe4\\xbd"]
    assert content[0].bytes == list(b"Hel") and content[2].bytes == [0xE4, 0xBD]
    assert content[0].top_logprobs[1].logprob == A.LOGPROB_FLOOR  # -inf is not JSON
    assert [t.token for t in content[0].top_logprobs] == ["Hel", "Hi"]
    assert content[1].logprob == -0.2 and cc.choices[0].finish_reason == "length"
    json.loads(msgspec.json.encode(cc.model_dump()))  # strictly JSON (no Infinity/NaN)


def test_completion_non_streamed():
    choices, usage = [], A.UsageTotals()
    n = 2
    for p, rid in enumerate(["cmpl-0", "cmpl-1"]):
        for i in range(n):
            acc = A.ChoiceAccumulator(p * n + i, kind="completion", logprobs=True, return_token_ids=True)
            key = P.RequestKey(rid=rid, choice=i)
            acc.add(P.TextOut(key=key, text="Hello", logprobs=LP, token_ids=[5, 6], prompt_token_ids=[1, 2, p]))
            acc.add(P.TextOut(key=key, text="!", token_ids=[7], finished=True, finish_reason="stop",
                              logprobs=[P.TokenLogprob(token_id=7, token="!", logprob=-0.5)],
                              usage=P.Usage(prompt_tokens=3, completion_tokens=3, cached_tokens=2)))
            choices.append(acc.completion_choice())
            usage.add(rid, acc.usage)
    resp = A.completion_response("cmpl-x", MODEL, 1, choices[::-1], usage.to_json())
    c = Completion.model_validate(resp)
    assert [ch.index for ch in c.choices] == [0, 1, 2, 3]
    ch = c.choices[0]
    assert ch.text == "Hello!" and ch.finish_reason == "stop"
    assert ch.logprobs.tokens == ["Hel", "lo", "!"]
    assert ch.logprobs.token_logprobs == [-0.1, -0.2, -0.5]
    assert ch.logprobs.text_offset == [0, 3, 5]
    assert ch.logprobs.top_logprobs[0] == {"Hel": -0.1, "Hi": A.LOGPROB_FLOOR} and ch.logprobs.top_logprobs[2] == {}
    assert ch.model_extra["token_ids"] == [5, 6, 7]
    assert c.choices[3].model_extra["prompt_token_ids"] == [1, 2, 1]
    # two prompts of 3 tokens, four choices of 3 tokens; cached counted once per prompt
    assert (c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens) == (6, 12, 18)
    assert c.usage.prompt_tokens_details.cached_tokens == 4


def test_completion_finish_reason_never_tool_calls():
    acc = A.ChoiceAccumulator(0, kind="completion")
    acc.add(P.TextOut(key=P.RequestKey(rid="r"), text="x", finished=True, finish_reason="tool_calls"))
    assert Completion.model_validate(A.completion_response("c", MODEL, 1, [acc.completion_choice()], None)
                                     ).choices[0].finish_reason == "stop"


def test_chat_stream_chunks_fold_into_the_same_completion():
    stream = A.ChatStream("chatcmpl-s", MODEL, 1700000000, include_usage=True, return_token_ids=True)
    chunks = []
    for out in outs_chat():
        chunks += stream.on_text(out)
    assert stream.finished_choices == 1
    chunks.append(stream.usage_chunk())
    parsed = [ChatCompletionChunk.model_validate(c) for c in chunks]
    # first chunk: the role, and prompt_token_ids at the top level
    assert parsed[0].choices[0].delta.role == "assistant" and parsed[0].model_extra["prompt_token_ids"] == [100, 101]
    assert parsed[1].choices[0].delta.model_extra["reasoning_content"] == "Let me "
    assert parsed[1].choices[0].model_extra["token_ids"] == [1, 2]
    first_call = parsed[3].choices[0].delta.tool_calls[0]
    assert (first_call.index, first_call.id, first_call.type, first_call.function.name) == (
        0, "call_abc", "function", "get_weather")
    args = parsed[4].choices[0].delta.tool_calls[0]
    assert args.id is None and args.function.arguments == '{"city": "Paris"}'
    last = parsed[-2]
    assert last.choices[0].finish_reason == "tool_calls"
    assert all(p.usage is None for p in parsed[:-1]) and all("usage" in c for c in chunks)
    u = parsed[-1]
    assert u.choices == [] and u.usage.total_tokens == 19 and u.usage.prompt_tokens_details.cached_tokens == 8
    # the client's own accumulator agrees with the non-streamed builder
    state = ChatCompletionStreamState()
    for p in parsed:
        state.handle_chunk(p)
    final = state.get_final_completion()
    msg = final.choices[0].message
    assert msg.content == "Calling." and final.choices[0].finish_reason == "tool_calls"
    assert [(t.id, t.function.name, t.function.arguments) for t in msg.tool_calls] == [
        ("call_abc", "get_weather", '{"city": "Paris"}'), ("call_def", "get_weather", '{"city": "Rome"}')]
    # SSE framing
    raw = b"".join(A.sse(c) for c in chunks) + A.SSE_DONE
    events = [e for e in raw.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    assert json.loads(events[0][6:]) == chunks[0]


def test_chat_stream_without_usage_and_n2_logprobs():
    stream = A.ChatStream("c", MODEL, 1, logprobs=True)
    chunks = []
    for i in (0, 1):
        chunks += stream.on_text(P.TextOut(key=P.RequestKey(rid="r", choice=i), text="Hello", logprobs=LP))
    for i in (1, 0):
        chunks += stream.on_text(P.TextOut(key=P.RequestKey(rid="r", choice=i), finished=True, finish_reason="length",
                                           usage=P.Usage(prompt_tokens=4, completion_tokens=2)))
    assert stream.usage_chunk() is None
    parsed = [ChatCompletionChunk.model_validate(c) for c in chunks]
    assert all("usage" not in c for c in chunks)
    assert sorted(p.choices[0].index for p in parsed if p.choices[0].delta.role) == [0, 1]
    lp = [p for p in parsed if p.choices[0].logprobs][0].choices[0].logprobs.content
    assert [x.token for x in lp] == ["Hel", "lo"]
    assert [p.choices[0].finish_reason for p in parsed[-2:]] == ["length", "length"]
    assert stream.usage.to_json() == A.usage_json(4, 4, 0)
    state = ChatCompletionStreamState()
    for p in parsed:
        state.handle_chunk(p)
    snap = state.current_completion_snapshot  # get_final_completion() refuses finish_reason "length"
    assert [c.message.content for c in snap.choices] == ["Hello", "Hello"]


def test_chat_stream_skips_empty_deltas_and_drops_parallel_calls():
    stream = A.ChatStream("c", MODEL, 1, parallel_tool_calls=False)
    assert len(stream.on_text(P.TextOut(key=P.RequestKey(rid="r"), token_ids=[1]))) == 1  # the role chunk only
    assert stream.on_text(P.TextOut(key=P.RequestKey(rid="r"), token_ids=[2])) == []
    chunks = stream.on_text(P.TextOut(key=P.RequestKey(rid="r"), tool_calls=[
        P.ToolCallDelta(index=0, id="call_1", name="f", arguments="{}"),
        P.ToolCallDelta(index=1, id="call_2", name="g", arguments="{}")], finished=True, finish_reason="stop"))
    ch = ChatCompletionChunk.model_validate(chunks[0]).choices[0]
    assert [t.id for t in ch.delta.tool_calls] == ["call_1"] and ch.finish_reason == "tool_calls"


@pytest.mark.parametrize("outs,content", [
    ([P.TextOut(key=P.RequestKey(rid="r"), tool_calls=[P.ToolCallDelta(index=0, id="call_1", name="f")]),
      P.TextOut(key=P.RequestKey(rid="r"), tool_calls=[P.ToolCallDelta(index=0, arguments="{}")], finished=True,
                finish_reason="stop")], None),  # only a call: content null
    ([P.TextOut(key=P.RequestKey(rid="r"), finished=True, finish_reason="stop")], ""),  # nothing said
    ([P.TextOut(key=P.RequestKey(rid="r"), text="Hi"), P.TextOut(key=P.RequestKey(rid="r"), finished=True,
                                                                 finish_reason="length")], "Hi"),
])
def test_chat_stream_content_sums_to_the_message_content(outs, content):
    stream, acc, state = A.ChatStream("c", MODEL, 1), A.ChoiceAccumulator(0), ChatCompletionStreamState()
    chunks = []
    for out in outs:
        acc.add(out)
        chunks += stream.on_text(out)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    assert state.current_completion_snapshot.choices[0].message.content == content
    assert acc.chat_choice()["message"]["content"] == content


def test_completion_stream():
    stream = A.CompletionStream("cmpl-s", MODEL, 1, n=2, include_usage=True, logprobs=True, return_token_ids=True)
    chunks = []
    key = P.RequestKey(rid="a", prompt=1, choice=1)
    chunks += stream.on_text(P.TextOut(key=key, text="Hello", logprobs=LP, token_ids=[5, 6], prompt_token_ids=[9]))
    chunks += stream.on_text(P.TextOut(key=key, text="!", token_ids=[7], finished=True,
                                       finish_reason="stop", usage=P.Usage(prompt_tokens=1, completion_tokens=3),
                                       logprobs=[P.TokenLogprob(token_id=7, token="!", logprob=-0.5)]))
    chunks.append(stream.usage_chunk())
    assert all(c["object"] == "text_completion" for c in chunks)
    first = Completion.construct(**chunks[0])  # streamed choices carry finish_reason null, as OpenAI's do
    assert chunks[0]["choices"][0]["finish_reason"] is None and first.id == "cmpl-s"
    assert chunks[0]["choices"][0]["index"] == 3 and chunks[0]["choices"][0]["prompt_token_ids"] == [9]
    last = Completion.model_validate(chunks[1])
    assert last.choices[0].finish_reason == "stop" and last.choices[0].logprobs.text_offset == [5]
    assert last.choices[0].model_extra["token_ids"] == [7] and "prompt_token_ids" not in chunks[1]["choices"][0]
    u = Completion.model_validate(chunks[2])
    assert u.choices == [] and u.usage.completion_tokens == 3


def test_models_response():
    r = A.models_response(MODEL, 1700000000, 131072)
    m = Model.model_validate(r["data"][0])
    assert r["object"] == "list" and m.id == MODEL and m.owned_by == "glmrt" and m.created == 1700000000
    assert m.model_extra["max_model_len"] == 131072


def test_request_ids():
    assert A.new_request_id("chat").startswith("chatcmpl-") and A.new_request_id("completion").startswith("cmpl-")
    assert A.new_request_id() != A.new_request_id()
    # choice i of prompt p is index p * n + i
    assert A.response_index(P.RequestKey(rid="r"), 1) == 0
    assert A.response_index(P.RequestKey(rid="r", prompt=2, choice=1), 3) == 7


# =============================================================================================
# the real client over a mock transport
# =============================================================================================


def _client(handler) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://glmrt.test/v1", api_key="k", max_retries=0,
                         http_client=httpx.Client(transport=httpx.MockTransport(handler)))


def _serve(request: httpx.Request) -> httpx.Response:
    """A toy server: the builders above, answering one fixed generation."""
    try:
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json=A.models_response(MODEL, 1, 4096))
        if request.url.path.endswith("/chat/completions"):
            req = A.parse_chat_request(request.content, MODEL)
            rid, outs = "chatcmpl-t", outs_chat()
            if req.stream:
                st = A.ChatStream(rid, MODEL, 1, include_usage=req.include_usage,
                                  return_token_ids=req.return_token_ids, parallel_tool_calls=req.parallel_tool_calls)
                body = b"".join(A.sse(c) for o in outs for c in st.on_text(o))
                if st.usage_chunk():
                    body += A.sse(st.usage_chunk())
                return httpx.Response(200, content=body + A.SSE_DONE, headers={"content-type": "text/event-stream"})
            acc = A.ChoiceAccumulator(0, return_token_ids=req.return_token_ids)
            for o in outs:
                acc.add(o)
            u = A.UsageTotals()
            u.add(rid, acc.usage)
            return httpx.Response(200, json=A.chat_completion_response(rid, MODEL, 1, [acc.chat_choice()], u.to_json()))
        req = A.parse_completion_request(request.content, MODEL)
        acc = A.ChoiceAccumulator(0, kind="completion", logprobs=req.logprobs is not None)
        acc.add(P.TextOut(key=P.RequestKey(rid="c"), text="ok", logprobs=LP, finished=True, finish_reason="length",
                          usage=P.Usage(prompt_tokens=2, completion_tokens=2, cached_tokens=1)))
        u = A.UsageTotals()
        u.add("c", acc.usage)
        return httpx.Response(200, json=A.completion_response("cmpl-t", MODEL, 1, [acc.completion_choice()],
                                                              u.to_json()))
    except A.APIError as err:
        return httpx.Response(err.status, json=err.to_json(), headers=err.headers)


def test_real_client_end_to_end():
    client = _client(_serve)
    assert [m.id for m in client.models.list()] == [MODEL]
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS,
                                       extra_body={"top_k": 5, "return_token_ids": True,
                                                   "chat_template_kwargs": {"thinking": False}})
    assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 2
    assert r.choices[0].message.reasoning_content == "Let me think."  # extra attribute access
    assert r.usage.prompt_tokens_details.cached_tokens == 8
    stream = client.chat.completions.create(model=MODEL, messages=USER, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage.total_tokens == 19 and chunks[-1].choices == []
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Calling."
    with client.chat.completions.stream(model=MODEL, messages=USER, tools=TOOLS) as s:
        final = s.get_final_completion()
    assert [t.function.arguments for t in final.choices[0].message.tool_calls] == ['{"city": "Paris"}',
                                                                                  '{"city": "Rome"}']
    c = client.completions.create(model=MODEL, prompt=[1, 2], logprobs=2)
    assert c.choices[0].text == "ok" and c.choices[0].logprobs.tokens == ["Hel", "lo"]


def test_real_client_sees_errors():
    client = _client(_serve)
    with pytest.raises(openai.NotFoundError) as ei:
        client.chat.completions.create(model="nope", messages=USER)
    assert ei.value.code == "model_not_found" and ei.value.param == "model"
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice={
            "type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}})
    assert ei.value.param == "tool_choice" and "not supported yet" in ei.value.message
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=MODEL, messages=USER, temperature=-1)
    assert ei.value.param == "temperature"

    def busy(request):
        err = A.overloaded(1)
        return httpx.Response(err.status, json=err.to_json(), headers=err.headers)
    with pytest.raises(openai.InternalServerError) as ei:
        _client(busy).completions.create(model=MODEL, prompt="x")
    assert ei.value.status_code == 503 and ei.value.response.headers["retry-after"] == "1"


def test_text_offsets_count_characters_not_escaped_bytes():
    """A token that ends inside a UTF-8 character (the logprob token `bytes:\\xe4\\xbd`) adds no
    character until the token that completes it: offsets index the text "你好 ok", in one piece
    or over a stream's chunks."""
    toks = ["bytes:\\xe4\\xbd", "bytes:\\xa0", "好", " ok"]
    lps = [P.TokenLogprob(token_id=i, token=t, logprob=-1.0) for i, t in enumerate(toks)]
    assert A.completion_logprobs(lps)["text_offset"] == [0, 0, 1, 2]
    offsets = A.TextOffsets()
    first = A.completion_logprobs(lps[:1], offsets)["text_offset"]
    assert first + A.completion_logprobs(lps[1:], offsets)["text_offset"] == [0, 0, 1, 2]
