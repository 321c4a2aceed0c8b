"""Exact prompt strings of the GLM-5.3 chat template (docs/PROTOCOLS.md)."""

import pytest

from glmrt.serving.chat_template import CHAT_TEMPLATE, render_chat

HEADER = "[gMASK]<sop><|system|>Reasoning Effort: "

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city, in °C",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}

TOOLS_BLOCK = (
    "<|system|>\n# Tools\n\n"
    "You can call the functions listed below to help with the request.\n\n"
    "Each function signature is one JSON object per line, inside <tools></tools> tags:\n"
    "<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Weather for a '
    'city, in °C", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}\n'
    "</tools>\n\n"
    "To call a function, write its name and then every argument as a key/value pair, "
    "exactly in this format:\n"
    "<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}"
    "</arg_value><arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>..."
    "</tool_call>"
)


def test_simple_user_message_defaults():
    assert render_chat([{"role": "user", "content": "Hi"}]) == (
        "[gMASK]<sop><|system|>Reasoning Effort: Max<|user|>Hi<|assistant|><think>"
    )


def test_thinking_off_closes_think_block():
    out = render_chat([{"role": "user", "content": "Hi"}], thinking=False)
    assert out == HEADER + "Max<|user|>Hi<|assistant|><think></think>"


def test_no_generation_prompt():
    out = render_chat([{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert out == HEADER + "Max<|user|>Hi"


@pytest.mark.parametrize(
    "effort, label",
    [("low", "Low"), ("high", "High"), ("HIGH", "High"), ("medium", "Max"), ("max", "Max"),
     (None, "Max")],
)
def test_reasoning_effort(effort, label):
    out = render_chat([{"role": "user", "content": "Hi"}], reasoning_effort=effort)
    assert out == HEADER + label + "<|user|>Hi<|assistant|><think>"


def test_system_and_multi_turn_keep_reasoning():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "\n4\n", "reasoning_content": "\nEasy.\n"},
        {"role": "user", "content": "And 3+3?"},
        # Reasoning left inside the content is split out the same way.
        {"role": "assistant", "content": "<think>Also easy.</think>\n6"},
        {"role": "developer", "content": "Answer in words."},
    ]
    assert render_chat(messages, add_generation_prompt=False) == (
        HEADER + "Max<|system|>Be brief.<|user|>2+2?<|assistant|><think>Easy.</think>4"
        "<|user|>And 3+3?<|assistant|><think>Also easy.</think>6<|system|>Answer in words."
    )


def test_prompts_grow_append_only():
    turn1 = [{"role": "user", "content": "Hi"}]
    turn2 = turn1 + [{"role": "assistant", "content": "Hello", "reasoning_content": "greet"},
                     {"role": "user", "content": "Bye"}]
    first = render_chat(turn1, add_generation_prompt=False)
    assert render_chat(turn2).startswith(first)


def test_tool_conversation():
    messages = [
        {"role": "user", "content": "Weather in Berlin and Paris?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Two cities.",
            "tool_calls": [
                {"id": "call_0", "type": "function", "function": {
                    "name": "get_weather",
                    "arguments": {"city": "Berlin", "days": 3, "units": {"t": "C"}, "ok": True},
                }},
                {"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris", "tags": ["a", "é"]}',
                }},
            ],
        },
        {"role": "tool", "tool_call_id": "call_0", "content": "12 C"},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "15 C"}]},
    ]
    assert render_chat(messages, tools=[TOOL]) == (
        HEADER + "Max" + TOOLS_BLOCK + "<|user|>Weather in Berlin and Paris?"
        "<|assistant|><think>Two cities.</think>"
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Berlin</arg_value>"
        "<arg_key>days</arg_key><arg_value>3</arg_value>"
        '<arg_key>units</arg_key><arg_value>{"t": "C"}</arg_value>'
        "<arg_key>ok</arg_key><arg_value>true</arg_value></tool_call>"
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
        '<arg_key>tags</arg_key><arg_value>["a", "é"]</arg_value></tool_call>'
        "<|observation|><tool_response>12 C</tool_response><tool_response>15 C</tool_response>"
        "<|assistant|><think>"
    )


def test_tool_call_without_arguments_and_flat_form():
    messages = [
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"type": "function", "function": {"name": "now", "arguments": ""}},
            {"name": "now", "arguments": {}},
        ]},
    ]
    assert render_chat(messages, add_generation_prompt=False) == (
        HEADER + "Max<|user|>Time?<|assistant|><think></think>Checking."
        "<tool_call>now</tool_call><tool_call>now</tool_call>"
    )


def test_tool_runs_get_one_observation_each():
    messages = [
        {"role": "tool", "content": "a"},
        {"role": "user", "content": "x"},
        {"role": "tool", "content": "b"},
        {"role": "tool", "content": "c"},
    ]
    assert render_chat(messages, add_generation_prompt=False) == (
        HEADER + "Max<|observation|><tool_response>a</tool_response><|user|>x"
        "<|observation|><tool_response>b</tool_response><tool_response>c</tool_response>"
    )


def test_image_and_video_parts():
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "Compare "},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "text", "text": " with "},
        {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}},
    ]}]
    assert render_chat(messages) == (
        HEADER + "Max<|user|>Compare <|begin_of_image|><|image|><|end_of_image|> with "
        "<|begin_of_video|><|video|><|end_of_video|><|assistant|><think>"
    )


def test_no_tools_when_empty_list():
    assert render_chat([{"role": "user", "content": "Hi"}], tools=[]) == (
        HEADER + "Max<|user|>Hi<|assistant|><think>"
    )


def test_caller_messages_are_not_mutated():
    call = {"type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    messages = [{"role": "assistant", "content": "", "tool_calls": [call]}]
    render_chat(messages)
    assert call["function"]["arguments"] == '{"a": 1}'


def test_unknown_role_raises():
    with pytest.raises(ValueError, match='Unknown message role "bot"'):
        render_chat([{"role": "bot", "content": "Hi"}])


@pytest.mark.parametrize(
    "content, match",
    [
        ([{"type": "audio_url", "audio_url": {}}], "Unsupported content part type"),
        ([{"text": "no type"}], "must be an object with a \"type\""),
        (["plain string part"], "must be an object with a \"type\""),
        ([{"type": "text", "text": 5}], "\"text\" must be a string"),
        ({"type": "text", "text": "dict, not list"}, "must be a string or a list"),
    ],
)
def test_malformed_content_raises(content, match):
    with pytest.raises(ValueError, match=match):
        render_chat([{"role": "user", "content": content}])


@pytest.mark.parametrize("arguments", ["{not json", "[1, 2]"])
def test_bad_tool_arguments_raise(arguments):
    messages = [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": arguments}}]}]
    with pytest.raises(ValueError, match=r"tool_calls\[0\]"):
        render_chat(messages)


def test_messages_must_be_a_list():
    with pytest.raises(ValueError):
        render_chat("Hi")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="string \"role\""):
        render_chat([{"content": "no role"}])


def test_template_is_whitespace_insensitive_to_jinja_settings():
    # The template emits text only through expressions, so raw jinja (no trim/lstrip)
    # must render the same string as render_chat.
    import json

    import jinja2

    env = jinja2.Environment()
    env.filters["tojson"] = lambda v: json.dumps(v, ensure_ascii=False)
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Yo", "reasoning_content": "r"}]
    raw = env.from_string(CHAT_TEMPLATE).render(
        messages=messages, tools=[TOOL], add_generation_prompt=True)
    assert raw == render_chat(messages, tools=[TOOL])
