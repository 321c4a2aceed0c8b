"""The glm45 reasoning parser and the glm47 tool-call parser: rules, typing, and the
streamed == non-streamed property over every split of the output into deltas."""

import itertools
import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from glmrt.serving.reasoning import Glm45ReasoningParser, parse as parse_reasoning
from glmrt.serving.tool_parser import (
    ContentDelta,
    Glm47ToolParser,
    ToolCall,
    ToolCallDelta,
    convert_value,
)

# ------------------------------------------------------------------------------ helpers


def splits(text, parts):
    """Every way to cut `text` into `parts` chunks (empty chunks included)."""
    n = len(text)
    for cuts in itertools.combinations_with_replacement(range(n + 1), parts - 1):
        bounds = (0, *cuts, n)
        yield [text[a:b] for a, b in zip(bounds, bounds[1:])]


def stream_reasoning(chunks, thinking=True, stop_reason="stop"):
    p = Glm45ReasoningParser(thinking=thinking)
    r, c = [], []
    for chunk in chunks:
        dr, dc = p.feed(chunk)
        r.append(dr)
        c.append(dc)
    dr, dc = p.finish(stop_reason)
    r.append(dr)
    c.append(dc)
    return "".join(r) or None, "".join(c)


def stream_tools(chunks, tools=None):
    """Runs the streaming tool parser; returns (content, [(index, name, args)], parser)."""
    p = Glm47ToolParser(tools)
    deltas = []
    for chunk in chunks:
        deltas.extend(p.feed(chunk))
    deltas.extend(p.finish())
    content = []
    calls = {}
    for d in deltas:
        if isinstance(d, ContentDelta):
            assert d.text, "empty content deltas are not emitted"
            content.append(d.text)
        else:
            assert isinstance(d, ToolCallDelta)
            if d.name is not None:
                assert d.index not in calls, "a call's header is sent once"
                assert re.fullmatch(r"call_[0-9a-f]{24}", d.id)
                assert d.arguments is None
                calls[d.index] = [d.name, []]
            else:
                assert d.index in calls, "arguments come after the header"
                assert d.id is None and d.name is None
                calls[d.index][1].append(d.arguments)
    out = []
    for index in sorted(calls):
        name, args = calls[index]
        assert len(args) == 1, "arguments are sent as one delta"
        out.append((index, name, "".join(args)))
    assert [i for i, _, _ in out] == list(range(len(out)))
    return "".join(content), out, p


def whole_tools(text, tools=None):
    content, calls = Glm47ToolParser(tools).parse(text)
    return content, [(c.index, c.name, c.arguments_json) for c in calls]


def args_of(call):
    return json.loads(call.arguments_json)


# ------------------------------------------------------------------------------ reasoning


@pytest.mark.parametrize("text,thinking,stop,expected", [
    ("I think.</think>The answer.", True, "stop", ("I think.", "The answer.")),
    ("<think>I think.</think>The answer.", True, "stop", ("I think.", "The answer.")),
    ("</think>Direct.", True, "stop", (None, "Direct.")),
    ("a</think>b</think>c<think>d", True, "stop", ("a", "b</think>c<think>d")),
    ("x <think>y</think>z", True, "stop", ("x <think>y", "z")),
    # <tool_call> before </think> ends reasoning and stays in the content
    ("plan<tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",
     True, "stop", ("plan", "<tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>")),
    ("r</think>c<tool_call>f</tool_call>", True, "stop", ("r", "c<tool_call>f</tool_call>")),
    ("r<tool_call>f</tool_call></think>c", True, "stop", ("r", "<tool_call>f</tool_call></think>c")),
    # no </think>: EOS -> the text is the answer and the thinking; length -> reasoning only
    ("Just an answer.", True, "stop", ("Just an answer.", "Just an answer.")),
    ("<think>Just an answer.", True, "stop", ("Just an answer.", "Just an answer.")),
    ("<thi", True, "stop", ("<thi", "<thi")),
    ("<think>", True, "stop", (None, "")),
    ("Still thinking", True, "length", ("Still thinking", "")),
    ("<think>Still thinking", True, "length", ("Still thinking", "")),
    ("", True, "stop", (None, "")),
    ("", True, "length", (None, "")),
    # thinking off: everything is content, verbatim
    ("a</think>b", False, "stop", (None, "a</think>b")),
    ("<think>a", False, "length", (None, "<think>a")),
])
def test_reasoning_parse(text, thinking, stop, expected):
    assert parse_reasoning(text, thinking, stop) == expected
    assert stream_reasoning([text], thinking, stop) == expected


