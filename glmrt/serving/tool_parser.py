"""The `glm47` tool-call parser: finds GLM-5.3 tool calls in the content text.

Runs in the detokenizer process (no torch). Format and rules: docs/PROTOCOLS.md.

Wire format, calls back to back, no newlines:
`<tool_call>NAME<arg_key>K1</arg_key><arg_value>V1</arg_value>...</tool_call>`.

Rules (the same for `Glm47ToolParser.parse` and the streaming `feed`/`finish`):

- Text outside calls is content, verbatim.
- A call starts at `<tool_call>`; NAME (whitespace-stripped) runs up to the first `<arg_key>`
  or `</tool_call>` after it, whichever comes first; the call ends at the first `</tool_call>`
  after the opening marker.
- Arguments are the `<arg_key>K</arg_key><arg_value>V</arg_value>` pairs of the call, in order
  (a repeated key keeps its last value; keys are whitespace-stripped; text between pairs is
  ignored). In a closed call a last value whose `</arg_value>` is missing runs to the end of
  the call. A call without pairs has arguments `{}` (vLLM drops such calls; we do not).
- Values are typed by the tool's JSON schema (glmrt/serving/tool_arguments.py). The schema
  is resolved fully against the parameters object (its `$defs` / `definitions`): the
  parameters' own `$ref` and `allOf` members add properties; a root `anyOf`/`oneOf` types the
  call by its first branch whose enum/const properties the call's values fit (a
  discriminator), else by all branches' properties; per property `$ref`, `anyOf` and `oneOf`
  (alternatives), `allOf` (intersected), type lists, `enum` and `const` apply. Then:
  a value the schema lists as an enum/const member is that member, typed as declared
  (`2` for `enum: [1, 2]`, "2" for `enum: ["1", "2"]`); a parameter whose only type is
  `string` keeps the raw text; otherwise the text is parsed as JSON - also after undoing
  backslash escapes, since GLM models write a non-string value as escaped JSON
  (`[{\\"id\\": \\"1\\"}]` is an array, `\\"123\\"` the integer 123) - and coerced to a
  declared type ("3" -> 3 for integer, 3.0 -> 3, "True" -> true, a Python-literal or doubly
  encoded array/object -> the value, ...); a schema that allows a string among other types
  gets the raw text unless the JSON value has one of the other types (the inverse of the
  chat template, which writes strings raw); what cannot be coerced is its JSON value, or the
  raw string when it is not JSON. Without a schema (unknown tool or parameter) the value is
  its JSON when it parses, else the raw string.
- A call whose NAME is empty is not a call: its text (markers included) is content.
- Calls to tools not in `tools` are still returned; the API may reject them.
- Each call gets an id `call_<24 hex>` and the next index (0, 1, 2, ...).
- An unterminated call at the end of the output (cut by the length limit, say):
  * if its NAME never completed (no `<arg_key>` after it), its text, `<tool_call>` included,
    is content;
  * otherwise it is still a call, with the arguments of its *complete* pairs only (a pair
    whose `</arg_value>` never came is dropped) and `ToolCall.complete = False`, so the API
    can tell (and report finish_reason "length" rather than "tool_calls").
  This follows from streaming: the call's id and name were already sent when NAME completed.

Streaming (`feed(delta) -> list[Delta]`, `finish() -> list[Delta]`):

- Content outside calls is emitted as it arrives, holding back a tail that could be the start
  of `<tool_call>`.
- When a call's NAME completes, one `ToolCallDelta(index, id, name)` is emitted; its arguments
  are buffered until `</tool_call>` and then emitted as ONE `ToolCallDelta(index,
  arguments=<the complete JSON object>)`; `finish()` closes an unterminated call the same way.

`parse` is the fold of one `feed` and `finish`. Invariant, tested over every 2- and 3-way
split and random splits: the concatenated streamed content equals `parse`'s content, and per
index the streamed name and concatenated arguments equal `parse`'s call.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any, Union

from glmrt.serving.tool_arguments import branch_for, convert_value, schema_branches

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
ARG_KEY_START = "<arg_key>"
ARG_KEY_END = "</arg_key>"
ARG_VALUE_START = "<arg_value>"
ARG_VALUE_END = "</arg_value>"

__all__ = [
    "ToolCall", "ContentDelta", "ToolCallDelta", "Delta", "Glm47ToolParser",
    "new_call_id", "convert_value",
]


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class ToolCall:
    id: str
    index: int
    name: str
    arguments_json: str
    complete: bool = True  # False: the output ended before this call's </tool_call>


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """Part of call `index`: first `id` and `name` (arguments None), then `arguments`."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


Delta = Union[ContentDelta, ToolCallDelta]


# ---------------------------------------------------------------------------- call bodies

def _parse_pairs(body: str, closed: bool) -> list[tuple[str, str]]:
    """The (key, raw value) pairs in a call body after its NAME (see module doc)."""
    pairs: list[tuple[str, str]] = []
    pos = 0
    while True:
        k0 = body.find(ARG_KEY_START, pos)
        if k0 < 0:
            return pairs
        k1 = body.find(ARG_KEY_END, k0 + len(ARG_KEY_START))
        if k1 < 0:
            return pairs
        key = body[k0 + len(ARG_KEY_START):k1].strip()
        v0 = body.find(ARG_VALUE_START, k1 + len(ARG_KEY_END))
        if v0 < 0:
            return pairs
        v1 = body.find(ARG_VALUE_END, v0 + len(ARG_VALUE_START))
        if v1 < 0:
            if closed:  # the model forgot the closing tag: the value runs to the end
                pairs.append((key, body[v0 + len(ARG_VALUE_START):]))
            return pairs
        pairs.append((key, body[v0 + len(ARG_VALUE_START):v1]))
        pos = v1 + len(ARG_VALUE_END)


