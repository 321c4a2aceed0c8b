"""Typing of tool-call argument values by the tool's JSON schema.

GLM models write every `<arg_value>` as text; the chat template writes a string value raw
and anything else as JSON. This module turns the text back into the typed value: it
resolves a tool's parameter schema (`$ref` into `$defs`/`definitions`, `anyOf`/`oneOf`,
`allOf`, type lists, `enum`, `const`), picks the branch of a root-level union that the call's
discriminators fit, and converts each value (rules in glmrt/serving/tool_parser.py's module
doc and docs/PROTOCOLS.md).
"""

from __future__ import annotations

import ast
import json
import math
from dataclasses import dataclass
from typing import Any

__all__ = ["convert_value", "schema_branches", "branch_for", "schema_types", "schema_members"]


_JSON_TYPES = ("string", "integer", "number", "boolean", "array", "object", "null")
_MAX_BRANCHES = 64  # alternatives or property sets one schema may expand to


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
    `enum` and `const` applied to each; [] for what is not a schema."""
    if not isinstance(schema, dict) or _depth > 32:
        return []
    alts = [_local(schema)]
    parts: list[Any] = []
    if isinstance(schema.get("$ref"), str):
        parts.append(_resolve_ref(schema["$ref"], root))
    if isinstance(schema.get("allOf"), list):
        parts.extend(schema["allOf"])
    groups = [[part] for part in parts]
    groups += [schema[c] for c in ("anyOf", "oneOf") if isinstance(schema.get(c), list)]
    for options in groups:
        sub = [alt for option in options for alt in schema_alternatives(option, root, _depth + 1)]
        if sub:  # a cap keeps nested unions from multiplying without bound
            alts = [_intersect(a, b) for a in alts for b in sub][:_MAX_BRANCHES]
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


def _merged(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two property maps that both apply: a property in both must satisfy both schemas."""
    out = dict(a)
    for key, sub in b.items():
        out[key] = {"allOf": [out[key], sub]} if key in out else sub
    return out


def schema_branches(schema: Any, root: dict, _depth: int = 0) -> list[dict[str, Any]]:
    """The property maps an object schema allows: one per branch of its `anyOf`/`oneOf`, each
    with the properties of the schema itself, its `$ref` and its `allOf` members (which every
    branch has). A schema without alternatives has one branch."""
    if not isinstance(schema, dict) or _depth > 32:
        return [{}]
    own = schema.get("properties")
    branches = [dict(own) if isinstance(own, dict) else {}]
    parts: list[Any] = [_resolve_ref(schema["$ref"], root)] if isinstance(schema.get("$ref"), str) else []
    if isinstance(schema.get("allOf"), list):
        parts.extend(schema["allOf"])
    alternatives = [[part] for part in parts]
    for combinator in ("anyOf", "oneOf"):
        if isinstance(schema.get(combinator), list) and schema[combinator]:
            alternatives.append(schema[combinator])
    for options in alternatives:
        sub = [b for option in options for b in schema_branches(option, root, _depth + 1)]
        branches = [_merged(a, b) for a in branches for b in sub][:_MAX_BRANCHES]
    return branches


def _fits(raw: str, schema: Any, root: dict) -> bool:
    """False when `schema` lists enum/const members and `raw` names none of them."""
    members = schema_members(schema, root)
    return not members or _enum_member(raw, _json_values(raw), members) is not _MISSING


def branch_for(pairs: list[tuple[str, str]], branches: list[dict[str, Any]], root: dict) -> dict[str, Any]:
    """The property map that types a call's `pairs`: the first branch whose enum/const
    properties (a discriminator such as `kind: {"const": "count"}`) all fit the call, else
    every branch's properties together (the first branch's schema for a shared name)."""
    for props in branches:
        if all(_fits(raw, props[key], root) for key, raw in pairs if key in props):
            return props
    union: dict[str, Any] = {}
    for props in branches:
        for key, sub in props.items():
            union.setdefault(key, sub)
    return union


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