def test_reasoning_streams_deltas_and_holds_back_marker_prefixes():
    p = Glm45ReasoningParser()
    assert p.feed("<thi") == ("", "")
    assert p.feed("nk>Let me see") == ("Let me see", "")
    assert p.feed(". Ok</th") == (". Ok", "")
    assert p.in_reasoning
    assert p.feed("ink>\n\nHi") == ("", "\n\nHi")
    assert not p.in_reasoning
    assert p.feed("</think><tool_call>") == ("", "</think><tool_call>")
    assert p.finish("stop") == ("", "")


def test_reasoning_held_tail_is_flushed_at_finish():
    p = Glm45ReasoningParser()
    assert p.feed("abc</think") == ("abc", "")
    assert p.finish("length") == ("</think", "")
    p = Glm45ReasoningParser()
    assert p.feed("abc<tool_ca") == ("abc", "")
    assert p.finish("length") == ("<tool_ca", "")


def test_reasoning_eos_without_end_marker_keeps_streamed_reasoning_and_answers():
    p = Glm45ReasoningParser()
    sent = [p.feed("<think>Hello"), p.feed(", world</thi")]
    assert sent == [("Hello", ""), (", world", "")]
    # the held tail is reasoning too, and the whole text comes once as the answer
    assert p.finish("stop") == ("</thi", "Hello, world</thi")
    assert p.finish("stop") == ("", "")


def test_reasoning_thinking_off_passes_through():
    p = Glm45ReasoningParser(thinking=False)
    assert p.feed("<think>a</th") == ("", "<think>a</th")
    assert p.finish("stop") == ("", "")


REASONING_TEXTS = [
    "<think>abc</think>de",
    "ab</think>c<tool_call>",
    "x<tool_call>y</think>z",
    "<thin</think",
    "<think><think></think>",
    "no markers here",
    "</th</think>k",
    "<tool_cal<tool_call>",
]


@pytest.mark.parametrize("stop", ["stop", "length"])
@pytest.mark.parametrize("thinking", [True, False])
def test_reasoning_every_split_matches_whole(thinking, stop):
    for text in REASONING_TEXTS:
        expected = parse_reasoning(text, thinking, stop)
        for parts in (1, 2, 3):
            for chunks in splits(text, parts):
                assert stream_reasoning(chunks, thinking, stop) == expected, (text, chunks)


# ------------------------------------------------------------------------------ tool calls

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "lat": {"type": "number"},
                "metric": {"type": "boolean"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "opts": {"type": "object"},
                "unit": {"$ref": "#/$defs/Unit"},
                "when": {"anyOf": [{"$ref": "#/definitions/Day"}, {"type": "null"}]},
                "limit": {"oneOf": [{"type": "integer"}, {"type": "string"}]},
                "mode": {"enum": ["fast", "slow"]},
                "level": {"enum": [1, 2, 3]},
                "maybe": {"type": ["integer", "null"]},
            },
        },
    },
}
WEATHER["function"]["parameters"]["$defs"] = {"Unit": {"type": "string", "enum": ["c", "f"]}}
WEATHER["function"]["parameters"]["definitions"] = {"Day": {"type": "integer"}}
NOOP = {"name": "noop", "parameters": {"type": "object", "properties": {}}}  # bare form
TOOLS = [WEATHER, NOOP]


def call_text(name, **args):
    body = "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>" for k, v in args.items())
    return f"<tool_call>{name}{body}</tool_call>"


