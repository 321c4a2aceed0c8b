"""Request parsing and validation for /v1/chat/completions and /v1/completions, and the
mapping of a validated request to the TokenizeRequests the api sends.

A request's sampling fields become one `SamplingParams`, checked by its own `validate`
(a ValueError there is a 400 naming the field); that same object travels to the sampler.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from glmrt.protocol import RequestKey, TokenizeRequest
from glmrt.sampling_params import MAX_N, MAX_TOP_LOGPROBS, Grammar, SamplingParams
from glmrt.serving.openai_api.chat_messages import (check_media_count, check_messages, check_template_kwargs,
                                                    check_tool_choice, check_tools, thinking_on)
from glmrt.serving.openai_api.errors import bad_request, not_supported
from glmrt.serving.openai_api.structured import parse_structured, tool_call_grammar
from glmrt.serving.openai_api.fields import (as_int, check_model, decode_body, read_bool, read_float, read_int,
                                             read_object, read_str, read_token_ids, token_ids, type_error,
                                             value_error)

MAX_STOP_SEQUENCES = 16
MAX_PROMPTS = 1024   # prompts of one completions request (each is an engine request of its own)
_UNBOUNDED_MAX_TOKENS = 2**31 - 1


@dataclass
class ChatRequest:
    """A validated /v1/chat/completions request."""

    model: str
    messages: list[dict[str, Any]]
    stream: bool = False
    include_usage: bool = False
    n: int = 1
    sampling: dict[str, Any] = field(default_factory=dict)  # fields the client set, SamplingParams names
    max_tokens_param: str | None = None  # the field the client used for max_tokens
    logprobs: bool = False
    top_logprobs: int = 0
    tools: list[dict[str, Any]] | None = None  # None when absent, empty or tool_choice "none"
    tool_choice: str | dict[str, Any] = "none"  # "auto", "none", "required" or a named function
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    reasoning_effort: str | None = None
    return_token_ids: bool = False
    user: str | None = None
    grammar: Grammar | None = None  # structured output (response_format, regex, ebnf, a forced tool call)

    kind = "chat"

    @property
    def thinking(self) -> bool:
        """The template opens a think block (the default) unless `{"thinking": false}`."""
        return thinking_on(self.chat_template_kwargs)


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
    grammar: Grammar | None = None

    kind = "completion"

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n


# SamplingParams fields the body spells or checks its own way (read by `_parse_sampling` and the
# routes); every other field is read from the body under its own name, by its type.
_SAMPLING_SPECIAL = frozenset({"max_tokens", "n", "seed", "stop", "logprobs", "top_logprobs"})
_READ_BY_TYPE = {float: read_float, int: read_int, int | None: read_int, bool: read_bool, list[int]: read_token_ids}
# NOTE: a new field of a type without a reader fails here, at import, rather than being dropped
_SAMPLING_BY_TYPE = tuple((f.name, _READ_BY_TYPE[f.type]) for f in msgspec.structs.fields(SamplingParams)
                          if f.name not in _SAMPLING_SPECIAL)


def _parse_sampling(body: Mapping, *, max_n: int, completion: bool) -> tuple[dict[str, Any], str | None, int]:
    s: dict[str, Any] = {}
    for name, read in _SAMPLING_BY_TYPE:
        v = read(body, name)
        if v is not None:
            s[name] = v
    seed = read_int(body, "seed")   # any 64-bit integer (as_int), what a torch generator takes
    if seed is not None:
        s["seed"] = seed

    max_param = None
    for name in (("max_tokens",) if completion else ("max_completion_tokens", "max_tokens")):
        v = read_int(body, name)
        if v is not None:
            s["max_tokens"], max_param = v, name
            break

    n = read_int(body, "n")
    n = 1 if n is None else n
    if not 1 <= n <= max_n:
        raise value_error("n", f"must be between 1 and {max_n}, got {n}.")
    s["n"] = n

    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list):
            raise type_error("stop", "a string or an array of strings", stop)
        if len(stop) > MAX_STOP_SEQUENCES:
            raise value_error("stop", f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed, got {len(stop)}.")
        for i, x in enumerate(stop):
            if not isinstance(x, str):
                raise type_error(f"stop[{i}]", "a string", x)
            if not x:
                raise value_error(f"stop[{i}]", "stop sequences must not be empty.")
        if stop:
            s["stop"] = list(dict.fromkeys(stop))
    return s, max_param, n


def _common_options(body: Mapping) -> tuple[bool, bool]:
    stream = bool(read_bool(body, "stream"))
    opts = read_object(body, "stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise bad_request("The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                              "stream_options", "invalid_value")
        v = opts.get("include_usage")
        if v is not None and not isinstance(v, bool):
            raise type_error("stream_options.include_usage", "a boolean", v)
        include_usage = bool(v)
    return stream, include_usage


def _reject_unsupported(body: Mapping, completion: bool, n: int = 1) -> None:
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise type_error("logit_bias", "an object", bias)
        if bias:
            raise not_supported("logit_bias is not supported yet.", "logit_bias")
    if completion:
        if read_bool(body, "echo"):
            raise not_supported("echo is not supported yet.", "echo")
        if read_str(body, "suffix"):
            raise not_supported("suffix is not supported yet.", "suffix")
        best_of = body.get("best_of")
        if best_of is not None:
            if as_int(best_of, "best_of") != n:
                raise not_supported("best_of other than n is not supported yet.", "best_of")
    else:
        if body.get("functions") or body.get("function_call"):
            param = "functions" if body.get("functions") else "function_call"
            raise not_supported("The deprecated functions/function_call parameters are not supported; use tools "
                                "and tool_choice.", param)


def _return_token_ids(body: Mapping) -> bool:
    return bool(read_bool(body, "return_token_ids"))


# ---- chat ------------------------------------------------------------------------------


def parse_chat_request(body: bytes | str, served_model: str | Iterable[str], *, max_n: int = MAX_N,
                       max_model_len: int | None = None, mm_limits: Mapping[str, int] | None = None) -> ChatRequest:
    """Decodes and validates a chat request; raises APIError (400/404) naming the bad field.
    `mm_limits`: the most images / videos a request may carry (glmrt.mm_limits)."""
    obj = decode_body(body)
    model = check_model(obj, served_model)
    messages = check_messages(obj.get("messages"))
    if mm_limits is not None:
        check_media_count(messages, mm_limits)
    _reject_unsupported(obj, completion=False)
    stream, include_usage = _common_options(obj)
    sampling, max_param, n = _parse_sampling(obj, max_n=max_n, completion=False)

    logprobs = bool(read_bool(obj, "logprobs"))
    top = read_int(obj, "top_logprobs")
    if top is not None:
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise value_error("top_logprobs", f"must be between 0 and {MAX_TOP_LOGPROBS}, got {top}.")
        if top > 0 and not logprobs:
            raise bad_request("'top_logprobs' requires 'logprobs' to be true.", "top_logprobs", "invalid_value")
    top = top or 0
    if logprobs:
        sampling["logprobs"] = True
        sampling["top_logprobs"] = top

    tools = check_tools(obj.get("tools"))
    tool_choice = check_tool_choice(obj.get("tool_choice"), tools)
    ptc = read_bool(obj, "parallel_tool_calls")
    ptc = True if ptc is None else ptc
    effort = read_str(obj, "reasoning_effort")
    grammar = parse_structured(obj)
    if tool_choice not in ("auto", "none"):  # a forced call: the grammar makes the answer one
        if grammar is not None:
            raise bad_request("A forced tool call (tool_choice 'required' or a named function) cannot be combined "
                              "with another structured-output constraint.", "tool_choice", "invalid_value")
        grammar = tool_call_grammar(tools, tool_choice, ptc)
    req = ChatRequest(
        model=model, messages=messages, stream=stream, include_usage=include_usage, n=n, sampling=sampling,
        max_tokens_param=max_param, logprobs=logprobs, top_logprobs=top,
        tools=tools if tool_choice != "none" else None, tool_choice=tool_choice,
        parallel_tool_calls=ptc, chat_template_kwargs=check_template_kwargs(obj),
        reasoning_effort=effort, return_token_ids=_return_token_ids(obj), user=_user(obj), grammar=grammar,
    )
    to_sampling_params(req, max_model_len=max_model_len)  # range checks now, as a 400
    _check_grammar_sampling(req)
    return req


def _check_grammar_sampling(req: ChatRequest | CompletionRequest) -> None:
    """min_tokens would block the EOS a finished grammar allows as its only token."""
    if req.grammar is not None and req.sampling.get("min_tokens"):
        raise bad_request("min_tokens cannot be combined with structured output: the grammar decides where the "
                          "answer ends.", "min_tokens", "invalid_value")


def _user(body: Mapping) -> str | None:
    return read_str(body, "user")


# ---- completions -----------------------------------------------------------------------


def _token_list(v: list, p: str) -> list[int]:
    if not v:
        raise bad_request(f"'{p}' must not be empty.", p, "empty_array")
    return token_ids(v, p)


def _check_prompt(prompt: Any) -> list[str | list[int]]:
    if prompt is None:
        raise bad_request("Missing required parameter: 'prompt'.", "prompt", "missing_required_parameter")
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' must not be empty.", "prompt", "invalid_value")
        return [prompt]
    if not isinstance(prompt, list):
        raise type_error("prompt", "a string, an array of strings, an array of token ids or an array of "
                                    "token-id arrays", prompt)
    if not prompt:
        raise bad_request("'prompt' must not be empty.", "prompt", "empty_array")
    first = prompt[0]
    if isinstance(first, (str, list)) and len(prompt) > MAX_PROMPTS:
        raise value_error("prompt", f"at most {MAX_PROMPTS} prompts are allowed in one request, got {len(prompt)}.")
    if isinstance(first, str):
        for i, x in enumerate(prompt):
            if not isinstance(x, str):
                raise type_error(f"prompt[{i}]", "a string (all prompts of a list share one type)", x)
            if not x:
                raise bad_request(f"'prompt[{i}]' must not be empty.", f"prompt[{i}]", "invalid_value")
        return list(prompt)
    if isinstance(first, list):
        out: list[str | list[int]] = []
        for i, x in enumerate(prompt):
            if not isinstance(x, list):
                raise type_error(f"prompt[{i}]", "an array of token ids (all prompts of a list share one type)", x)
            out.append(_token_list(x, f"prompt[{i}]"))
        return out
    return [_token_list(prompt, "prompt")]


def parse_completion_request(body: bytes | str, served_model: str | Iterable[str], *, max_n: int = MAX_N,
                             max_model_len: int | None = None) -> CompletionRequest:
    """Decodes and validates a completions request; raises APIError (400/404) naming the bad field."""
    obj = decode_body(body)
    model = check_model(obj, served_model)
    prompts = _check_prompt(obj.get("prompt"))
    stream, include_usage = _common_options(obj)
    sampling, max_param, n = _parse_sampling(obj, max_n=max_n, completion=True)
    _reject_unsupported(obj, completion=True, n=n)
    logprobs = read_int(obj, "logprobs")
    if logprobs is not None:
        if not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise value_error("logprobs", f"must be between 0 and {MAX_TOP_LOGPROBS}, got {logprobs}.")
        sampling["logprobs"] = True
        sampling["top_logprobs"] = logprobs
    req = CompletionRequest(model=model, prompts=prompts, stream=stream, include_usage=include_usage, n=n,
                            sampling=sampling, max_tokens_param=max_param, logprobs=logprobs,
                            return_token_ids=_return_token_ids(obj), user=_user(obj), grammar=parse_structured(obj))
    to_sampling_params(req, max_model_len=max_model_len)
    _check_grammar_sampling(req)
    return req


# ---- request -> wire -------------------------------------------------------------------


def to_sampling_params(req: ChatRequest | CompletionRequest, *, defaults: Mapping[str, Any] | None = None,
                       max_model_len: int | None = None, vocab_size: int | None = None) -> SamplingParams:
    """The request's SamplingParams, range-checked by SamplingParams.validate (ValueError -> 400).

    `defaults` is the checkpoint's generation_config.json (its temperature, top_p, top_k,
    min_p, repetition_penalty and do_sample fill what the client did not set). Without
    max_tokens, chat asks for `max_model_len` tokens (the engine stops at the end of the
    context, with finish_reason "length") and completions for 16.
    """
    fields = dict(req.sampling)
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
    return params


def to_tokenize_request(req: ChatRequest | CompletionRequest, key: RequestKey, reply_to: str, *,
                        sampling: SamplingParams | None = None, arrival: float = 0.0, engine: str | None = None,
                        decode: str | None = None, max_model_len: int | None = None) -> TokenizeRequest:
    """The TokenizeRequest for a chat request, or for prompt `key.prompt` of a completion.

    An explicit max_tokens carries `max_model_len`: the tokenizer, which knows the prompt's
    length, refuses the request when prompt + max_tokens exceeds it. An omitted one carries
    None (the engine stops at the context's end)."""
    sampling = sampling if sampling is not None else to_sampling_params(req)
    limit = max_model_len if req.max_tokens_param is not None else None
    common = dict(key=key, sampling=sampling, reply_to=reply_to, stream=req.stream,
                  return_token_ids=req.return_token_ids, engine=engine, decode=decode, arrival=arrival,
                  max_model_len=limit, grammar=req.grammar)
    if isinstance(req, ChatRequest):
        return TokenizeRequest(kind="chat", messages=req.messages, tools=req.tools,
                               chat_template_kwargs=dict(req.chat_template_kwargs),
                               reasoning_effort=req.reasoning_effort, **common)
    return TokenizeRequest(kind="completion", prompt=req.prompts[key.prompt], **common)


def engine_request_count(req: ChatRequest | CompletionRequest) -> int:
    """The engine requests `req` makes: one for chat, one per prompt for completions (n forks each)."""
    return 1 if isinstance(req, ChatRequest) else len(req.prompts)


def to_tokenize_requests(req: ChatRequest | CompletionRequest, rid: str, reply_to: str, *,
                         sampling: SamplingParams | None = None, arrival: float = 0.0,
                         max_model_len: int | None = None) -> list[TokenizeRequest]:
    """One TokenizeRequest per engine request (one for chat, one per prompt for completions)."""
    sampling = sampling if sampling is not None else to_sampling_params(req)
    return [to_tokenize_request(req, RequestKey(rid=rid, prompt=i), reply_to, sampling=sampling, arrival=arrival,
                                max_model_len=max_model_len)
            for i in range(engine_request_count(req))]
