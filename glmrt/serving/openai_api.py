"""The OpenAI-compatible surface, as pure functions: request parsing and validation, the
mapping to wire messages, error JSON, and response / SSE chunk builders.

No aiohttp and no torch here: the api actor calls these, and the tests check what they build
against the official `openai` client's types.

Conventions (documented choices):
- Errors are `APIError`s rendered as `{"error": {"message", "type", "param", "code"}}`;
  `param` names the offending field (`messages[2].content[0].text`, `stop`, ...).
- Unknown fields are ignored (OpenAI clients send extras through `extra_body`); the glmrt /
  vLLM / SGLang extras we honour are top_k, min_p, repetition_penalty, min_tokens,
  ignore_eos, stop_token_ids, return_token_ids and chat_template_kwargs. Known OpenAI fields
  whose semantics we cannot honour yet (tool_choice required/named, response_format other
  than text, logit_bias, echo, suffix, best_of != n, functions) answer 400 instead of being
  silently dropped. A null field means "absent".
- `max_tokens`: `max_completion_tokens` wins over `max_tokens`. When neither is set, chat
  asks for the rest of the context (`to_sampling_msg(max_model_len=...)`; the tokenizer caps
  it at max_model_len - prompt_len) and completions use OpenAI's default of 16.
- Completions `logprobs: k` means token logprobs plus the top k (0..20); chat uses
  `logprobs: bool` + `top_logprobs: 0..20`.
- A list of completion prompts becomes one engine request per prompt (`sub_rid`); choice
  `i` of prompt `p` is reported as index `p * n + i`.
- `return_token_ids`: chat puts `prompt_token_ids` at the top level of the response (and of
  the first streamed chunk); completions put it on each choice (each choice may have its own
  prompt), as vLLM does. `token_ids` goes on every choice and every streamed choice delta.
- `finish_reason` becomes "tool_calls" when the choice made a call and stopped normally; a
  choice cut by the length limit stays "length". Reasons the client types do not know
  (e.g. "abort") are reported as "stop".
- `parallel_tool_calls: false` keeps only the first call of a choice (dropped here, in the
  api, so the tokenizer and detokenizer need not know).
- Non-finite logprobs (-inf for a filtered token) are sent as -9999.0 (JSON has no inf).
"""

from __future__ import annotations

import json
import math
import secrets
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from glmrt.protocol import SamplingMsg, TextOut, TokenizeRequest, TokenLogprob, ToolCallDelta, Usage
from glmrt.sampling_params import MAX_N, MAX_TOP_LOGPROBS, SamplingParams

__all__ = [
    "APIError", "bad_request", "not_supported", "not_found_model", "unauthorized", "too_large", "overloaded",
    "context_length_exceeded", "internal_error", "error_from_wire",
    "ChatRequest", "CompletionRequest", "parse_chat_request", "parse_completion_request",
    "to_sampling_msg", "to_tokenize_request", "to_tokenize_requests", "sub_rid",
    "new_request_id", "usage_json", "UsageTotals", "ChoiceAccumulator",
    "chat_completion_response", "completion_response", "ChatStream", "CompletionStream",
    "chat_chunk", "completion_chunk", "usage_chunk", "sse", "sse_error", "SSE_DONE", "models_response",
    "MAX_STOP_SEQUENCES", "LOGPROB_FLOOR",
]

MAX_STOP_SEQUENCES = 16
LOGPROB_FLOOR = -9999.0
_UNBOUNDED_MAX_TOKENS = 2**31 - 1
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1
_CHAT_FINISH = frozenset({"stop", "length", "tool_calls", "content_filter", "function_call"})
_COMPLETION_FINISH = frozenset({"stop", "length", "content_filter"})


# =============================================================================================
# errors
# =============================================================================================