def test_single_call_with_typed_arguments():
    text = call_text("get_weather", city="Berlin", days="3", lat="52.5", metric="true",
                     tags='["a", "b"]', opts='{"x": 1}', unit="c")
    content, calls = Glm47ToolParser(TOOLS).parse(text)
    assert content == ""
    assert len(calls) == 1
    call = calls[0]
    assert isinstance(call, ToolCall)
    assert (call.index, call.name, call.complete) == (0, "get_weather", True)
    assert re.fullmatch(r"call_[0-9a-f]{24}", call.id)
    assert args_of(call) == {"city": "Berlin", "days": 3, "lat": 52.5, "metric": True,
                             "tags": ["a", "b"], "opts": {"x": 1}, "unit": "c"}


@pytest.mark.parametrize("key,raw,expected", [
    # a string keeps its raw text, even when it looks like JSON
    ("city", "123", "123"),
    ("city", '"quoted"', '"quoted"'),
    ("city", " padded ", " padded "),
    ("city", "null", "null"),
    # integer / number
    ("days", "7", 7),
    ("days", '"7"', 7),
    ("days", "7.0", 7),
    ("days", " 8 ", 8),
    ("days", "seven", "seven"),
    ("days", "7.5", 7.5),  # not an integer: kept as its JSON value, validation is the API's
    ("lat", "3", 3),
    ("lat", '"2.5"', 2.5),
    ("lat", "NaN", "NaN"),  # never produce invalid JSON
    # boolean
    ("metric", "false", False),
    ("metric", "True", True),
    ("metric", '"false"', False),
    ("metric", "yes", "yes"),
    # array / object, incl. Python literals and doubly encoded JSON
    ("tags", "['x', 'y']", ["x", "y"]),
    ("tags", '"[1, 2]"', [1, 2]),
    ("opts", "{'a': True, 'b': None}", {"a": True, "b": None}),
    ("opts", '{"nested": {"k": [1, 2.5, null]}}', {"nested": {"k": [1, 2.5, None]}}),
    ("opts", "not json", "not json"),
    # $ref into $defs (a string) and anyOf with a $ref into definitions (integer or null)
    ("unit", "42", "42"),
    ("when", "5", 5),
    ("when", '"6"', 6),
    ("when", "null", None),
    # oneOf integer|string: an integer if it is one, else the raw text
    ("limit", "10", 10),
    ("limit", "ten", "ten"),
    ("limit", "[1]", "[1]"),
    # enum types
    ("mode", "fast", "fast"),
    ("level", "2", 2),
    ("level", '"3"', 3),
    # type list
    ("maybe", "null", None),
    ("maybe", "None", None),
    ("maybe", "4", 4),
    # no schema for the key: JSON if it parses, else raw
    ("unknown", "12", 12),
    ("unknown", "[1, 2]", [1, 2]),
    ("unknown", "hello world", "hello world"),
])
def test_value_typing(key, raw, expected):
    text = call_text("get_weather", **{key: raw})
    _, calls = Glm47ToolParser(TOOLS).parse(text)
    value = args_of(calls[0])[key]
    assert value == expected and type(value) is type(expected)


def test_convert_value_without_tools_and_ref_cycles():
    assert convert_value("1") == 1
    assert convert_value("x y") == "x y"
    root = {"$defs": {"A": {"$ref": "#/$defs/A"}}}
    assert convert_value("3", {"$ref": "#/$defs/A"}, root) == 3  # a cycle says nothing
    assert convert_value("3", {"$ref": "#/$defs/Missing"}, root) == 3
    assert convert_value("3", {"allOf": [{"type": "string"}]}, {}) == "3"
    assert convert_value("3", {"const": "3"}, {}) == "3"


def test_unknown_tool_keeps_the_call():
    _, calls = Glm47ToolParser(TOOLS).parse(call_text("other", x="1", y="abc"))
    assert calls[0].name == "other"
    assert args_of(calls[0]) == {"x": 1, "y": "abc"}
    _, calls = Glm47ToolParser(None).parse(call_text("other", x="1"))
    assert args_of(calls[0]) == {"x": 1}


