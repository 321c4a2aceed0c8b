"""Streamed answers: chat.completion.chunk / text_completion chunks built from TextOuts,
and their server-sent-event framing.

A chat stream's deltas accumulate (as the openai client's stream state sums them) to exactly
the non-streamed message: content, reasoning_content, tool calls and finish_reason. The role
chunk carries no content, so a choice that only calls tools sums to content null, and one
that says nothing gets `"content": ""` on its last chunk.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from glmrt.protocol import TextOut, ToolCallDelta
from glmrt.serving.openai_api.errors import APIError
from glmrt.serving.openai_api.responses import (ChoiceState, UsageTotals, chat_logprob_entries, completion_logprobs,
                                                finish_reason_for, response_index)


def _chunk(obj: str, id: str, model: str, created: int, choices: list[dict[str, Any]],
           usage: dict[str, Any] | None, include_usage: bool) -> dict[str, Any]:
    chunk: dict[str, Any] = {"id": id, "object": obj, "created": created, "model": model, "choices": choices}
    if include_usage or usage is not None:
        chunk["usage"] = usage
    return chunk


def chat_chunk(id: str, model: str, created: int, choices: list[dict[str, Any]],
               usage: dict[str, Any] | None = None, *, include_usage: bool = False) -> dict[str, Any]:
    return _chunk("chat.completion.chunk", id, model, created, choices, usage, include_usage)


def completion_chunk(id: str, model: str, created: int, choices: list[dict[str, Any]],
                     usage: dict[str, Any] | None = None, *, include_usage: bool = False) -> dict[str, Any]:
    return _chunk("text_completion", id, model, created, choices, usage, include_usage)


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
        self._prompt_ids_sent = False
        self.parallel_tool_calls = parallel_tool_calls
        self.usage = UsageTotals()
        self._choices: dict[int, ChoiceState] = {}

    def _state(self, index: int) -> ChoiceState:
        st = self._choices.get(index)
        if st is None:
            st = self._choices[index] = ChoiceState(self.parallel_tool_calls)
        return st

    @property
    def finished_choices(self) -> int:
        return sum(1 for s in self._choices.values() if s.finished)

    def _note_finish(self, out: TextOut, st: ChoiceState) -> None:
        if out.finished:
            st.finished = True
            if out.usage is not None:
                st.usage = out.usage
                self.usage.add(out.key.request, out.usage)

    def usage_chunk(self) -> dict[str, Any] | None:
        """The usage-only chunk, when the client asked for it (send it before SSE_DONE)."""
        if not self.include_usage:
            return None
        return usage_chunk(self.id, self.model, self.created, self.usage.to_json(), kind=self.kind)


class ChatStream(_Stream):
    """Turns TextOuts into chat.completion.chunk dicts (send each with `sse`)."""

    kind = "chat"

    def on_text(self, out: TextOut) -> list[dict[str, Any]]:
        index = out.key.choice
        st = self._state(index)
        chunks: list[dict[str, Any]] = []
        if not st.started:
            st.started = True
            first = chat_chunk(self.id, self.model, self.created,
                               [{"index": index, "delta": {"role": "assistant"},
                                 "logprobs": None, "finish_reason": None}], include_usage=self.include_usage)
            if self.return_token_ids and out.prompt_token_ids is not None and not self._prompt_ids_sent:
                first["prompt_token_ids"] = list(out.prompt_token_ids)  # the response's, once
                self._prompt_ids_sent = True
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
        st.text_sent = st.text_sent or bool(out.text)
        if out.finished and not st.text_sent and not st.had_tools:
            # The message's content is "" (null only beside tool calls), as in the
            # non-streamed answer: the role chunk carries none, so a client's sum is exact.
            delta["content"] = ""
        choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        has_lps = self.logprobs and bool(out.logprobs)
        if has_lps:
            choice["logprobs"] = {"content": chat_logprob_entries(out.logprobs or [])}
        if self.return_token_ids:
            choice["token_ids"] = list(out.token_ids)
        if out.finished:
            choice["finish_reason"] = finish_reason_for(out.finish_reason, st.had_tools, "chat")
            choice["stop_reason"] = out.stop_reason
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

    def on_text(self, out: TextOut) -> list[dict[str, Any]]:
        index = response_index(out.key, self.n)
        st = self._state(index)
        choice: dict[str, Any] = {"index": index, "text": out.text, "logprobs": None, "finish_reason": None}
        has_lps = self.logprobs and bool(out.logprobs)
        if has_lps:
            choice["logprobs"] = completion_logprobs(out.logprobs or [], st.text_offset)
        if self.return_token_ids:
            choice["token_ids"] = list(out.token_ids)
            if not st.started:
                choice["prompt_token_ids"] = out.prompt_token_ids
        st.started = True
        if out.finished:
            choice["finish_reason"] = finish_reason_for(out.finish_reason, False, "completion")
            choice["stop_reason"] = out.stop_reason
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

