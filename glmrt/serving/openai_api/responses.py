"""Non-streamed answers: usage, logprobs in OpenAI's shapes, the choice accumulator, the
chat.completion / text_completion bodies and the model list.

`finish_reason` becomes "tool_calls" when the choice made a call and stopped normally; a
choice cut by the length limit stays "length"; reasons the client types do not know (e.g.
"abort") are reported as "stop". `stop_reason` (vLLM's field) names the stop string or stop
token id that ended a choice, null when EOS or the length limit did. Non-finite logprobs (-inf
for a filtered token) are sent as -9999.0 (JSON has no inf).
"""

from __future__ import annotations

import codecs
import math
import secrets
import time
from collections.abc import Hashable, Iterable
from typing import Any, Literal

from glmrt.protocol import RequestKey, TextOut, TokenLogprob, ToolCallDelta, Usage

LOGPROB_FLOOR = -9999.0
_CHAT_FINISH = frozenset({"stop", "length", "tool_calls", "content_filter", "function_call"})
_COMPLETION_FINISH = frozenset({"stop", "length", "content_filter"})


def new_request_id(kind: Literal["chat", "completion"] = "chat") -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)


def response_index(key: RequestKey, n: int) -> int:
    """The `index` the client sees for choice `key.choice` of prompt `key.prompt` (n choices each)."""
    return key.prompt * n + key.choice


def usage_json(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
               spec_verify_ct: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; with speculative decoding also SGLang's `spec_verify_ct` (decode
    steps, each verifying a draft: completion_tokens / spec_verify_ct is the accepted length)."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens,
           "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if spec_verify_ct:
        out["spec_verify_ct"] = spec_verify_ct
    return out


class UsageTotals:
    """Sums per-choice `Usage`s: a prompt counts once per engine request (its RequestKey), however many
    choices it has; completion tokens add up over every choice."""

    def __init__(self) -> None:
        self._prompt: dict[Hashable, tuple[int, int]] = {}
        self.completion_tokens = 0
        self.spec_verify_ct = 0

    def add(self, prompt: Hashable, usage: Usage) -> None:
        p, c = self._prompt.get(prompt, (0, 0))
        self._prompt[prompt] = (max(p, usage.prompt_tokens), max(c, usage.cached_tokens))
        self.completion_tokens += usage.completion_tokens
        self.spec_verify_ct += usage.spec_verify_ct

    @property
    def prompt_tokens(self) -> int:
        return sum(p for p, _ in self._prompt.values())

    @property
    def cached_tokens(self) -> int:
        return sum(c for _, c in self._prompt.values())

    def to_json(self) -> dict[str, Any]:
        return usage_json(self.prompt_tokens, self.completion_tokens, self.cached_tokens, self.spec_verify_ct)


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


class TextOffsets:
    """Where each token of a completion starts in its text, in characters (OpenAI's
    `text_offset`): a token that ends inside a UTF-8 character adds nothing until the token
    that completes it adds the character."""

    def __init__(self) -> None:
        self.offset = 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def take(self, token: str) -> int:
        """The offset `token` starts at; the offset moves past its text."""
        start = self.offset
        self.offset += len(self._utf8.decode(bytes(_token_bytes(token))))
        return start


def completion_logprobs(lps: Iterable[TokenLogprob], offsets: TextOffsets | None = None) -> dict[str, Any]:
    """OpenAI completions `logprobs` for tokens that follow what `offsets` has seen (a stream
    keeps one per choice)."""
    offsets = offsets or TextOffsets()
    tokens, token_lps, tops, starts = [], [], [], []
    for lp in lps:
        tokens.append(lp.token)
        token_lps.append(_finite(lp.logprob))
        tops.append({t.token: _finite(t.logprob) for t in lp.top_logprobs})
        starts.append(offsets.take(lp.token))
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": starts}


def finish_reason_for(reason: str | None, had_tools: bool, kind: str) -> str:
    if reason is None:
        reason = "stop"
    if kind == "chat":
        if had_tools and reason == "stop":
            return "tool_calls"
        if reason == "tool_calls" and not had_tools:  # the calls were dropped (parallel_tool_calls)
            return "stop"
        return reason if reason in _CHAT_FINISH else "stop"
    return reason if reason in _COMPLETION_FINISH else "stop"


class ChoiceState:
    """What one choice has shown so far (shared by the accumulator and the streams)."""

    __slots__ = ("started", "finished", "tool_ids", "text_offset", "usage", "parallel_tool_calls", "text_sent")

    def __init__(self, parallel_tool_calls: bool = True) -> None:
        self.started = False
        self.text_sent = False
        self.finished = False
        self.tool_ids: dict[int, str] = {}  # kept tool-call index -> id
        self.text_offset = TextOffsets()
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
        self._state = ChoiceState(parallel_tool_calls)
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self._calls: dict[int, dict[str, Any]] = {}  # index -> {"id", "name", "arguments": [..]}
        self._lps: list[TokenLogprob] = []
        self.token_ids: list[int] = []
        self.prompt_token_ids: list[int] | None = None
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
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
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason

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
            "finish_reason": finish_reason_for(self.finish_reason, bool(calls), "chat"),
            "stop_reason": self.stop_reason,
        }
        if self.return_token_ids:
            choice["token_ids"] = list(self.token_ids)
        return choice

    def completion_choice(self) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": self.index, "text": self.text,
            "logprobs": completion_logprobs(self._lps) if self.logprobs else None,
            "finish_reason": finish_reason_for(self.finish_reason, False, "completion"),
            "stop_reason": self.stop_reason,
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