def _name_end(body: str, start: int = 0) -> int:
    """Where NAME ends in the text after `<tool_call>`, or -1 when it has not ended yet.

    `start`: no `<arg_key>`/`</tool_call>` begins before it (callers resume searches)."""
    ends = [i for i in (body.find(ARG_KEY_START, start), body.find(TOOL_CALL_END, start)) if i >= 0]
    return min(ends) if ends else -1


def _held_tail(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class Glm47ToolParser:
    """Parses `glm47` tool calls, whole (`parse`) or streaming (`feed`/`finish`).

    One instance serves one generation's stream; `parse` is stateless and may be called on
    any instance. `tools` are the request's OpenAI tool definitions (for value typing).
    """

    def __init__(self, tools: list[dict] | None = None) -> None:
        self._schemas: dict[str, tuple[list[dict[str, Any]], dict]] = {}  # name -> (branches, parameters)
        for tool in tools or []:
            if not isinstance(tool, dict):
                continue
            fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
            name = fn.get("name")
            params = fn.get("parameters")
            if isinstance(name, str):
                params = params if isinstance(params, dict) else {}
                self._schemas[name] = (schema_branches(params, params), params)
        # streaming state
        self._text_buf = ""
        self._in_call = False
        self._call_buf = ""  # text after the current call's <tool_call>
        self._name: str | None = None  # the current call's NAME once complete
        self._name_end = 0  # where NAME ends in _call_buf
        self._scan = 0  # _call_buf before this holds no marker start (searches resume here)
        self._call_id: str | None = None
        self._next_index = 0
        self._finished = False
        self.calls: list[ToolCall] = []  # finished calls of the stream, in order

    @property
    def has_calls(self) -> bool:
        """True once the stream has produced a call (its header was emitted)."""
        return bool(self.calls) or self._call_id is not None

    # ------------------------------------------------------------------ shared pieces

    def _arguments_json(self, name: str, body_after_name: str, closed: bool) -> str:
        branches, root = self._schemas.get(name, ([{}], {}))
        pairs = _parse_pairs(body_after_name, closed)
        props = branch_for(pairs, branches, root)
        args: dict[str, Any] = {}
        for key, raw in pairs:
            args[key] = convert_value(raw, props.get(key), root)
        return json.dumps(args, ensure_ascii=False)

    # ------------------------------------------------------------------ whole text

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """Splits a whole output into (content, calls): the fold of one `feed` and `finish`
        on a fresh parser with this one's tools, so it cannot differ from a stream."""
        parser = Glm47ToolParser()
        parser._schemas = self._schemas
        deltas = parser.feed(text) + parser.finish()
        return "".join(d.text for d in deltas if isinstance(d, ContentDelta)), parser.calls

    # ------------------------------------------------------------------ streaming

    def feed(self, delta: str) -> list[Delta]:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        out: list[Delta] = []
        if self._in_call:
            self._call_buf += delta
        else:
            self._text_buf += delta
        while True:
            if not self._in_call:
                start = self._text_buf.find(TOOL_CALL_START)
                if start < 0:
                    held = _held_tail(self._text_buf, TOOL_CALL_START)
                    emit = self._text_buf[:len(self._text_buf) - held]
                    self._text_buf = self._text_buf[len(self._text_buf) - held:]
                    if emit:
                        out.append(ContentDelta(emit))
                    return out
                if start:
                    out.append(ContentDelta(self._text_buf[:start]))
                self._call_buf = self._text_buf[start + len(TOOL_CALL_START):]
                self._text_buf = ""
                self._in_call = True
                self._name = None
                self._scan = 0
            body = self._call_buf
            scan = self._scan
            # Nothing was found before the last len(marker)-1 characters of the old buffer.
            self._scan = max(0, len(body) - len(TOOL_CALL_END) + 1)
            end = body.find(TOOL_CALL_END, scan)
            if self._name is None:
                name_end = _name_end(body, scan)
                if name_end < 0:
                    return out  # NAME incomplete: wait
                self._name = body[:name_end].strip()
                self._name_end = name_end
                if self._name:
                    self._call_id = new_call_id()
                    out.append(ToolCallDelta(self._next_index, id=self._call_id, name=self._name))
            if end < 0:
                return out  # arguments are buffered until </tool_call>
            rest = body[end + len(TOOL_CALL_END):]
            self._close_call(body[:end], closed=True, out=out)
            self._text_buf = rest

    def _close_call(self, body: str, closed: bool, out: list[Delta]) -> None:
        name = self._name
        if name:
            args = self._arguments_json(name, body[self._name_end:], closed)
            call = ToolCall(self._call_id or new_call_id(), self._next_index, name, args, closed)
            self.calls.append(call)
            out.append(ToolCallDelta(self._next_index, arguments=args))
            self._next_index += 1
        else:  # empty or unfinished NAME: the text is content
            text = TOOL_CALL_START + body + (TOOL_CALL_END if closed else "")
            out.append(ContentDelta(text))
        self._in_call = False
        self._call_buf = ""
        self._name = None
        self._call_id = None

    def finish(self) -> list[Delta]:
        """Flushes held-back content and closes an unterminated call (module doc)."""
        if self._finished:
            return []
        self._finished = True
        out: list[Delta] = []
        if self._in_call:
            self._close_call(self._call_buf, closed=False, out=out)
        if self._text_buf:
            out.append(ContentDelta(self._text_buf))
            self._text_buf = ""
        return out
