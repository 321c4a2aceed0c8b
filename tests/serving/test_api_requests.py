"""glmrt.serving.openai_api requests: error shapes, validation that names the bad field,
parsing into SamplingParams and the mapping to TokenizeRequests."""

from __future__ import annotations

import json
import subprocess
import sys

import msgspec
import pytest

from glmrt import protocol as P
from glmrt.sampling_params import SamplingParams
from glmrt.serving import openai_api as A
from tests.serving.openai_cases import MODEL, TOOLS, USER, chat, chat_err, comp, comp_err


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
    ({"model": MODEL, "messages": USER, "tool_choice": "required"}, "tool_choice", "invalid_value"),
    ({"model": MODEL, "messages": USER, "tools": TOOLS,
      "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name",
     "invalid_value"),
    ({"model": MODEL, "messages": USER, "tools": TOOLS,
      "tool_choice": {"type": "allowed_tools", "allowed_tools": {}}}, "tool_choice", "unsupported_value"),
    ({"model": MODEL, "messages": USER, "tool_choice": "sometimes"}, "tool_choice", "invalid_value"),
    ({"model": MODEL, "messages": USER, "parallel_tool_calls": "no"}, "parallel_tool_calls", "invalid_type"),
    ({"model": MODEL, "messages": USER, "chat_template_kwargs": []}, "chat_template_kwargs", "invalid_type"),
    ({"model": MODEL, "messages": USER, "chat_template_kwargs": {"thinking": "no"}},
     "chat_template_kwargs.thinking", "invalid_type"),
    ({"model": MODEL, "messages": USER, "reasoning_effort": 3}, "reasoning_effort", "invalid_type"),
    ({"model": MODEL, "messages": USER, "return_token_ids": "y"}, "return_token_ids", "invalid_type"),
    ({"model": MODEL, "messages": USER, "response_format": {"type": "xml"}}, "response_format.type",
     "unsupported_value"),
    ({"model": MODEL, "messages": USER, "response_format": {"type": "json_schema"}}, "response_format.json_schema",
     "missing_required_parameter"),
    ({"model": MODEL, "messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": [1]}}}, "response_format.json_schema.schema", "invalid_type"),
    ({"model": MODEL, "messages": USER, "regex": 5}, "regex", "invalid_type"),
    ({"model": MODEL, "messages": USER, "ebnf": ""}, "ebnf", "invalid_value"),
    ({"model": MODEL, "messages": USER, "guided_choice": ["a", "b"]}, "guided_choice", "unsupported_value"),
    ({"model": MODEL, "messages": USER, "regex": "a+", "response_format": {"type": "json_object"}}, "regex",
     "invalid_value"),
    ({"model": MODEL, "messages": USER, "tools": TOOLS, "tool_choice": "required", "regex": "a"}, "tool_choice",
     "invalid_value"),
    ({"model": MODEL, "messages": USER, "max_thinking_tokens": -1}, "max_thinking_tokens", "invalid_value"),
    ({"model": MODEL, "messages": USER, "regex": "a+", "min_tokens": 2}, "min_tokens", "invalid_value"),
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
    assert "not supported yet" in chat_err({"model": MODEL, "messages": USER, "tools": TOOLS, "tool_choice": {
        "type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}}).message
    # a vLLM spelling we do not read names what to send instead
    assert "'regex'" in chat_err({"model": MODEL, "messages": USER, "guided_choice": ["a", "b"]}).message


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
    # null is absent: thinking stays on, or enable_thinking decides
    assert chat(chat_template_kwargs={"thinking": None}).thinking
    assert chat(chat_template_kwargs={"enable_thinking": None}).thinking
    assert not chat(chat_template_kwargs={"thinking": None, "enable_thinking": False}).thinking
    assert chat(chat_template_kwargs={"thinking": True, "enable_thinking": False}).thinking
    for key in ("thinking", "enable_thinking"):
        with pytest.raises(A.APIError, match=f"chat_template_kwargs.{key}"):
            chat(chat_template_kwargs={key: "no"})
    assert chat(reasoning_effort="low").reasoning_effort == "low"


def test_tokenize_request_chat():
    req = chat(tools=TOOLS, stream=True, chat_template_kwargs={"thinking": False}, reasoning_effort="high",
               return_token_ids=True, max_tokens=9)
    t = A.to_tokenize_request(req, P.RequestKey(rid="r1"), "detokenizer/0", arrival=3.5)
    assert t.kind == "chat" and t.key == P.RequestKey(rid="r1") and t.reply_to == "detokenizer/0"
    assert t.messages == USER and t.tools == TOOLS and t.prompt is None
    assert t.chat_template_kwargs == {"thinking": False} and t.reasoning_effort == "high"
    assert t.stream and t.return_token_ids and t.arrival == 3.5 and t.sampling.max_tokens == 9
    # survives the wire
    raw = msgspec.msgpack.encode(t)
    assert msgspec.msgpack.decode(raw, type=P.TOKENIZER_IN) == t
    assert A.to_tokenize_request(chat(tools=TOOLS, tool_choice="none"), P.RequestKey(rid="r"), "d").tools is None


def test_tokenize_requests_completion_fanout():
    req = comp(prompt=[[1, 2], [3, 4]], n=2)
    ts = A.to_tokenize_requests(req, "cmpl-x", "detokenizer/1")
    assert [t.key for t in ts] == [P.RequestKey(rid="cmpl-x", prompt=0), P.RequestKey(rid="cmpl-x", prompt=1)]
    assert [t.prompt for t in ts] == [[1, 2], [3, 4]]
    assert all(t.kind == "completion" and t.sampling.n == 2 and t.messages is None for t in ts)
    assert [t.key for t in A.to_tokenize_requests(comp(), "cmpl-y", "d")] == [P.RequestKey(rid="cmpl-y")]
    assert A.to_tokenize_request(comp(prompt="abc"), P.RequestKey(rid="r"), "d").prompt == "abc"
    two = A.to_tokenize_request(comp(prompt=["abc", "def"]), P.RequestKey(rid="r", prompt=1), "d")
    assert two.prompt == "def" and two.key.prompt == 1


def test_module_does_not_import_torch():
    code = ("import sys, glmrt.serving.openai_api; "
            "assert not {'torch', 'aiohttp', 'xgrammar'} & set(sys.modules), 'torch, aiohttp or xgrammar imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)


def test_bounds_a_hostile_body_meets_before_anything_is_sent():
    """Each answered 400 here, never a 500 from a later send or a recursion, nor an unbounded fan-out."""
    big = 10**30
    for field in ("max_tokens", "top_k", "min_tokens", "seed"):
        err = chat_err({"model": MODEL, "messages": USER, field: big})
        assert err.status == 400 and err.param == field and "64 bits" in err.message, (field, err.message)
    assert A.to_sampling_params(chat(seed=2**64 - 1)).seed == 2**64 - 1   # the largest a generator takes
    assert A.to_sampling_params(chat(seed=-(2**63))).seed == -(2**63)
    err = chat_err({"model": MODEL, "messages": USER, "stop_token_ids": [big]})
    assert err.status == 400 and err.param == "stop_token_ids[0]"
    err = chat_err({"model": MODEL, "messages": USER, "stop_token_ids": list(range(1025))})
    assert err.status == 400 and "at most 1024 token ids" in err.message
    err = comp_err({"model": MODEL, "prompt": [big]})
    assert err.status == 400 and err.param == "prompt[0]"
    err = comp_err({"model": MODEL, "prompt": ["a"] * 1025})
    assert err.status == 400 and "at most 1024 prompts" in err.message
    assert A.engine_request_count(comp(prompt=["a"] * 1024)) == 1024
    deep = b'{"model": "' + MODEL.encode() + b'", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    err = chat_err(deep)
    assert err.status == 400 and "nested too deeply" in err.message
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}
    err = chat_err({"model": MODEL, "messages": [{"role": "user", "content": "x"},
                                                 {"role": "assistant", "tool_calls": [call]}]})
    assert err.status == 400 and "function.arguments" in err.message
    for field, value in (("user", 5), ("echo", "yes"), ("suffix", 1)):
        body = {"model": MODEL, "prompt": "x", field: value}
        err = comp_err(body)
        assert err.status == 400 and err.param == field and "Invalid type" in err.message, (field, err.message)
    assert chat_err({"model": MODEL, "messages": USER, "user": ["u"]}).param == "user"


def test_media_parts_past_the_limit_are_refused():
    """--limit-mm-per-prompt counts image and video parts over the whole conversation."""
    from glmrt.mm_limits import parse_mm_limits

    img = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    vid = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}
    limits = parse_mm_limits('{"image": 2, "video": 0}')
    assert limits == {"image": 2, "video": 0}
    two = [{"role": "user", "content": [img]}, {"role": "assistant", "content": "a"}, {"role": "user", "content": [img]}]
    body = {"model": MODEL, "messages": two}
    assert A.parse_chat_request(json.dumps(body).encode(), MODEL, mm_limits=limits).messages == two
    e = chat_err({"model": MODEL, "messages": two + [{"role": "user", "content": [img]}]}, mm_limits=limits)
    assert (e.status, e.param, e.code) == (400, "messages", "too_many_media_items")
    assert "At most 2 image(s)" in e.message and "has 3" in e.message
    e = chat_err({"model": MODEL, "messages": [{"role": "user", "content": [vid]}]}, mm_limits=limits)
    assert e.code == "too_many_media_items" and "0 video(s)" in e.message


@pytest.mark.parametrize("value, needle", [
    ('{"image": -1}', "image must be an integer >= 0"), ('{"image": true}', "image must be an integer"),
    ('{"audio": 1}', "no kind 'audio'"), ("[1]", "must be a JSON object"), ("image=2", "must be a JSON object")])
def test_media_limits_refuse_what_they_cannot_read(value, needle):
    from glmrt.mm_limits import parse_mm_limits

    with pytest.raises(ValueError, match=needle):
        parse_mm_limits(value)
    assert parse_mm_limits('{"video": 1}') == {"image": 32, "video": 1}  # a kind left out keeps its default
