"""glmrt.serving.openai_api: request validation, the wire mapping, and response shapes checked
against the official openai client's types (and the client itself, over a mock transport)."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import msgspec
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from glmrt import protocol as P
from glmrt.sampling_params import SamplingParams
from glmrt.serving import openai_api as A

MODEL = "glm-5.3-flash"
USER = [{"role": "user", "content": "Hi"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


def chat(**fields) -> A.ChatRequest:
    body = {"model": MODEL, "messages": USER, **fields}
    return A.parse_chat_request(json.dumps(body).encode(), MODEL)


def comp(**fields) -> A.CompletionRequest:
    body = {"model": MODEL, "prompt": "Once", **fields}
    return A.parse_completion_request(json.dumps(body).encode(), MODEL)


def chat_err(body, **kw) -> A.APIError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(A.APIError) as ei:
        A.parse_chat_request(raw, MODEL, **kw)
    return ei.value


def comp_err(body) -> A.APIError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(A.APIError) as ei:
        A.parse_completion_request(raw, MODEL)
    return ei.value


# =============================================================================================
# errors
# =============================================================================================


def test_error_helpers_shape():
    for err, status, code in [
        (A.bad_request("x", "temperature"), 400, None),
        (A.not_found_model("nope"), 404, "model_not_found"),
        (A.unauthorized(), 401, "invalid_api_key"),
        (A.too_large(1024), 413, "request_too_large"),
        (A.overloaded(2.2), 503, "overloaded"),
        (A.context_length_exceeded(5000, 4096), 400, "context_length_exceeded"),
    ]:
        j = err.to_json()
        assert err.status == status
        assert set(j) == {"error"} and set(j["error"]) == {"message", "type", "param", "code"}
        assert j["error"]["code"] == code and isinstance(j["error"]["message"], str)
    assert A.overloaded(2.2).headers == {"Retry-After": "3"}
    assert A.not_found_model("nope").param == "model"
    ctx = A.context_length_exceeded(5000, 4096)
    assert "4096" in ctx.message and "5000" in ctx.message and ctx.param == "messages"
    assert "1024" in A.too_large(1024).message
    assert A.error_from_wire(400, "too long", "context_length_exceeded").code == "context_length_exceeded"
    assert A.error_from_wire(503, "busy").headers["Retry-After"] == "1"


@pytest.mark.parametrize("body, param, code", [
    (b"{not json", None, "invalid_json"),
    (b"", None, "invalid_json"),
    (b"[1, 2]", None, "invalid_json"),
    ({"model": MODEL}, "messages", "missing_required_parameter"),
    ({"model": MODEL, "messages": []}, "messages", "empty_array"),
    ({"model": MODEL, "messages": "hi"}, "messages", "invalid_type"),
    ({"model": MODEL, "messages": [{"content": "x"}]}, "messages[0].role", "invalid_value"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "invalid_value"),
    ({"model": MODEL, "messages": [{"role": "user"}]}, "messages[0].content", "missing_required_parameter"),
    ({"model": MODEL, "messages": [{"role": "user", "content": 3}]}, "messages[0].content", "invalid_type"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"text": "x"}]}]},
     "messages[0].content[0].type", "invalid_value"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
     "messages[0].content[0].text", "invalid_type"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
     "messages[0].content[0].type", "unsupported_value"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].image_url.url", "invalid_value"),
    ({"model": MODEL, "messages": [{"role": "system", "content": [{"type": "image_url",
                                                                    "image_url": {"url": "http://x"}}]}]},
     "messages[0].content[0].type", "invalid_value"),
    ({"model": MODEL, "messages": USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{bad"}}]}]},
     "messages[1].tool_calls[0].function.arguments", "invalid_value"),
    ({"model": MODEL, "messages": USER, "temperature": "hot"}, "temperature", "invalid_type"),
    ({"model": MODEL, "messages": USER, "temperature": -1}, "temperature", "invalid_value"),
    ({"model": MODEL, "messages": USER, "top_p": 0}, "top_p", "invalid_value"),
    ({"model": MODEL, "messages": USER, "top_k": 1.5}, "top_k", "invalid_type"),
    ({"model": MODEL, "messages": USER, "top_k": -5}, "top_k", "invalid_value"),
    ({"model": MODEL, "messages": USER, "min_p": 2}, "min_p", "invalid_value"),
    ({"model": MODEL, "messages": USER, "frequency_penalty": 3}, "frequency_penalty", "invalid_value"),
    ({"model": MODEL, "messages": USER, "presence_penalty": -3}, "presence_penalty", "invalid_value"),
    ({"model": MODEL, "messages": USER, "repetition_penalty": 0}, "repetition_penalty", "invalid_value"),
    ({"model": MODEL, "messages": USER, "seed": "1"}, "seed", "invalid_type"),
    ({"model": MODEL, "messages": USER, "seed": 2**70}, "seed", "invalid_value"),
    ({"model": MODEL, "messages": USER, "n": 0}, "n", "invalid_value"),
    ({"model": MODEL, "messages": USER, "n": True}, "n", "invalid_type"),
    ({"model": MODEL, "messages": USER, "max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"model": MODEL, "messages": USER, "max_completion_tokens": 0}, "max_completion_tokens", "invalid_value"),
    ({"model": MODEL, "messages": USER, "max_tokens": 4, "min_tokens": 5}, "min_tokens", "invalid_value"),
    ({"model": MODEL, "messages": USER, "stop": 5}, "stop", "invalid_type"),
    ({"model": MODEL, "messages": USER, "stop": ["a", 1]}, "stop[1]", "invalid_type"),
    ({"model": MODEL, "messages": USER, "stop": [""]}, "stop[0]", "invalid_value"),
    ({"model": MODEL, "messages": USER, "stop": [str(i) for i in range(17)]}, "stop", "invalid_value"),
    ({"model": MODEL, "messages": USER, "stop_token_ids": [1, -2]}, "stop_token_ids[1]", "invalid_value"),
    ({"model": MODEL, "messages": USER, "stop_token_ids": 3}, "stop_token_ids", "invalid_type"),
    ({"model": MODEL, "messages": USER, "ignore_eos": "yes"}, "ignore_eos", "invalid_type"),
    ({"model": MODEL, "messages": USER, "logprobs": 1}, "logprobs", "invalid_type"),
    ({"model": MODEL, "messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "invalid_value"),
    ({"model": MODEL, "messages": USER, "top_logprobs": 3}, "top_logprobs", "invalid_value"),
    ({"model": MODEL, "messages": USER, "stream_options": {"include_usage": True}}, "stream_options",
     "invalid_value"),
    ({"model": MODEL, "messages": USER, "stream": True, "stream_options": {"include_usage": 1}},
     "stream_options.include_usage", "invalid_type"),
    ({"model": MODEL, "messages": USER, "tools": {}}, "tools", "invalid_type"),
    ({"model": MODEL, "messages": USER, "tools": [{"type": "function"}]}, "tools[0].function",
     "missing_required_parameter"),
    ({"model": MODEL, "messages": USER, "tools": [{"type": "function", "function": {"name": ""}}]},
     "tools[0].function.name", "invalid_value"),
    ({"model": MODEL, "messages": USER, "tools": TOOLS, "tool_choice": "required"}, "tool_choice",
     "unsupported_value"),
    ({"model": MODEL, "messages": USER, "tools": TOOLS,
      "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice", "unsupported_value"),
    ({"model": MODEL, "messages": USER, "tool_choice": "sometimes"}, "tool_choice", "invalid_value"),
    ({"model": MODEL, "messages": USER, "parallel_tool_calls": "no"}, "parallel_tool_calls", "invalid_type"),
    ({"model": MODEL, "messages": USER, "chat_template_kwargs": []}, "chat_template_kwargs", "invalid_type"),
    ({"model": MODEL, "messages": USER, "chat_template_kwargs": {"thinking": "no"}},
     "chat_template_kwargs.thinking", "invalid_type"),
    ({"model": MODEL, "messages": USER, "reasoning_effort": 3}, "reasoning_effort", "invalid_type"),
    ({"model": MODEL, "messages": USER, "return_token_ids": "y"}, "return_token_ids", "invalid_type"),
    ({"model": MODEL, "messages": USER, "response_format": {"type": "json_object"}}, "response_format",
     "unsupported_value"),
    ({"model": MODEL, "messages": USER, "logit_bias": {"5": 10}}, "logit_bias", "unsupported_value"),
])
def test_chat_validation_errors(body, param, code):
    err = chat_err(body)
    assert err.status == 400, err
    assert err.param == param, err
    assert err.code == code, err
    assert err.type == "invalid_request_error"
    if param:
        assert param.split("[")[0].split(".")[0] in err.message


def test_malformed_json_message_names_problem():
    err = chat_err(b'{"model": "x", ')
    assert "not valid JSON" in err.message and err.status == 400


def test_not_supported_messages_are_clear():
    assert "not supported yet" in chat_err({"model": MODEL, "messages": USER, "tools": TOOLS,
                                            "tool_choice": "required"}).message
    assert "not supported yet" in chat_err({"model": MODEL, "messages": USER, "tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}}).message


def test_unknown_model_404():
    err = chat_err({"model": "gpt-4", "messages": USER})
    assert (err.status, err.code, err.param) == (404, "model_not_found", "model")
    assert "gpt-4" in err.message
    err = comp_err({"model": "gpt-4", "prompt": "x"})
    assert (err.status, err.code) == (404, "model_not_found")


def test_n_limit_and_model_aliases():
    assert chat_err({"model": MODEL, "messages": USER, "n": 5}, max_n=4).param == "n"
    req = A.parse_chat_request(json.dumps({"model": "alias", "messages": USER}).encode(), [MODEL, "alias"])
    assert req.model == "alias"
    assert A.parse_chat_request(json.dumps({"messages": USER}).encode(), MODEL).model == MODEL


@pytest.mark.parametrize("body, param, code", [
    ({"model": MODEL}, "prompt", "missing_required_parameter"),
    ({"model": MODEL, "prompt": ""}, "prompt", "invalid_value"),
    ({"model": MODEL, "prompt": []}, "prompt", "empty_array"),
    ({"model": MODEL, "prompt": [[]]}, "prompt[0]", "empty_array"),
    ({"model": MODEL, "prompt": ["a", ""]}, "prompt[1]", "invalid_value"),
    ({"model": MODEL, "prompt": ["a", 1]}, "prompt[1]", "invalid_type"),
    ({"model": MODEL, "prompt": [1, "a"]}, "prompt[1]", "invalid_type"),
    ({"model": MODEL, "prompt": [1, -1]}, "prompt[1]", "invalid_value"),
    ({"model": MODEL, "prompt": [[1], 2]}, "prompt[1]", "invalid_type"),
    ({"model": MODEL, "prompt": {"a": 1}}, "prompt", "invalid_type"),
    ({"model": MODEL, "prompt": "x", "logprobs": True}, "logprobs", "invalid_type"),
    ({"model": MODEL, "prompt": "x", "logprobs": 21}, "logprobs", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "max_tokens": -1}, "max_tokens", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "min_tokens": 17}, "min_tokens", "invalid_value"),  # default max 16
    ({"model": MODEL, "prompt": "x", "echo": True}, "echo", "unsupported_value"),
    ({"model": MODEL, "prompt": "x", "suffix": "end"}, "suffix", "unsupported_value"),
    ({"model": MODEL, "prompt": "x", "best_of": 3}, "best_of", "unsupported_value"),
])
def test_completion_validation_errors(body, param, code):
    err = comp_err(body)
    assert (err.status, err.param, err.code) == (400, param, code), err


# =============================================================================================
# parsing and the wire mapping
# =============================================================================================


def test_chat_parse_defaults_and_extras_ignored():
    req = chat(some_future_field={"x": 1}, user="u1", store=False, metadata={"a": "b"})
    assert req.model == MODEL and req.messages == USER and not req.stream and req.n == 1
    assert req.tools is None and req.tool_choice == "none" and req.thinking
    assert req.user == "u1"
    s = A.to_sampling_params(req, max_model_len=8192)
    assert s == SamplingParams(max_tokens=8192)


def test_every_sampling_field_maps():
    req = chat(temperature=0.5, top_p=0.9, top_k=20, min_p=0.05, frequency_penalty=0.1, presence_penalty=-0.2,
               repetition_penalty=1.1, seed=7, n=3, stop="###", stop_token_ids=[5, 6], max_completion_tokens=100,
               max_tokens=50, min_tokens=2, ignore_eos=True, logprobs=True, top_logprobs=4, return_token_ids=True)
    s = A.to_sampling_params(req)
    assert s == SamplingParams(temperature=0.5, top_p=0.9, top_k=20, min_p=0.05, frequency_penalty=0.1,
                              presence_penalty=-0.2, repetition_penalty=1.1, seed=7, stop_token_ids=[5, 6],
                              ignore_eos=True, max_tokens=100, min_tokens=2, logprobs=True, top_logprobs=4, n=3,
                              stop=["###"])
    assert req.return_token_ids and req.logprobs and req.top_logprobs == 4
    assert A.to_sampling_params(chat(max_tokens=50)).max_tokens == 50
    assert A.to_sampling_params(chat(stop=["a", "b", "a"])).stop == ["a", "b"]
    assert A.to_sampling_params(chat(n=2.0, temperature=1)).n == 2  # integral floats and ints are fine
    assert A.to_sampling_params(chat(temperature=None, seed=None)) == A.to_sampling_params(chat())


def test_generation_config_defaults():
    gen = {"temperature": 0.6, "top_p": 0.95, "top_k": 40, "do_sample": True}
    s = A.to_sampling_params(chat(temperature=0.2), defaults=gen, max_model_len=100)
    assert (s.temperature, s.top_p, s.top_k, s.max_tokens) == (0.2, 0.95, 40, 100)
    assert A.to_sampling_params(chat(), defaults={"do_sample": False}).temperature == 0.0
    with pytest.raises(A.APIError) as ei:
        A.to_sampling_params(chat(stop_token_ids=[99]), vocab_size=50)
    assert ei.value.param == "stop_token_ids"


def test_completion_parse_prompts_and_logprobs():
    assert comp().prompts == ["Once"]
    assert comp(prompt=["a", "b"]).prompts == ["a", "b"]
    assert comp(prompt=[1, 2, 3]).prompts == [[1, 2, 3]]
    assert comp(prompt=[[1, 2], [3]]).prompts == [[1, 2], [3]]
    s = A.to_sampling_params(comp())
    assert s.max_tokens == 16 and not s.logprobs
    s = A.to_sampling_params(comp(logprobs=0))
    assert s.logprobs and s.top_logprobs == 0
    s = A.to_sampling_params(comp(logprobs=5, max_tokens=7, n=2, best_of=2))
    assert (s.logprobs, s.top_logprobs, s.max_tokens, s.n) == (True, 5, 7, 2)
    req = comp(prompt=["a", "b"], n=2, stream=True, stream_options={"include_usage": True})
    assert req.num_choices == 4 and req.include_usage


def test_stream_options_and_tools():
    req = chat(stream=True, stream_options={"include_usage": True})
    assert req.stream and req.include_usage
    req = chat(tools=TOOLS)
    assert req.tool_choice == "auto" and req.tools == TOOLS and req.parallel_tool_calls
    req = chat(tools=TOOLS, tool_choice="none", parallel_tool_calls=False)
    assert req.tool_choice == "none" and req.tools is None and not req.parallel_tool_calls
    assert chat(tools=[]).tools is None
    assert chat(tool_choice="auto").tools is None


def test_messages_shapes_accepted():
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "developer", "content": [{"type": "text", "text": "dev"}]},
        {"role": "user", "content": [{"type": "text", "text": "look"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
                                     {"type": "video_url", "video_url": {"url": "http://v"}}]},
        {"role": "assistant", "content": None, "reasoning_content": "think",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny."},
        {"role": "user", "content": "thanks", "name": "bob"},
    ]
    req = A.parse_chat_request(json.dumps({"model": MODEL, "messages": messages}).encode(), MODEL)
    assert req.messages == messages


def test_thinking_and_reasoning_effort():
    assert not chat(chat_template_kwargs={"thinking": False}).thinking
    assert not chat(chat_template_kwargs={"enable_thinking": False}).thinking
    assert chat(chat_template_kwargs={"thinking": True}).thinking
    assert chat(reasoning_effort="low").reasoning_effort == "low"


def test_tokenize_request_chat():
    req = chat(tools=TOOLS, stream=True, chat_template_kwargs={"thinking": False}, reasoning_effort="high",
               return_token_ids=True, max_tokens=9)
    t = A.to_tokenize_request(req, "r1", "detokenizer/0", arrival=3.5)
    assert t.kind == "chat" and t.rid == "r1" and t.reply_to == "detokenizer/0"
    assert t.messages == USER and t.tools == TOOLS and t.prompt is None
    assert t.chat_template_kwargs == {"thinking": False} and t.reasoning_effort == "high"
    assert t.stream and t.return_token_ids and t.arrival == 3.5 and t.sampling.max_tokens == 9
    # survives the wire
    raw = msgspec.msgpack.encode(t)
    assert msgspec.msgpack.decode(raw, type=P.TOKENIZER_IN) == t
    assert A.to_tokenize_request(chat(tools=TOOLS, tool_choice="none"), "r", "d").tools is None


def test_tokenize_requests_completion_fanout():
    req = comp(prompt=[[1, 2], [3, 4]], n=2)
    ts = A.to_tokenize_requests(req, "cmpl-x", "detokenizer/1")
    assert [t.rid for t in ts] == ["cmpl-x-0", "cmpl-x-1"]
    assert [t.prompt for t in ts] == [[1, 2], [3, 4]]
    assert all(t.kind == "completion" and t.sampling.n == 2 and t.messages is None for t in ts)
    assert [t.rid for t in A.to_tokenize_requests(comp(), "cmpl-y", "d")] == ["cmpl-y"]
    assert A.to_tokenize_request(comp(prompt="abc"), "r", "d").prompt == "abc"


def test_module_does_not_import_torch():
    code = "import sys, glmrt.serving.openai_api; assert 'torch' not in sys.modules and 'aiohttp' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)


# =============================================================================================
# responses, validated by the client's types
# =============================================================================================

LP = [P.TokenLogprob(token_id=5, token="Hel", logprob=-0.1,
                     top_logprobs=[P.TopLogprob(token_id=5, token="Hel", logprob=-0.1),
                                   P.TopLogprob(token_id=9, token="Hi", logprob=float("-inf"))]),
      P.TokenLogprob(token_id=6, token="lo", logprob=-0.2,
                     top_logprobs=[P.TopLogprob(token_id=6, token="lo", logprob=-0.2)])]
LP2 = [P.TokenLogprob(token_id=7, token="bytes:\\xe4\\xbd", logprob=-1.5, top_logprobs=[])]


def _outs_chat(rid="r1", index=0):
    return [
        P.TextOut(rid=rid, index=index, reasoning="Let me ", token_ids=[1, 2], prompt_token_ids=[100, 101]),
        P.TextOut(rid=rid, index=index, reasoning="think.", text="Calling.", token_ids=[3]),
        P.TextOut(rid=rid, index=index, tool_calls=[P.ToolCallDelta(index=0, id="call_abc", name="get_weather")],
                  token_ids=[4, 5]),
        P.TextOut(rid=rid, index=index, tool_calls=[P.ToolCallDelta(index=0, arguments='{"city": "Paris"}')],
                  token_ids=[6]),
        P.TextOut(rid=rid, index=index, tool_calls=[P.ToolCallDelta(index=1, id="call_def", name="get_weather",
                                                                    arguments='{"city": "Rome"}')],
                  token_ids=[7], finished=True, finish_reason="stop",
                  usage=P.Usage(prompt_tokens=12, completion_tokens=7, cached_tokens=8)),
    ]


def test_chat_completion_non_streamed_with_tools():
    acc = A.ChoiceAccumulator(0, return_token_ids=True)
    for out in _outs_chat():
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
    for out in _outs_chat():
        acc.add(out)
    ch = ChatCompletion.model_validate(A.chat_completion_response("c", MODEL, 1, [acc.chat_choice()], None)).choices[0]
    assert [t.id for t in ch.message.tool_calls] == ["call_abc"] and ch.finish_reason == "tool_calls"


def test_chat_finish_reasons():
    def final(reason, calls=()):
        acc = A.ChoiceAccumulator(0)
        acc.add(P.TextOut(rid="r", text="x" if not calls else "", tool_calls=list(calls), finished=True,
                          finish_reason=reason))
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
    acc.add(P.TextOut(rid="r", text="Hello", logprobs=LP))
    acc.add(P.TextOut(rid="r", text="\u4f60", logprobs=LP2, finished=True, finish_reason="length"))
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
            acc.add(P.TextOut(rid=rid, index=i, text="Hello", logprobs=LP, token_ids=[5, 6],
                              prompt_token_ids=[1, 2, p]))
            acc.add(P.TextOut(rid=rid, index=i, text="!", token_ids=[7], finished=True, finish_reason="stop",
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
    acc.add(P.TextOut(rid="r", text="x", finished=True, finish_reason="tool_calls"))
    assert Completion.model_validate(A.completion_response("c", MODEL, 1, [acc.completion_choice()], None)
                                     ).choices[0].finish_reason == "stop"


def test_chat_stream_chunks_fold_into_the_same_completion():
    stream = A.ChatStream("chatcmpl-s", MODEL, 1700000000, include_usage=True, return_token_ids=True)
    chunks = []
    for out in _outs_chat():
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
        chunks += stream.on_text(P.TextOut(rid="r", index=i, text="Hello", logprobs=LP))
    for i in (1, 0):
        chunks += stream.on_text(P.TextOut(rid="r", index=i, finished=True, finish_reason="length",
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
    assert len(stream.on_text(P.TextOut(rid="r", token_ids=[1]))) == 1  # the role chunk only
    assert stream.on_text(P.TextOut(rid="r", token_ids=[2])) == []
    chunks = stream.on_text(P.TextOut(rid="r", tool_calls=[
        P.ToolCallDelta(index=0, id="call_1", name="f", arguments="{}"),
        P.ToolCallDelta(index=1, id="call_2", name="g", arguments="{}")], finished=True, finish_reason="stop"))
    ch = ChatCompletionChunk.model_validate(chunks[0]).choices[0]
    assert [t.id for t in ch.delta.tool_calls] == ["call_1"] and ch.finish_reason == "tool_calls"


def test_completion_stream():
    stream = A.CompletionStream("cmpl-s", MODEL, 1, n=2, include_usage=True, logprobs=True, return_token_ids=True)
    chunks = []
    chunks += stream.on_text(P.TextOut(rid="a-1", index=1, text="Hello", logprobs=LP, token_ids=[5, 6],
                                       prompt_token_ids=[9]), prompt_index=1)
    chunks += stream.on_text(P.TextOut(rid="a-1", index=1, text="!", token_ids=[7], finished=True,
                                       finish_reason="stop", usage=P.Usage(prompt_tokens=1, completion_tokens=3),
                                       logprobs=[P.TokenLogprob(token_id=7, token="!", logprob=-0.5)]),
                             prompt_index=1)
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
    assert A.sub_rid("r", 0, 1) == "r" and A.sub_rid("r", 2, 3) == "r-2"


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
            rid, outs = "chatcmpl-t", _outs_chat()
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
        acc.add(P.TextOut(rid="c", text="ok", logprobs=LP, finished=True, finish_reason="length",
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
        client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required")
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
