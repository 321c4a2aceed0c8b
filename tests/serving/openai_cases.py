"""Shared request builders and text deltas for the OpenAI surface tests."""

from __future__ import annotations

import json

import pytest

from glmrt import protocol as P
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


LP = [P.TokenLogprob(token_id=5, token="Hel", logprob=-0.1,
                     top_logprobs=[P.TopLogprob(token_id=5, token="Hel", logprob=-0.1),
                                   P.TopLogprob(token_id=9, token="Hi", logprob=float("-inf"))]),
      P.TokenLogprob(token_id=6, token="lo", logprob=-0.2,
                     top_logprobs=[P.TopLogprob(token_id=6, token="lo", logprob=-0.2)])]
LP2 = [P.TokenLogprob(token_id=7, token="bytes:\\xe4\\xbd", logprob=-1.5, top_logprobs=[])]


def outs_chat(rid="r1", index=0):
    key = P.RequestKey(rid=rid, choice=index)
    return [
        P.TextOut(key=key, reasoning="Let me ", token_ids=[1, 2], prompt_token_ids=[100, 101]),
        P.TextOut(key=key, reasoning="think.", text="Calling.", token_ids=[3]),
        P.TextOut(key=key, tool_calls=[P.ToolCallDelta(index=0, id="call_abc", name="get_weather")],
                  token_ids=[4, 5]),
        P.TextOut(key=key, tool_calls=[P.ToolCallDelta(index=0, arguments='{"city": "Paris"}')],
                  token_ids=[6]),
        P.TextOut(key=key, tool_calls=[P.ToolCallDelta(index=1, id="call_def", name="get_weather",
                                                       arguments='{"city": "Rome"}')],
                  token_ids=[7], finished=True, finish_reason="stop",
                  usage=P.Usage(prompt_tokens=12, completion_tokens=7, cached_tokens=8)),
    ]