class APIError(Exception):
    """An HTTP error answer in OpenAI's JSON shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers: dict[str, str] = dict(headers or {})

    def to_json(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def __repr__(self) -> str:
        return f"APIError({self.status}, {self.message!r}, param={self.param!r}, code={self.code!r})"


def bad_request(msg: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, msg, "invalid_request_error", param, code)


def not_supported(msg: str, param: str | None = None) -> APIError:
    """400 for a valid OpenAI feature glmrt does not implement yet."""
    return APIError(400, msg, "invalid_request_error", param, "unsupported_value")


def not_found_model(name: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist.", "invalid_request_error", "model", "model_not_found")


def unauthorized() -> APIError:
    return APIError(401, "Incorrect API key provided.", "invalid_request_error", None, "invalid_api_key")


def too_large(limit: int) -> APIError:
    return APIError(413, f"Request body too large: the limit is {limit} bytes.", "invalid_request_error", None,
                    "request_too_large")


def overloaded(retry_after: float) -> APIError:
    secs = max(1, math.ceil(retry_after))
    return APIError(503, "The server is overloaded: its queues are full. Retry after a short wait.",
                    "server_error", None, "overloaded", {"Retry-After": str(secs)})


def context_length_exceeded(n: int, limit: int, param: str | None = "messages") -> APIError:
    return APIError(400, f"This model's maximum context length is {limit} tokens. However, your request has "
                         f"{n} tokens. Please reduce the length of the input or of max_tokens.",
                    "invalid_request_error", param, "context_length_exceeded")


def internal_error(msg: str = "Internal server error.") -> APIError:
    return APIError(500, msg, "server_error", None, None)


def error_from_wire(status: int, message: str, code: str | None = None) -> APIError:
    """An APIError for a TokenizerError / EngineError that reached the api."""
    kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
    param = "messages" if code == "context_length_exceeded" else None
    headers = {"Retry-After": "1"} if status in (429, 503) else None
    return APIError(status, message, kind, param, code, headers)


# =============================================================================================
# field readers (null means absent)
# =============================================================================================

_JSON_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
                    list: "an array", dict: "an object", type(None): "null"}


def _tname(v: Any) -> str:
    return _JSON_TYPE_NAMES.get(type(v), type(v).__name__)


def _type_error(param: str, expected: str, got: Any) -> APIError:
    return bad_request(f"Invalid type for '{param}': expected {expected}, but got {_tname(got)}.", param,
                       "invalid_type")


def _value_error(param: str, why: str) -> APIError:
    return bad_request(f"Invalid value for '{param}': {why}", param, "invalid_value")


def _number(body: Mapping, name: str) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _type_error(name, "a number", v)
    if not math.isfinite(v):
        raise _value_error(name, "must be a finite number.")
    return v


def _int(body: Mapping, name: str, param: str | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    return _as_int(v, param or name)


def _as_int(v: Any, param: str) -> int:
    if isinstance(v, bool):
        raise _type_error(param, "an integer", v)
    if isinstance(v, float) and math.isfinite(v) and v.is_integer():
        return int(v)
    if not isinstance(v, int):
        raise _type_error(param, "an integer", v)
    return v


def _bool(body: Mapping, name: str) -> bool | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise _type_error(name, "a boolean", v)
    return v


def _str(body: Mapping, name: str) -> str | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, str):
        raise _type_error(name, "a string", v)
    return v


def _object(body: Mapping, name: str) -> dict | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, dict):
        raise _type_error(name, "an object", v)
    return v


def _decode_body(body: bytes | str) -> dict[str, Any]:
    try:
        obj = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}.", None, "invalid_json") from None
    if not isinstance(obj, dict):
        raise bad_request(f"The request body must be a JSON object, got {_tname(obj)}.", None, "invalid_json")
    return obj


def _check_model(body: Mapping, served_model: str | Iterable[str]) -> str:
    names = [served_model] if isinstance(served_model, str) else list(served_model)
    model = _str(body, "model")
    if model is None:  # lenient (like vLLM): no model means the served one
        return names[0]
    if model not in names:
        raise not_found_model(model)
    return model


# =============================================================================================
# requests
# =============================================================================================


@dataclass
class ChatRequest:
    """A validated /v1/chat/completions request."""

    model: str
    messages: list[dict[str, Any]]
    stream: bool = False
    include_usage: bool = False
    n: int = 1
    sampling: dict[str, Any] = field(default_factory=dict)  # fields the client set, SamplingMsg names
    max_tokens_param: str | None = None  # the field the client used for max_tokens
    logprobs: bool = False
    top_logprobs: int = 0
    tools: list[dict[str, Any]] | None = None  # None when absent, empty or tool_choice "none"
    tool_choice: Literal["auto", "none"] = "none"
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    reasoning_effort: str | None = None
    return_token_ids: bool = False
    user: str | None = None

    kind = "chat"

    @property
    def thinking(self) -> bool:
        """The template opens a think block (the default) unless `{"thinking": false}`."""
        v = self.chat_template_kwargs.get("thinking")
        return v is None or bool(v)


@dataclass
class CompletionRequest:
    """A validated /v1/completions request; `prompts` has one entry per engine request."""

    model: str
    prompts: list[str | list[int]]
    stream: bool = False
    include_usage: bool = False
    n: int = 1
    sampling: dict[str, Any] = field(default_factory=dict)
    max_tokens_param: str | None = None
    logprobs: int | None = None  # None: no logprobs; k: token logprobs + top k
    return_token_ids: bool = False
    user: str | None = None

    kind = "completion"

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n


def _parse_sampling(body: Mapping, *, max_n: int, completion: bool) -> tuple[dict[str, Any], str | None, int]:
    s: dict[str, Any] = {}
    for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
        v = _number(body, name)
        if v is not None:
            s[name] = float(v)
    for name in ("top_k", "min_tokens"):
        v = _int(body, name)
        if v is not None:
            s[name] = v
    seed = _int(body, "seed")
    if seed is not None:
        if not _SEED_MIN <= seed <= _SEED_MAX:
            raise _value_error("seed", f"must fit in 64 bits, got {seed}.")
        s["seed"] = seed
    ignore_eos = _bool(body, "ignore_eos")
    if ignore_eos is not None:
        s["ignore_eos"] = ignore_eos

    max_param = None
    for name in (("max_tokens",) if completion else ("max_completion_tokens", "max_tokens")):
        v = _int(body, name)
        if v is not None:
            s["max_tokens"], max_param = v, name
            break

    n = _int(body, "n")
    n = 1 if n is None else n
    if not 1 <= n <= max_n:
        raise _value_error("n", f"must be between 1 and {max_n}, got {n}.")
    s["n"] = n

    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list):
            raise _type_error("stop", "a string or an array of strings", stop)
        if len(stop) > MAX_STOP_SEQUENCES:
            raise _value_error("stop", f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed, got {len(stop)}.")
        for i, x in enumerate(stop):
            if not isinstance(x, str):
                raise _type_error(f"stop[{i}]", "a string", x)
            if not x:
                raise _value_error(f"stop[{i}]", "stop sequences must not be empty.")
        if stop:
            s["stop"] = list(dict.fromkeys(stop))

    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list):
            raise _type_error("stop_token_ids", "an array of integers", ids)
        out = []
        for i, x in enumerate(ids):
            x = _as_int(x, f"stop_token_ids[{i}]")
            if x < 0:
                raise _value_error(f"stop_token_ids[{i}]", f"token ids are non-negative, got {x}.")
            out.append(x)
        if out:
            s["stop_token_ids"] = out
    return s, max_param, n


def _common_options(body: Mapping) -> tuple[bool, bool]:
    stream = bool(_bool(body, "stream"))
    opts = _object(body, "stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise bad_request("The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                              "stream_options", "invalid_value")
        v = opts.get("include_usage")
        if v is not None and not isinstance(v, bool):
            raise _type_error("stream_options.include_usage", "a boolean", v)
        include_usage = bool(v)
    return stream, include_usage


def _reject_unsupported(body: Mapping, completion: bool, n: int = 1) -> None:
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise _type_error("logit_bias", "an object", bias)
        if bias:
            raise not_supported("logit_bias is not supported yet.", "logit_bias")
    if completion:
        if body.get("echo"):
            raise not_supported("echo is not supported yet.", "echo")
        if body.get("suffix"):
            raise not_supported("suffix is not supported yet.", "suffix")
        best_of = body.get("best_of")
        if best_of is not None:
            if _as_int(best_of, "best_of") != n:
                raise not_supported("best_of other than n is not supported yet.", "best_of")
    else:
        rf = body.get("response_format")
        if rf is not None:
            if not isinstance(rf, dict):
                raise _type_error("response_format", "an object", rf)
            if rf.get("type") != "text":
                raise not_supported(f"response_format {rf.get('type')!r} is not supported yet (structured output "
                                    "is not implemented); use {\"type\": \"text\"}.", "response_format")
        if body.get("functions") or body.get("function_call"):
            param = "functions" if body.get("functions") else "function_call"
            raise not_supported("The deprecated functions/function_call parameters are not supported; use tools "
                                "and tool_choice.", param)


def _return_token_ids(body: Mapping) -> bool:
    return bool(_bool(body, "return_token_ids"))


# ---------------------------------------------------------------------------------------------
# chat
# ---------------------------------------------------------------------------------------------

_ROLES = ("system", "developer", "user", "assistant", "tool")
_IMAGE_TYPES = ("image_url", "image")
_VIDEO_TYPES = ("video_url", "video")


def _check_content(content: Any, role: str, p: str) -> None:
    if content is None:
        if role in ("assistant",):
            return
        raise bad_request(f"Missing content for a '{role}' message.", p, "missing_required_parameter")
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise _type_error(p, "a string or an array of content parts", content)
    media_ok = role == "user"
    for j, part in enumerate(content):
        pp = f"{p}[{j}]"
        if not isinstance(part, dict):
            raise _type_error(pp, "an object", part)
        t = part.get("type")
        if not isinstance(t, str):
            raise bad_request(f"Missing or invalid 'type' in content part '{pp}'.", f"{pp}.type", "invalid_value")
        if t == "text":
            if not isinstance(part.get("text"), str):
                raise _type_error(f"{pp}.text", "a string", part.get("text"))
        elif t in _IMAGE_TYPES or t in _VIDEO_TYPES:
            if not media_ok:
                raise bad_request(f"Content part type '{t}' is only allowed in 'user' messages.", f"{pp}.type",
                                  "invalid_value")
            key = t if t.endswith("_url") else None
            if key is not None:
                ref = part.get(key)
                url = ref.get("url") if isinstance(ref, dict) else ref
                if not isinstance(url, str) or not url:
                    raise bad_request(f"Content part '{pp}' needs '{key}.url' as a string.", f"{pp}.{key}.url",
                                      "invalid_value")
        else:
            raise not_supported(f"Content part type '{t}' in '{pp}' is not supported; use text, image_url or "
                                "video_url.",
                                f"{pp}.type")


def _check_tool_calls(calls: Any, p: str) -> None:
    if not isinstance(calls, list):
        raise _type_error(p, "an array", calls)
    for j, call in enumerate(calls):
        pp = f"{p}[{j}]"
        if not isinstance(call, dict):
            raise _type_error(pp, "an object", call)
        if call.get("type", "function") != "function":
            raise not_supported(f"Tool call type {call.get('type')!r} is not supported.", f"{pp}.type")
        fn = call.get("function")
        if not isinstance(fn, dict):
            raise _type_error(f"{pp}.function", "an object", fn)
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"'{pp}.function.name' must be a non-empty string.", f"{pp}.function.name",
                              "invalid_value")
        args = fn.get("arguments")
        if isinstance(args, str):
            if args.strip():
                try:
                    parsed = json.loads(args)
                except ValueError:
                    raise _value_error(f"{pp}.function.arguments", "must be a JSON object encoded as a string.") \
                        from None
                if not isinstance(parsed, dict):
                    raise _value_error(f"{pp}.function.arguments", "must encode a JSON object.")
        elif args is not None and not isinstance(args, dict):
            raise _type_error(f"{pp}.function.arguments", "a string", args)


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    if messages is None:
        raise bad_request("Missing required parameter: 'messages'.", "messages", "missing_required_parameter")
    if not isinstance(messages, list):
        raise _type_error("messages", "an array", messages)
    if not messages:
        raise bad_request("'messages' must contain at least one message.", "messages", "empty_array")
    for i, m in enumerate(messages):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _type_error(p, "an object", m)
        role = m.get("role")
        if not isinstance(role, str):
            raise bad_request(f"Missing or invalid 'role' in '{p}'.", f"{p}.role", "invalid_value")
        if role not in _ROLES:
            raise bad_request(f"Invalid value for '{p}.role': {role!r}; expected one of {', '.join(_ROLES)}.",
                              f"{p}.role", "invalid_value")
        if "content" not in m and role != "assistant":
            raise bad_request(f"Missing required parameter: '{p}.content'.", f"{p}.content",
                              "missing_required_parameter")
        _check_content(m.get("content"), role, f"{p}.content")
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise _type_error(f"{p}.name", "a string", m["name"])
        if role == "assistant":
            if m.get("tool_calls") is not None:
                _check_tool_calls(m["tool_calls"], f"{p}.tool_calls")
            rc = m.get("reasoning_content")
            if rc is not None and not isinstance(rc, str):
                raise _type_error(f"{p}.reasoning_content", "a string", rc)
        if role == "tool" and m.get("tool_call_id") is not None and not isinstance(m["tool_call_id"], str):
            raise _type_error(f"{p}.tool_call_id", "a string", m["tool_call_id"])
    return messages


def _check_tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _type_error("tools", "an array", tools)
    for i, tool in enumerate(tools):
        p = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _type_error(p, "an object", tool)
        if tool.get("type", "function") != "function":
            raise not_supported(f"Tool type {tool.get('type')!r} is not supported; only 'function' tools are.",
                                f"{p}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise bad_request(f"Missing required parameter: '{p}.function'.", f"{p}.function",
                              "missing_required_parameter")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"'{p}.function.name' must be a non-empty string.", f"{p}.function.name",
                              "invalid_value")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise _type_error(f"{p}.function.description", "a string", fn["description"])
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise _type_error(f"{p}.function.parameters", "an object", fn["parameters"])
    return tools or None


def _check_tool_choice(choice: Any, has_tools: bool) -> Literal["auto", "none"]:
    if choice is None:
        return "auto" if has_tools else "none"
    if isinstance(choice, str):
        if choice in ("auto", "none"):
            return choice  # type: ignore[return-value]
        if choice == "required":
            raise not_supported("tool_choice 'required' is not supported yet (it needs constrained decoding); "
                                "use 'auto'.", "tool_choice")
        raise _value_error("tool_choice", f"expected 'none', 'auto' or 'required', got {choice!r}.")
    if isinstance(choice, dict):
        raise not_supported("A named or allowed-tools tool_choice is not supported yet (it needs constrained "
                            "decoding); use 'auto'.", "tool_choice")
    raise _type_error("tool_choice", "a string or an object", choice)


def _check_template_kwargs(body: Mapping) -> dict[str, Any]:
    kw = _object(body, "chat_template_kwargs")
    kw = dict(kw or {})
    if kw.get("thinking") is None and isinstance(kw.get("enable_thinking"), bool):
        kw["thinking"] = kw["enable_thinking"]  # Qwen/SGLang spelling
    if kw.get("thinking") is not None and not isinstance(kw["thinking"], bool):
        raise _type_error("chat_template_kwargs.thinking", "a boolean", kw["thinking"])
    return kw


def parse_chat_request(body: bytes | str, served_model: str | Iterable[str], *, max_n: int = MAX_N,
                       max_model_len: int | None = None) -> ChatRequest:
    """Decodes and validates a chat request; raises APIError (400/404) naming the bad field."""
    obj = _decode_body(body)
    model = _check_model(obj, served_model)
    messages = _check_messages(obj.get("messages"))
    _reject_unsupported(obj, completion=False)
    stream, include_usage = _common_options(obj)
    sampling, max_param, n = _parse_sampling(obj, max_n=max_n, completion=False)

    logprobs = bool(_bool(obj, "logprobs"))
    top = _int(obj, "top_logprobs")
    if top is not None:
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise _value_error("top_logprobs", f"must be between 0 and {MAX_TOP_LOGPROBS}, got {top}.")
        if top > 0 and not logprobs:
            raise bad_request("'top_logprobs' requires 'logprobs' to be true.", "top_logprobs", "invalid_value")
    top = top or 0
    if logprobs:
        sampling["logprobs"] = True
        sampling["top_logprobs"] = top

    tools = _check_tools(obj.get("tools"))
    tool_choice = _check_tool_choice(obj.get("tool_choice"), tools is not None)
    ptc = _bool(obj, "parallel_tool_calls")
    effort = _str(obj, "reasoning_effort")
    req = ChatRequest(
        model=model, messages=messages, stream=stream, include_usage=include_usage, n=n, sampling=sampling,
        max_tokens_param=max_param, logprobs=logprobs, top_logprobs=top,
        tools=tools if tool_choice == "auto" else None, tool_choice=tool_choice,
        parallel_tool_calls=True if ptc is None else ptc, chat_template_kwargs=_check_template_kwargs(obj),
        reasoning_effort=effort, return_token_ids=_return_token_ids(obj), user=_user(obj),
    )
    to_sampling_msg(req, max_model_len=max_model_len)  # range checks now, as a 400
    return req


def _user(body: Mapping) -> str | None:
    v = body.get("user")
    return v if isinstance(v, str) else None


# ---------------------------------------------------------------------------------------------
# completions
# ---------------------------------------------------------------------------------------------


def _token_list(v: list, p: str) -> list[int]:
    if not v:
        raise bad_request(f"'{p}' must not be empty.", p, "empty_array")
    out = []
    for i, x in enumerate(v):
        x = _as_int(x, f"{p}[{i}]")
        if x < 0:
            raise _value_error(f"{p}[{i}]", f"token ids are non-negative, got {x}.")
        out.append(x)
    return out


def _check_prompt(prompt: Any) -> list[str | list[int]]:
    if prompt is None:
        raise bad_request("Missing required parameter: 'prompt'.", "prompt", "missing_required_parameter")
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' must not be empty.", "prompt", "invalid_value")
        return [prompt]
    if not isinstance(prompt, list):
        raise _type_error("prompt", "a string, an array of strings, an array of token ids or an array of "
                                    "token-id arrays", prompt)
    if not prompt:
        raise bad_request("'prompt' must not be empty.", "prompt", "empty_array")
    first = prompt[0]
    if isinstance(first, str):
        for i, x in enumerate(prompt):
            if not isinstance(x, str):
                raise _type_error(f"prompt[{i}]", "a string (all prompts of a list share one type)", x)
            if not x:
                raise bad_request(f"'prompt[{i}]' must not be empty.", f"prompt[{i}]", "invalid_value")
        return list(prompt)
    if isinstance(first, list):
        out: list[str | list[int]] = []
        for i, x in enumerate(prompt):
            if not isinstance(x, list):
                raise _type_error(f"prompt[{i}]", "an array of token ids (all prompts of a list share one type)", x)
            out.append(_token_list(x, f"prompt[{i}]"))
        return out
    return [_token_list(prompt, "prompt")]


def parse_completion_request(body: bytes | str, served_model: str | Iterable[str], *, max_n: int = MAX_N,
                             max_model_len: int | None = None) -> CompletionRequest:
    """Decodes and validates a completions request; raises APIError (400/404) naming the bad field."""
    obj = _decode_body(body)
    model = _check_model(obj, served_model)
    prompts = _check_prompt(obj.get("prompt"))
    stream, include_usage = _common_options(obj)
    sampling, max_param, n = _parse_sampling(obj, max_n=max_n, completion=True)
    _reject_unsupported(obj, completion=True, n=n)
    logprobs = _int(obj, "logprobs")
    if logprobs is not None:
        if not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise _value_error("logprobs", f"must be between 0 and {MAX_TOP_LOGPROBS}, got {logprobs}.")
        sampling["logprobs"] = True
        sampling["top_logprobs"] = logprobs
    req = CompletionRequest(model=model, prompts=prompts, stream=stream, include_usage=include_usage, n=n,
                            sampling=sampling, max_tokens_param=max_param, logprobs=logprobs,
                            return_token_ids=_return_token_ids(obj), user=_user(obj))
    to_sampling_msg(req, max_model_len=max_model_len)
    return req


# =============================================================================================
# request -> wire
# =============================================================================================


def to_sampling_msg(req: ChatRequest | CompletionRequest, *, defaults: Mapping[str, Any] | None = None,
                    max_model_len: int | None = None, vocab_size: int | None = None) -> SamplingMsg:
    """The request's SamplingMsg, range-checked by SamplingParams.validate (ValueError -> 400).

    `defaults` is the checkpoint's generation_config.json (its temperature, top_p, top_k,
    min_p, repetition_penalty and do_sample fill what the client did not set). Without
    max_tokens, chat asks for `max_model_len` tokens (the rest of the context once the
    tokenizer caps it) and completions for 16.
    """
    fields = dict(req.sampling)
    stop = fields.pop("stop", [])
    if "max_tokens" not in fields:
        if req.kind == "chat":
            fields["max_tokens"] = max_model_len if max_model_len is not None else _UNBOUNDED_MAX_TOKENS
        else:
            fields["max_tokens"] = 16
    try:
        params = SamplingParams.from_generation_config(dict(defaults or {}), **fields)
        params.validate(vocab_size)
    except ValueError as exc:
        msg = str(exc)
        param = msg.split(" ", 1)[0]
        if param == "max_tokens" and req.max_tokens_param:
            param = req.max_tokens_param
            msg = param + msg[len("max_tokens"):]
        if param == "top_logprobs" and req.kind == "completion":
            param = "logprobs"
        raise bad_request(f"Invalid value for '{param}': {msg}.", param, "invalid_value") from None
    return SamplingMsg(
        temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, min_p=params.min_p,
        frequency_penalty=params.frequency_penalty, presence_penalty=params.presence_penalty,
        repetition_penalty=params.repetition_penalty, seed=params.seed, stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos, max_tokens=params.max_tokens, min_tokens=params.min_tokens,
        logprobs=params.logprobs, top_logprobs=params.top_logprobs, n=params.n, stop=list(stop),
    )


def sub_rid(rid: str, prompt_index: int, num_prompts: int) -> str:
    """The engine-request id of prompt `prompt_index` of a request with `num_prompts` prompts."""
    return rid if num_prompts == 1 else f"{rid}-{prompt_index}"


def to_tokenize_request(req: ChatRequest | CompletionRequest, rid: str, reply_to: str, *, prompt_index: int = 0,
                        sampling: SamplingMsg | None = None, arrival: float = 0.0, engine: str | None = None,
                        decode: str | None = None) -> TokenizeRequest:
    """The TokenizeRequest for a chat request, or for prompt `prompt_index` of a completion
    (`rid` is used as given: pass `sub_rid(...)` for multi-prompt completions)."""
    sampling = sampling if sampling is not None else to_sampling_msg(req)
    common = dict(rid=rid, sampling=sampling, reply_to=reply_to, stream=req.stream,
                  return_token_ids=req.return_token_ids, engine=engine, decode=decode, arrival=arrival)
    if isinstance(req, ChatRequest):
        return TokenizeRequest(kind="chat", messages=req.messages, tools=req.tools,
                               chat_template_kwargs=dict(req.chat_template_kwargs),
                               reasoning_effort=req.reasoning_effort, **common)
    return TokenizeRequest(kind="completion", prompt=req.prompts[prompt_index], **common)


def to_tokenize_requests(req: ChatRequest | CompletionRequest, rid: str, reply_to: str, *,
                         sampling: SamplingMsg | None = None, arrival: float = 0.0) -> list[TokenizeRequest]:
    """One TokenizeRequest per engine request (one for chat, one per prompt for completions)."""
    sampling = sampling if sampling is not None else to_sampling_msg(req)
    if isinstance(req, ChatRequest):
        return [to_tokenize_request(req, rid, reply_to, sampling=sampling, arrival=arrival)]
    k = len(req.prompts)
    return [to_tokenize_request(req, sub_rid(rid, i, k), reply_to, prompt_index=i, sampling=sampling,
                                arrival=arrival) for i in range(k)]


# =============================================================================================
# responses
# =============================================================================================


def new_request_id(kind: Literal["chat", "completion"] = "chat") -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)


def usage_json(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class UsageTotals:
    """Sums per-choice `Usage`s: a prompt counts once per engine request (rid), however many
    choices it has; completion tokens add up over every choice."""

    def __init__(self) -> None:
        self._prompt: dict[str, tuple[int, int]] = {}
        self.completion_tokens = 0

    def add(self, rid: str, usage: Usage) -> None:
        p, c = self._prompt.get(rid, (0, 0))
        self._prompt[rid] = (max(p, usage.prompt_tokens), max(c, usage.cached_tokens))
        self.completion_tokens += usage.completion_tokens

    @property
    def prompt_tokens(self) -> int:
        return sum(p for p, _ in self._prompt.values())

    @property
    def cached_tokens(self) -> int:
        return sum(c for _, c in self._prompt.values())

    def to_json(self) -> dict[str, Any]:
        return usage_json(self.prompt_tokens, self.completion_tokens, self.cached_tokens)


def _finite(lp: float) -> float:
    return lp if math.isfinite(lp) else LOGPROB_FLOOR


def _token_bytes(token: str) -> list[int]:
    """UTF-8 bytes of a logprob token; a `bytes:\\xe4\\xbd` escape (a token that is not valid
    UTF-8 alone, as vLLM writes it) gives the raw bytes it names."""
    if token.startswith("bytes:"):
        esc = token[len("bytes:"):]
        try:
            raw = esc.encode("latin-1").decode("unicode_escape").encode("latin-1")
            return list(raw)
        except (UnicodeError, ValueError):
            pass
    return list(token.encode("utf-8", "surrogatepass"))


def chat_logprob_entries(lps: Iterable[TokenLogprob]) -> list[dict[str, Any]]:
    """OpenAI chat `logprobs.content` entries."""
    return [{"token": lp.token, "logprob": _finite(lp.logprob), "bytes": _token_bytes(lp.token),
             "top_logprobs": [{"token": t.token, "logprob": _finite(t.logprob), "bytes": _token_bytes(t.token)}
                              for t in lp.top_logprobs]}
            for lp in lps]


def completion_logprobs(lps: Iterable[TokenLogprob], offset: int = 0) -> tuple[dict[str, Any], int]:
    """OpenAI completions `logprobs` for tokens whose text starts at `offset`; returns it and
    the offset after them (offsets add up token texts, as vLLM's do)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in lps:
        tokens.append(lp.token)
        token_lps.append(_finite(lp.logprob))
        tops.append({t.token: _finite(t.logprob) for t in lp.top_logprobs})
        offsets.append(offset)
        offset += len(lp.token)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, offset


def _map_finish(reason: str | None, had_tools: bool, kind: str) -> str:
    if reason is None:
        reason = "stop"
    if kind == "chat":
        if had_tools and reason == "stop":
            return "tool_calls"
        if reason == "tool_calls" and not had_tools:  # the calls were dropped (parallel_tool_calls)
            return "stop"
        return reason if reason in _CHAT_FINISH else "stop"
    return reason if reason in _COMPLETION_FINISH else "stop"


class _ChoiceState:
    """What one choice has shown so far (shared by the accumulator and the streams)."""

    __slots__ = ("started", "finished", "tool_ids", "text_offset", "usage", "parallel_tool_calls")

    def __init__(self, parallel_tool_calls: bool = True) -> None:
        self.started = False
        self.finished = False
        self.tool_ids: dict[int, str] = {}  # kept tool-call index -> id
        self.text_offset = 0
        self.usage: Usage | None = None
        self.parallel_tool_calls = parallel_tool_calls

    def keep_tool_deltas(self, deltas: Iterable[ToolCallDelta]) -> list[ToolCallDelta]:
        kept = []
        for d in deltas:
            if not self.parallel_tool_calls and d.index > 0:
                continue
            if d.index not in self.tool_ids:
                self.tool_ids[d.index] = d.id or f"call_{secrets.token_hex(12)}"
            kept.append(d)
        return kept

    @property
    def had_tools(self) -> bool:
        return bool(self.tool_ids)


class ChoiceAccumulator:
    """Folds the TextOut stream of one choice into the final, non-streamed choice."""

    def __init__(self, index: int = 0, *, kind: Literal["chat", "completion"] = "chat", logprobs: bool = False,
                 return_token_ids: bool = False, parallel_tool_calls: bool = True) -> None:
        self.index = index
        self.kind = kind
        self.logprobs = logprobs
        self.return_token_ids = return_token_ids
        self._state = _ChoiceState(parallel_tool_calls)
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self._calls: dict[int, dict[str, Any]] = {}  # index -> {"id", "name", "arguments": [..]}
        self._lps: list[TokenLogprob] = []
        self.token_ids: list[int] = []
        self.prompt_token_ids: list[int] | None = None
        self.finish_reason: str | None = None
        self.usage: Usage | None = None

    @property
    def finished(self) -> bool:
        return self._state.finished

    def add(self, out: TextOut) -> None:
        if out.text:
            self._text.append(out.text)
        if out.reasoning:
            self._reasoning.append(out.reasoning)
        for d in self._state.keep_tool_deltas(out.tool_calls):
            call = self._calls.setdefault(d.index, {"id": self._state.tool_ids[d.index], "name": "", "arguments": []})
            if d.name:
                call["name"] += d.name
            if d.arguments:
                call["arguments"].append(d.arguments)
        if out.logprobs:
            self._lps.extend(out.logprobs)
        self.token_ids.extend(out.token_ids)
        if out.prompt_token_ids is not None and self.prompt_token_ids is None:
            self.prompt_token_ids = list(out.prompt_token_ids)
        if out.usage is not None:
            self.usage = out.usage
        if out.finished:
            self._state.finished = True
            self.finish_reason = out.finish_reason

    @property
    def text(self) -> str:
        return "".join(self._text)

    @property
    def reasoning(self) -> str | None:
        return "".join(self._reasoning) or None

    def tool_calls(self) -> list[dict[str, Any]]:
        return [{"id": c["id"], "type": "function",
                 "function": {"name": c["name"], "arguments": "".join(c["arguments"]) or "{}"}}
                for _, c in sorted(self._calls.items())]

    def chat_choice(self) -> dict[str, Any]:
        calls = self.tool_calls()
        text = self.text
        message: dict[str, Any] = {"role": "assistant", "content": text if (text or not calls) else None,
                                   "reasoning_content": self.reasoning}
        if calls:
            message["tool_calls"] = calls
        choice: dict[str, Any] = {
            "index": self.index, "message": message,
            "logprobs": {"content": chat_logprob_entries(self._lps)} if self.logprobs else None,
            "finish_reason": _map_finish(self.finish_reason, bool(calls), "chat"),
        }
        if self.return_token_ids:
            choice["token_ids"] = list(self.token_ids)
        return choice

    def completion_choice(self) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": self.index, "text": self.text,
            "logprobs": completion_logprobs(self._lps)[0] if self.logprobs else None,
            "finish_reason": _map_finish(self.finish_reason, False, "completion"),
        }
        if self.return_token_ids:
            choice["token_ids"] = list(self.token_ids)
            choice["prompt_token_ids"] = self.prompt_token_ids
        return choice