def test_zero_argument_call():
    for text in ("<tool_call>noop</tool_call>", "<tool_call> noop </tool_call>"):
        content, calls = Glm47ToolParser(TOOLS).parse(text)
        assert content == ""
        assert [(c.name, c.arguments_json) for c in calls] == [("noop", "{}")]
        _, streamed, p = stream_tools([text], TOOLS)
        assert streamed == [(0, "noop", "{}")]
        assert p.has_calls


def test_multiple_calls_and_content_around_them():
    text = ("Let me check. " + call_text("get_weather", city="Paris", days="2") + " and "
            + call_text("noop") + call_text("get_weather", city="Rome") + " Done.")
    content, calls = Glm47ToolParser(TOOLS).parse(text)
    assert content == "Let me check.  and  Done."
    assert [c.index for c in calls] == [0, 1, 2]
    assert [c.name for c in calls] == ["get_weather", "noop", "get_weather"]
    assert [args_of(c) for c in calls] == [{"city": "Paris", "days": 2}, {}, {"city": "Rome"}]
    assert len({c.id for c in calls}) == 3
    assert all(c.complete for c in calls)


def test_no_calls():
    p = Glm47ToolParser(TOOLS)
    assert p.parse("plain <b>text</b> < tool_call >") == ("plain <b>text</b> < tool_call >", [])
    content, calls, p = stream_tools(["plain <tool", "_ca", "x"], TOOLS)
    assert (content, calls, p.has_calls) == ("plain <tool_cax", [], False)


def test_repeated_key_and_missing_closing_value_tag():
    text = ("<tool_call>get_weather<arg_key>days</arg_key><arg_value>1</arg_value>"
            "<arg_key>days</arg_key><arg_value>2</arg_value><arg_key>city</arg_key>"
            "<arg_value>Oslo</tool_call>")
    _, calls = Glm47ToolParser(TOOLS).parse(text)
    assert args_of(calls[0]) == {"days": 2, "city": "Oslo"}


def test_empty_name_is_content():
    text = "a<tool_call><arg_key>k</arg_key><arg_value>v</arg_value></tool_call>b<tool_call></tool_call>"
    assert Glm47ToolParser(TOOLS).parse(text) == (text, [])
    content, calls, p = stream_tools([text], TOOLS)
    assert (content, calls, p.has_calls) == (text, [], False)


def test_unterminated_call_at_the_end():
    # NAME never completed: the text is content
    text = "Hi <tool_call>get_wea"
    assert Glm47ToolParser(TOOLS).parse(text) == (text, [])
    assert stream_tools([text], TOOLS)[:2] == (text, [])
    # NAME completed: a call with its complete pairs only, marked incomplete
    text = ("Hi <tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value>"
            "<arg_key>days</arg_key><arg_value>1")
    content, calls = Glm47ToolParser(TOOLS).parse(text)
    assert content == "Hi "
    assert [(c.name, args_of(c), c.complete) for c in calls] == [("get_weather", {"city": "Oslo"}, False)]
    streamed_content, streamed, p = stream_tools([text], TOOLS)
    assert (streamed_content, streamed) == ("Hi ", [(0, "get_weather", '{"city": "Oslo"}')])
    assert p.calls[0].complete is False and p.has_calls


def test_streaming_emits_header_early_and_arguments_once_closed():
    p = Glm47ToolParser(TOOLS)
    assert p.feed("Sure<tool") == [ContentDelta("Sure")]
    assert p.feed("_call>get_wea") == []
    assert not p.has_calls
    (header,) = p.feed("ther<arg_key>ci")
    assert (header.index, header.name, header.arguments) == (0, "get_weather", None)
    assert p.has_calls
    assert p.feed("ty</arg_key><arg_value>Oslo</arg_value></tool_c") == []
    (args,) = p.feed("all>")
    assert (args.index, args.id, args.name, json.loads(args.arguments)) == (0, None, None, {"city": "Oslo"})
    assert p.feed("<tool_call>noop</tool_call>!") == [
        ToolCallDelta(1, id=p.calls[1].id, name="noop"), ToolCallDelta(1, arguments="{}"),
        ContentDelta("!")]
    assert p.finish() == []
    assert [c.id for c in p.calls] == [header.id, p.calls[1].id]


