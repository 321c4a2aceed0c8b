"""Tool-call argument typing by the tool's JSON schema: escaped JSON, `$ref`/`$defs` at the
root and per property, `anyOf`/`oneOf`/`allOf`, `enum`/`const` members, root unions picked
by their discriminators; streamed and whole parsing agree on each."""

from __future__ import annotations

import json

import pytest

from glmrt.serving.tool_arguments import convert_value, schema_branches, schema_types
from glmrt.serving.tool_parser import ContentDelta, Glm47ToolParser, ToolCallDelta


def tool(parameters):
    return [{"type": "function", "function": {"name": "inspect", "parameters": parameters}}]


def call(**raw):
    body = "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>" for k, v in raw.items())
    return f"<tool_call>inspect{body}</tool_call>"


def arguments(parameters, **raw):
    """The typed arguments, whole and streamed a character at a time (they must agree)."""
    text = call(**raw)
    _, calls = Glm47ToolParser(tool(parameters)).parse(text)
    whole = json.loads(calls[0].arguments_json)
    parser = Glm47ToolParser(tool(parameters))
    deltas = [d for ch in text for d in parser.feed(ch)] + parser.finish()
    assert not [d for d in deltas if isinstance(d, ContentDelta)]
    streamed = [d.arguments for d in deltas if isinstance(d, ToolCallDelta) and d.arguments is not None]
    assert [json.loads(a) for a in streamed] == [whole]
    return whole


def typed(parameters, key, raw):
    value = arguments(parameters, **{key: raw})[key]
    return value, type(value)


def prop(schema, **extra):
    return {"type": "object", "properties": {"value": schema}, **extra}


# ------------------------------------------------------------------------------ escaped JSON


@pytest.mark.parametrize("schema,raw,expected", [
    ({"type": "array"}, '[{\\"id\\": \\"1\\"}]', [{"id": "1"}]),
    ({"type": "array", "items": {"type": "integer"}}, '\\"[1, 2]\\"', [1, 2]),
    ({"type": "object"}, '{\\"a\\": {\\"b\\": [true, null]}}', {"a": {"b": [True, None]}}),
    ({"type": "object"}, '{\\"say\\": \\"line\\\\none\\"}', {"say": "line\none"}),
    ({"type": "integer"}, '\\"123\\"', 123),
    ({"type": "number"}, '\\"2.5\\"', 2.5),
    ({"type": "boolean"}, '\\"false\\"', False),
    ({"type": ["integer", "null"]}, '\\"null\\"', None),
    ({"anyOf": [{"type": "string"}, {"type": "array"}]}, '[\\"a\\"]', ["a"]),
    # a string parameter keeps its text, backslashes and all
    ({"type": "string"}, '\\"quoted\\"', '\\"quoted\\"'),
    ({"type": "string"}, '[{\\"id\\": 1}]', '[{\\"id\\": 1}]'),
    # escaped quotes beside a raw one: only the escaped ones are undone
    ({"type": "array"}, '[\\"a\\", "b"]', ["a", "b"]),
])
def test_escaped_json_values_are_decoded(schema, raw, expected):
    assert typed(prop(schema), "value", raw) == (expected, type(expected))


# ------------------------------------------------------------------------------ enum members


@pytest.mark.parametrize("schema,raw,expected", [
    ({"enum": [1, 2, "max"]}, "2", 2),
    ({"enum": [1, 2, "max"]}, "max", "max"),
    ({"enum": [1, 2, "max"]}, '\\"1\\"', 1),
    ({"enum": ["1", "2"]}, "1", "1"),  # a string member stays a string
    ({"enum": ["1", 2]}, "2", 2),
    ({"enum": ["7", 8]}, "7", "7"),
    ({"enum": ["true", 7]}, "true", "true"),
    ({"enum": ["null", 7]}, "null", "null"),
    ({"enum": ["ok", None]}, "null", None),
    ({"enum": [True, "no"]}, "True", True),
    ({"enum": [{"a": 1}, [1]]}, '{"a": 1}', {"a": 1}),
    ({"const": "null"}, "null", "null"),
    ({"const": 7}, '"7"', 7),
    ({"const": '{"a":1}'}, '{"a":1}', '{"a":1}'),
    ({"type": "string", "enum": ["c", "f"]}, " c ", "c"),  # the member, not the padded text
    ({"type": "number", "enum": [1, 2]}, '\\"1\\"', 1),
    ({"type": ["number", "string"], "enum": [1, "auto"]}, "1.0", 1),  # typed as its member
    ({"anyOf": [{"type": "string", "enum": ["auto"]}, {"type": "integer"}]}, "7", 7),
    ({"anyOf": [{"type": "string", "enum": ["auto"]}, {"type": "integer"}]}, "auto", "auto"),
    # no member matches: typed by the types the members have
    ({"enum": [1, 2]}, "5", 5),
    ({"enum": ["a", "b"]}, "5", "5"),
    # allOf narrows the members to those every part allows
    ({"allOf": [{"enum": [1, "1", 2]}, {"type": "string"}]}, "1", "1"),
])
def test_enum_values_are_typed_as_their_member(schema, raw, expected):
    assert typed(prop(schema), "value", raw) == (expected, type(expected))