def chat_completion_response(id: str, model: str, created: int, choices: list[dict[str, Any]],
                             usage: dict[str, Any] | None, *, prompt_token_ids: list[int] | None = None
                             ) -> dict[str, Any]:
    resp: dict[str, Any] = {"id": id, "object": "chat.completion", "created": created, "model": model,
                            "choices": sorted(choices, key=lambda c: c["index"]), "usage": usage}
    if prompt_token_ids is not None:
        resp["prompt_token_ids"] = prompt_token_ids
    return resp


def completion_response(id: str, model: str, created: int, choices: list[dict[str, Any]],
                        usage: dict[str, Any] | None) -> dict[str, Any]:
    return {"id": id, "object": "text_completion", "created": created, "model": model,
            "choices": sorted(choices, key=lambda c: c["index"]), "usage": usage}


# ---------------------------------------------------------------------------------------------
# streaming
# ---------------------------------------------------------------------------------------------


def chat_chunk(id: str, model: str, created: int, choices: list[dict[str, Any]],
               usage: dict[str, Any] | None = None, *, include_usage: bool = False) -> dict[str, Any]:
    chunk: dict[str, Any] = {"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                             "choices": choices}
    if include_usage or usage is not None:
        chunk["usage"] = usage
    return chunk


def completion_chunk(id: str, model: str, created: int, choices: list[dict[str, Any]],
                     usage: dict[str, Any] | None = None, *, include_usage: bool = False) -> dict[str, Any]:
    chunk: dict[str, Any] = {"id": id, "object": "text_completion", "created": created, "model": model,
                             "choices": choices}
    if include_usage or usage is not None:
        chunk["usage"] = usage
    return chunk


def usage_chunk(id: str, model: str, created: int, usage: dict[str, Any], *,
                kind: Literal["chat", "completion"] = "chat") -> dict[str, Any]:
    """The last chunk when `stream_options.include_usage`: no choices, usage set."""
    build = chat_chunk if kind == "chat" else completion_chunk
    return build(id, model, created, [], usage)


def _tool_call_delta_json(d: ToolCallDelta, call_id: str, first: bool) -> dict[str, Any]:
    fn: dict[str, Any] = {}
    if d.name is not None or first:
        fn["name"] = d.name or ""
    fn["arguments"] = d.arguments or ""
    out: dict[str, Any] = {"index": d.index}
    if first:
        out["id"] = call_id
        out["type"] = "function"
    out["function"] = fn
    return out


class _Stream:
    kind: Literal["chat", "completion"]

    def __init__(self, id: str, model: str, created: int, *, include_usage: bool = False, logprobs: bool = False,
                 return_token_ids: bool = False, parallel_tool_calls: bool = True) -> None:
        self.id, self.model, self.created = id, model, created
        self.include_usage = include_usage
        self.logprobs = logprobs
        self.return_token_ids = return_token_ids
        self.parallel_tool_calls = parallel_tool_calls
        self.usage = UsageTotals()
        self._choices: dict[int, _ChoiceState] = {}

    def _state(self, index: int) -> _ChoiceState:
        st = self._choices.get(index)
        if st is None:
            st = self._choices[index] = _ChoiceState(self.parallel_tool_calls)
        return st

    @property
    def finished_choices(self) -> int:
        return sum(1 for s in self._choices.values() if s.finished)

    def _note_finish(self, out: TextOut, st: _ChoiceState) -> None:
        if out.finished:
            st.finished = True
            if out.usage is not None:
                st.usage = out.usage
                self.usage.add(out.rid, out.usage)

    def usage_chunk(self) -> dict[str, Any] | None:
        """The usage-only chunk, when the client asked for it (send it before SSE_DONE)."""
        if not self.include_usage:
            return None
        return usage_chunk(self.id, self.model, self.created, self.usage.to_json(), kind=self.kind)


class ChatStream(_Stream):
    """Turns TextOuts into chat.completion.chunk dicts (send each with `sse`)."""

    kind = "chat"

    def on_text(self, out: TextOut) -> list[dict[str, Any]]:
        st = self._state(out.index)
        chunks: list[dict[str, Any]] = []
        if not st.started:
            st.started = True
            first = chat_chunk(self.id, self.model, self.created,
                               [{"index": out.index, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}], include_usage=self.include_usage)
            if self.return_token_ids and out.prompt_token_ids is not None:
                first["prompt_token_ids"] = list(out.prompt_token_ids)
            chunks.append(first)
        delta: dict[str, Any] = {}
        if out.reasoning:
            delta["reasoning_content"] = out.reasoning
        if out.text:
            delta["content"] = out.text
        calls = []
        for d in out.tool_calls:
            first_of_call = d.index not in st.tool_ids
            if st.keep_tool_deltas([d]):
                calls.append(_tool_call_delta_json(d, st.tool_ids[d.index], first_of_call))
        if calls:
            delta["tool_calls"] = calls
        choice: dict[str, Any] = {"index": out.index, "delta": delta, "logprobs": None, "finish_reason": None}
        has_lps = self.logprobs and bool(out.logprobs)
        if has_lps:
            choice["logprobs"] = {"content": chat_logprob_entries(out.logprobs or [])}
        if self.return_token_ids:
            choice["token_ids"] = list(out.token_ids)
        if out.finished:
            choice["finish_reason"] = _map_finish(out.finish_reason, st.had_tools, "chat")
        self._note_finish(out, st)
        if delta or out.finished or has_lps or (self.return_token_ids and out.token_ids):
            chunks.append(chat_chunk(self.id, self.model, self.created, [choice], include_usage=self.include_usage))
        return chunks


class CompletionStream(_Stream):
    """Turns TextOuts into streamed text_completion chunk dicts; choice `i` of prompt `p` is
    index `p * n + i`."""

    kind = "completion"

    def __init__(self, id: str, model: str, created: int, *, n: int = 1, include_usage: bool = False,
                 logprobs: bool = False, return_token_ids: bool = False) -> None:
        super().__init__(id, model, created, include_usage=include_usage, logprobs=logprobs,
                         return_token_ids=return_token_ids)
        self.n = n

    def on_text(self, out: TextOut, prompt_index: int = 0) -> list[dict[str, Any]]:
        index = prompt_index * self.n + out.index
        st = self._state(index)
        choice: dict[str, Any] = {"index": index, "text": out.text, "logprobs": None, "finish_reason": None}
        has_lps = self.logprobs and bool(out.logprobs)
        if has_lps:
            choice["logprobs"], st.text_offset = completion_logprobs(out.logprobs or [], st.text_offset)
        if self.return_token_ids:
            choice["token_ids"] = list(out.token_ids)
            if not st.started:
                choice["prompt_token_ids"] = out.prompt_token_ids
        st.started = True
        if out.finished:
            choice["finish_reason"] = _map_finish(out.finish_reason, False, "completion")
        self._note_finish(out, st)
        if out.text or out.finished or has_lps or (self.return_token_ids and (out.token_ids or
                                                                            "prompt_token_ids" in choice)):
            return [completion_chunk(self.id, self.model, self.created, [choice], include_usage=self.include_usage)]
        return []


_ENCODER = msgspec.json.Encoder()
SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    """One server-sent event carrying `obj` as JSON."""
    return b"data: " + _ENCODER.encode(obj) + b"\n\n"


def sse_error(err: APIError) -> bytes:
    """An error in the middle of a stream (the status line is already sent): an event with
    the error JSON; follow it with SSE_DONE."""
    return sse(err.to_json())


def models_response(served_model: str | Iterable[str], created: int | None = None,
                    max_model_len: int | None = None) -> dict[str, Any]:
    names = [served_model] if isinstance(served_model, str) else list(served_model)
    created = int(time.time()) if created is None else created
    data = []
    for name in names:
        entry: dict[str, Any] = {"id": name, "object": "model", "created": created, "owned_by": "glmrt",
                                 "root": names[0], "parent": None}
        if max_model_len is not None:
            entry["max_model_len"] = max_model_len
        data.append(entry)
    return {"object": "list", "data": data}
