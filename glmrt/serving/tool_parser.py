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
- Values are typed by the tool's JSON schema. The schema is resolved fully against the
  parameters object (its `$defs` / `definitions`): the parameters' own `$ref` and the
  properties of its `allOf`/`anyOf`/`oneOf` members, and per property `$ref`, `anyOf` and
  `oneOf` (alternatives), `allOf` (intersected), type lists, `enum` and `const`. Then:
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

import ast
import json
import math
import secrets
from dataclasses import dataclass
from typing import Any, Union

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


# ---------------------------------------------------------------------------- schema typing

_JSON_TYPES = ("string", "integer", "number", "boolean", "array", "object", "null")


def _resolve_ref(ref: str, root: dict) -> Any:
    if not ref.startswith("#"):
        return None  # remote refs are not resolved
    node: Any = root
    for part in ref[1:].split("/"):
        if not part:
            continue
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _enum_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


@dataclass(frozen=True)
class _Alternative:
    """One way a value may satisfy a schema: its allowed JSON types (None: any) and its
    allowed members (None: any), both in declaration order."""

    types: tuple[str, ...] | None = None
    members: tuple[Any, ...] | None = None


def _narrow(a: tuple[str, ...] | None, b: tuple[str, ...] | None) -> tuple[str, ...] | None:
    """Types both allow ("integer" is a "number")."""
    if a is None or b is None:
        return a if b is None else b
    both = [t for t in a if t in b or (t == "integer" and "number" in b)]
    both += [t for t in b if t == "integer" and "number" in a and t not in both]
    return tuple(both)


def _intersect(a: _Alternative, b: _Alternative) -> _Alternative:
    types = _narrow(a.types, b.types)
    members = a.members if b.members is None else (
        b.members if a.members is None else tuple(m for m in a.members if _member_in(m, b.members)))
    if members is not None and types is not None:
        members = tuple(m for m in members if _enum_type(m) in types
                        or (_enum_type(m) == "integer" and "number" in types))
    return _Alternative(types, members)


def _member_in(value: Any, members: tuple[Any, ...]) -> bool:
    return any(_enum_type(m) == _enum_type(value) and m == value for m in members)


def _local(schema: dict) -> _Alternative:
    """The constraints `schema` states itself (`type`, `enum`, `const`)."""
    declared = schema.get("type")
    types: tuple[str, ...] | None = None
    if isinstance(declared, str) and declared in _JSON_TYPES:
        types = (declared,)
    elif isinstance(declared, list):
        listed = [t for t in declared if isinstance(t, str) and t in _JSON_TYPES]
        types = tuple(dict.fromkeys(listed)) if listed else None
    members: tuple[Any, ...] | None = None
    if "const" in schema:
        members = (schema["const"],)
    elif isinstance(schema.get("enum"), list) and schema["enum"]:
        members = tuple(schema["enum"])
    return _intersect(_Alternative(types), _Alternative(None, members))


def schema_alternatives(schema: Any, root: dict, _depth: int = 0) -> list[_Alternative]:
    """`schema` resolved into the alternatives a value may satisfy: `$ref` (against `root`),
    `anyOf`/`oneOf` (any one), `allOf` (all, intersected), with the schema's own `type`,
    `enum` and `const` applied to each. [] when the schema says nothing usable."""
    if not isinstance(schema, dict) or _depth > 32:
        return []
    alts = [_local(schema)]
    parts: list[Any] = []
    if isinstance(schema.get("$ref"), str):
        parts.append(_resolve_ref(schema["$ref"], root))
    if isinstance(schema.get("allOf"), list):
        parts.extend(schema["allOf"])
    for part in parts:
        sub = schema_alternatives(part, root, _depth + 1)
        if sub:
            alts = [_intersect(a, b) for a in alts for b in sub]
    for combinator in ("anyOf", "oneOf"):
        options = schema.get(combinator)
        if isinstance(options, list):
            sub = [alt for option in options for alt in schema_alternatives(option, root, _depth + 1)]
            if sub:
                alts = [_intersect(a, b) for a in alts for b in sub]
    # An alternative no value satisfies (`allOf` of disjoint types) is dropped, unless all are.
    return [a for a in alts if a.types != () and a.members != ()] or alts


def schema_types(schema: Any, root: dict) -> list[str] | None:
    """The JSON types `schema` allows, in declaration order; None when it says nothing."""
    types: list[str] = []
    for alt in schema_alternatives(schema, root):
        if alt.types is None and alt.members is None:
            return None
        declared = alt.types if alt.types is not None else tuple(_enum_type(m) for m in alt.members or ())
        types.extend(declared)
    return list(dict.fromkeys(types)) or None


def schema_members(schema: Any, root: dict) -> list[Any]:
    """The enum/const members of `schema`'s alternatives, in declaration order."""
    return [m for a in schema_alternatives(schema, root) for m in a.members or ()]


def schema_properties(schema: Any, root: dict, _depth: int = 0) -> dict[str, Any]:
    """The property schemas of an object schema, through `$ref` and the members of `allOf`,
    `anyOf` and `oneOf` (a property named twice keeps its first schema)."""
    if not isinstance(schema, dict) or _depth > 32:
        return {}
    props = dict(schema["properties"]) if isinstance(schema.get("properties"), dict) else {}
    parts: list[Any] = [_resolve_ref(schema["$ref"], root)] if isinstance(schema.get("$ref"), str) else []
    for combinator in ("allOf", "anyOf", "oneOf"):
        if isinstance(schema.get(combinator), list):
            parts.extend(schema[combinator])
    for part in parts:
        for key, sub in schema_properties(part, root, _depth + 1).items():
            props.setdefault(key, sub)
    return props