# ------------------------------------------------------------------------------ schema resolution


@pytest.mark.parametrize("schema,raw,expected", [
    ({"type": ["integer", "string"]}, "auto", "auto"),
    ({"type": ["string", "integer"]}, "7", 7),
    ({"type": ["string", "object"]}, '{"ok": false}', {"ok": False}),
    ({"type": ["string", "object"]}, "7", "7"),
    ({"type": ["string", "integer"]}, "true", "true"),
    ({"type": ["string", "null"]}, "null", None),
    ({"oneOf": [{"type": "null"}, {"type": "array", "items": {"type": "integer"}}]}, "[1, 2]", [1, 2]),
    ({"allOf": [{"type": ["integer", "string"]}, {"type": "integer"}]}, "7", 7),
    ({"allOf": [{"type": "number"}, {"type": ["integer", "string"]}]}, '"7"', 7),  # number ∩ integer
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "7", 7),  # disjoint: says nothing, its JSON
    ({}, "123_456", "123_456"),
    ({}, '{"ok": false}', {"ok": False}),
    ({"type": "string"}, 'line one\n"quoted" \\ café', 'line one\n"quoted" \\ café'),
    # glmrt's documented choices where peers differ
    ({"type": "integer"}, "1.25e2", 125),  # an integral number is an integer
    ({"type": ["string", "null"]}, '"null"', '"null"'),  # strings are written raw
])
def test_value_types(schema, raw, expected):
    assert typed(prop(schema), "value", raw) == (expected, type(expected))


@pytest.mark.parametrize("defs", ["$defs", "definitions"])
def test_refs_with_escaped_names_and_chains(defs):
    params = {defs: {"a/b~c": {"$ref": f"#/{defs}/Int"}, "Int": {"type": "integer"}},
              "type": "object", "properties": {"value": {"$ref": f"#/{defs}/a~1b~0c"}}}
    assert typed(params, "value", "7") == (7, int)


def test_top_level_ref_to_the_parameters_object():
    params = {"$defs": {"Args": {"type": "object", "properties": {"n": {"type": "integer"},
                                                                   "s": {"type": "string"}}}},
              "$ref": "#/$defs/Args"}
    assert arguments(params, n="3", s="3") == {"n": 3, "s": "3"}


def test_top_level_all_of_adds_properties():
    params = {"allOf": [{"properties": {"n": {"type": "integer"}}}, {"properties": {"s": {"type": "string"}}}]}
    assert arguments(params, n="3", s="3") == {"n": 3, "s": "3"}
    # a property in two parts must satisfy both
    params = {"allOf": [{"properties": {"v": {"type": ["integer", "string"]}}},
                        {"properties": {"v": {"type": "integer"}}}]}
    assert arguments(params, v='"4"') == {"v": 4}


def test_ref_cycles_say_nothing():
    params = {"$defs": {"cycle": {"$ref": "#/$defs/cycle"}}, "properties": {"value": {"$ref": "#/$defs/cycle"}},
              "$ref": "#/$defs/cycle"}
    assert arguments(params, value="auto") == {"value": "auto"}
    assert arguments(params, value="5") == {"value": 5}
    assert schema_types({"$ref": "#/$defs/cycle"}, params) is None


@pytest.mark.parametrize("keyword", ["anyOf", "oneOf"])
@pytest.mark.parametrize("discriminator", ["const", "enum"])
@pytest.mark.parametrize("reverse", [False, True])
def test_root_union_is_picked_by_its_discriminator(keyword, discriminator, reverse):
    def branch(kind, value_type):
        kind_schema = {"const": kind} if discriminator == "const" else {"enum": [kind]}
        return {"type": "object", "properties": {"kind": kind_schema, "value": {"type": value_type}}}

    branches = [branch("text", "string"), branch("count", "integer")]
    branches = branches[::-1] if reverse else branches
    for params in ({keyword: branches},
                   {keyword: [{"allOf": [b]} for b in branches]},
                   {"$defs": {str(i): b for i, b in enumerate(branches)},
                    keyword: [{"$ref": f"#/$defs/{i}"} for i in range(2)]}):
        assert arguments(params, kind="text", value="7") == {"kind": "text", "value": "7"}
        assert arguments(params, kind="count", value="7") == {"kind": "count", "value": 7}
        assert arguments(params, value="7", kind="count") == {"value": 7, "kind": "count"}
        assert arguments(params, value="7", kind="text") == {"value": "7", "kind": "text"}


def test_root_union_without_a_fitting_branch_uses_every_property():
    params = {"oneOf": [{"properties": {"a": {"type": "integer"}, "k": {"const": "x"}}},
                        {"properties": {"b": {"type": "boolean"}, "k": {"const": "y"}}}]}
    assert arguments(params, a="1", b="true", k="z") == {"a": 1, "b": True, "k": "z"}
    assert len(schema_branches(params, params)) == 2


def test_convert_value_directly():
    root = {"$defs": {"N": {"type": "integer"}}}
    assert convert_value('\\"9\\"', {"$ref": "#/$defs/N"}, root) == 9
    assert convert_value('[{\\"id\\": \\"1\\"}]') == '[{\\"id\\": \\"1\\"}]'  # no schema: no guessing