def test_tool_call_inside_reasoning_flows_to_the_tool_parser():
    text = ("I should look it up<tool_call>get_weather<arg_key>city</arg_key>"
            "<arg_value>Lima</arg_value></tool_call>")
    reasoning, content = parse_reasoning(text, True, "stop")
    assert reasoning == "I should look it up"
    rest, calls = Glm47ToolParser(TOOLS).parse(content)
    assert rest == "" and [c.name for c in calls] == ["get_weather"]
    assert args_of(calls[0]) == {"city": "Lima"}


TOOL_TEXTS = [
    "A" + call_text("get_weather", city="Oslo", days="3") + "B" + call_text("noop") + "C",
    "<tool_call>noop</tool_call><tool_call>get_weather<arg_key>tags</arg_key><arg_value>[1]</arg_value></tool_call>",
    "x<tool_cal<tool_call></tool_call>y<tool_call>f<arg_key>k</arg_key><arg_value>v",
    "<tool_call>get_weather<arg_key>days</arg_key><arg_value>4</tool_call><tool_call>g<arg",
    "<<tool_call>f<arg_key>a</arg_key><arg_value></tool_call></arg_value></tool_call><",
]


@pytest.mark.parametrize("text", TOOL_TEXTS)
def test_tool_every_2_and_3_way_split_matches_whole(text):
    expected = whole_tools(text, TOOLS)
    for parts in (1, 2, 3):
        for chunks in splits(text, parts):
            content, calls, _ = stream_tools(chunks, TOOLS)
            assert (content, calls) == expected, chunks


def test_tool_every_char_alone_matches_whole():
    for text in TOOL_TEXTS:
        content, calls, _ = stream_tools(list(text), TOOLS)
        assert (content, calls) == whole_tools(text, TOOLS)


# Fragments that build texts full of markers, marker prefixes and near misses.
_PIECES = st.sampled_from([
    "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
    "<think>", "</think>", "<", "</", "<tool_", "</tool_c", "<arg_", "get_weather", "noop",
    "days", "city", "3", "\"x\"", "[1, 2]", "true", "Oslo", " ", "\n", "é", "😀", "text",
])
_TEXTS = st.lists(_PIECES, max_size=24).map("".join)


@st.composite
def text_and_chunks(draw):
    text = draw(_TEXTS)
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=12)))
    bounds = [0, *cuts, len(text)]
    return text, [text[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text_and_chunks())
def test_tool_random_splits_match_whole(case):
    text, chunks = case
    assert stream_tools(chunks, TOOLS)[:2] == whole_tools(text, TOOLS)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text_and_chunks(), st.booleans(), st.sampled_from(["stop", "length"]))
def test_reasoning_random_splits_match_whole(case, thinking, stop):
    text, chunks = case
    assert stream_reasoning(chunks, thinking, stop) == parse_reasoning(text, thinking, stop)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text_and_chunks(), st.sampled_from(["stop", "length"]))
def test_pipeline_random_splits_match_whole(case, stop):
    """Reasoning parser then tool parser on its content, as the API chains them."""
    text, chunks = case
    reasoning = Glm45ReasoningParser(thinking=True)
    tools = Glm47ToolParser(TOOLS)
    r, deltas = [], []
    for chunk in chunks:
        dr, dc = reasoning.feed(chunk)
        r.append(dr)
        deltas.extend(tools.feed(dc))
    dr, dc = reasoning.finish(stop)
    r.append(dr)
    deltas.extend(tools.feed(dc))
    deltas.extend(tools.finish())
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    args = {}
    for d in deltas:
        if isinstance(d, ToolCallDelta) and d.arguments is not None:
            args[d.index] = d.arguments
    whole_r, whole_c = parse_reasoning(text, True, stop)
    streamed_r = "".join(r) or None
    assert streamed_r == whole_r
    expected_content, expected_calls = whole_tools(whole_c, TOOLS)
    assert content == expected_content
    assert [(c.index, c.name, c.arguments_json) for c in tools.calls] == expected_calls
    assert [args[i] for i in sorted(args)] == [a for _, _, a in expected_calls]