def _matches(value: Any, type_name: str) -> bool:
    if type_name == "string":
        return isinstance(value, str)
    if type_name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if type_name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if type_name == "boolean":
        return isinstance(value, bool)
    if type_name == "array":
        return isinstance(value, list)
    if type_name == "object":
        return isinstance(value, dict)
    return value is None  # null


_MISSING = object()


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _json(text: str) -> Any:
    """Strict JSON (no NaN/Infinity, which json.dumps would write back invalid), or _MISSING."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return _MISSING


def _literal(text: str) -> Any:
    """JSON, else a Python literal (models sometimes write {'a': True}); else _MISSING."""
    value = _json(text)
    if value is not _MISSING:
        return value
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return _MISSING


def _parse_number(text: str) -> int | float | None:
    """A string as an int when it is one, else as a float, else None."""
    text = text.strip()
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return None


def _coerce(value: Any, type_name: str) -> Any:
    """`value` converted to `type_name`, or _MISSING."""
    if _matches(value, type_name):
        return value
    if type_name == "integer":
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            number = _parse_number(value)
            if number is None or isinstance(number, int):
                return _MISSING if number is None else number
            return int(number) if number.is_integer() else _MISSING
        return _MISSING
    if type_name == "number":
        if isinstance(value, str):
            number = _parse_number(value)
            if number is None or isinstance(number, int):
                return _MISSING if number is None else number
            return number if math.isfinite(number) else _MISSING
        return _MISSING
    if type_name == "boolean":
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        return _MISSING
    if type_name in ("array", "object"):
        if isinstance(value, str):
            inner = _literal(value)
            if inner is not _MISSING and _matches(inner, type_name):
                return inner
        return _MISSING
    if type_name == "null":
        if isinstance(value, str) and value.strip().lower() in ("null", "none"):
            return None
        return _MISSING
    return _MISSING  # string: a non-string is never silently turned into one here


def _unescaped(raw: str) -> str | None:
    """`raw` with its backslash escapes undone, when it has escaped quotes: GLM models write
    a non-string value as JSON inside a JSON string (`[{\\"id\\": \\"1\\"}]`, `\\"123\\"`)."""
    if '\\"' not in raw:
        return None
    try:
        return json.loads('"' + raw + '"', strict=False)
    except ValueError:  # an unescaped quote too: undo only the escaped ones
        return raw.replace('\\"', '"')


def _json_values(raw: str) -> list[Any]:
    """What `raw` means as JSON: its own value, then that of its unescaped form."""
    values = []
    for text in (raw, _unescaped(raw)):
        value = _json(text) if text is not None else _MISSING
        if value is not _MISSING:
            values.append(value)
    return values


def _same(a: Any, b: Any) -> bool:
    return _enum_type(a) == _enum_type(b) and a == b


def _enum_member(raw: str, values: list[Any], members: list[Any]) -> Any:
    """The member `raw` names: first one it is exactly (a string member by its text, any
    other by its JSON value), else one it coerces to; _MISSING when none."""
    for member in members:
        if isinstance(member, str):
            if member in (raw, raw.strip()) or any(v == member for v in values if isinstance(v, str)):
                return member
        elif any(_same(v, member) for v in values):
            return member
    for member in members:
        if not isinstance(member, str):
            for candidate in (*values, raw):
                if _same(_coerce(candidate, _enum_type(member)), member):
                    return member
    return _MISSING


def convert_value(raw: str, schema: Any = None, root: dict | None = None) -> Any:
    """Types one raw `<arg_value>` text by its JSON schema (rules in the module doc).

    An enum/const member the text names is that member. Otherwise, the inverse of the chat
    template, which writes a string value raw and anything else as JSON: a value whose JSON
    (or unescaped JSON) has an allowed non-string type is that value; otherwise a schema
    allowing strings gets the raw text; otherwise the first declared type the value coerces
    to wins; otherwise its JSON value, or the raw text when it is not JSON.
    """
    root = root or {}
    types = schema_types(schema, root) if schema is not None else None
    if types is None:
        parsed = _json(raw)
        return raw if parsed is _MISSING else parsed
    values = _json_values(raw)
    members = schema_members(schema, root)
    if members:
        member = _enum_member(raw, values, members)
        if member is not _MISSING:
            return member
    if types == ["string"]:
        return raw
    for value in values:
        if any(_matches(value, t) for t in types if t != "string"):
            return value
    if "string" in types:
        return raw
    for type_name in types:
        for candidate in (*values, raw):
            converted = _coerce(candidate, type_name)
            if converted is not _MISSING:
                return converted
    return values[0] if values else raw


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
        self._schemas: dict[str, tuple[dict, dict]] = {}
        for tool in tools or []:
            if not isinstance(tool, dict):
                continue
            fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
            name = fn.get("name")
            params = fn.get("parameters")
            if isinstance(name, str):
                params = params if isinstance(params, dict) else {}
                self._schemas[name] = (schema_properties(params, params), params)
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
        props, root = self._schemas.get(name, ({}, {}))
        args: dict[str, Any] = {}
        for key, raw in _parse_pairs(body_after_name, closed):
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
