"""The GLM-5.3 chat template and its renderer.

Owns the one jinja2 template that turns an OpenAI-style conversation into the GLM-5.3 prompt
string (layout in docs/PROTOCOLS.md), and `render_chat`, which renders it the way
transformers' `apply_chat_template` does, so a checkpoint's tokenizer_config.json and the
tokenizer actor produce byte-identical prompts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

# NOTE: literal text is emitted only through `{{- ... -}}` expressions and every tag strips
# whitespace, so the output does not depend on trim_blocks/lstrip_blocks: transformers and
# render_chat may configure jinja differently and still agree byte for byte.
# Errors go through `raise_exception`, the global transformers provides; render_chat maps it
# to ValueError.
CHAT_TEMPLATE = r"""
{#- GLM-5.3 prompt layout: [gMASK]<sop>, then per message <|system|>, <|user|>, <|assistant|> or
    <|observation|> and its content; assistant turns carry <think>...</think> before the answer and
    <tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value></tool_call> after it. -#}
{%- macro render_content(content, role) -%}
  {%- if content is not defined or content is none -%}
  {%- elif content is string -%}
    {{- content -}}
  {%- elif content is mapping or content is not iterable -%}
    {{- raise_exception('Message content for role "' ~ role ~ '" must be a string or a list of content parts.') -}}
  {%- else -%}
    {%- for part in content -%}
      {%- if part is not mapping or part['type'] is not defined -%}
        {{- raise_exception('Malformed content part for role "' ~ role ~ '": every part must be an object with a "type".') -}}
      {%- elif part['type'] == 'text' -%}
        {%- if part['text'] is not string -%}
          {{- raise_exception('Malformed text part for role "' ~ role ~ '": "text" must be a string.') -}}
        {%- endif -%}
        {{- part['text'] -}}
      {%- elif part['type'] == 'image_url' or part['type'] == 'image' -%}
        {{- '<|begin_of_image|><|image|><|end_of_image|>' -}}
      {%- elif part['type'] == 'video_url' or part['type'] == 'video' -%}
        {{- '<|begin_of_video|><|video|><|end_of_video|>' -}}
      {%- else -%}
        {{- raise_exception('Unsupported content part type "' ~ part['type'] ~ '" for role "' ~ role ~ '".') -}}
      {%- endif -%}
    {%- endfor -%}
  {%- endif -%}
{%- endmacro -%}

{%- macro render_tool_call(tc) -%}
  {%- set fn = tc['function'] if tc['function'] is mapping else tc -%}
  {%- if fn['name'] is not string -%}
    {{- raise_exception('Malformed tool call: the function name must be a string.') -}}
  {%- endif -%}
  {%- set args = fn['arguments'] if fn['arguments'] is defined and fn['arguments'] is not none else {} -%}
  {%- if args is not mapping -%}
    {{- raise_exception('Tool call "' ~ fn['name'] ~ '": arguments must be an object (parse JSON-string arguments before rendering).') -}}
  {%- endif -%}
  {{- '<tool_call>' ~ fn['name'] -}}
  {%- for key, value in args.items() -%}
    {{- '<arg_key>' ~ key ~ '</arg_key><arg_value>' ~ (value if value is string else value | tojson) ~ '</arg_value>' -}}
  {%- endfor -%}
  {{- '</tool_call>' -}}
{%- endmacro -%}

{%- set effort = reasoning_effort | trim | lower if reasoning_effort is string else '' -%}
{{- '[gMASK]<sop><|system|>Reasoning Effort: ' ~ ('Low' if effort == 'low' else 'High' if effort == 'high' else 'Max') -}}

{%- if tools -%}
  {{- '<|system|>\n# Tools\n\nYou can call the functions listed below to help with the request.\n\nEach function signature is one JSON object per line, inside <tools></tools> tags:\n<tools>\n' -}}
  {%- for tool in tools -%}
    {{- tool | tojson ~ '\n' -}}
  {%- endfor -%}
  {{- '</tools>\n\nTo call a function, write its name and then every argument as a key/value pair, exactly in this format:\n<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value><arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>' -}}
{%- endif -%}

{%- for message in messages -%}
  {%- if message is not mapping or message['role'] is not string -%}
    {{- raise_exception('Every message must be an object with a string "role".') -}}
  {%- endif -%}
  {%- set role = message['role'] -%}
  {%- if role == 'system' or role == 'developer' -%}
    {{- '<|system|>' ~ render_content(message['content'], role) -}}
  {%- elif role == 'user' -%}
    {{- '<|user|>' ~ render_content(message['content'], role) -}}
  {%- elif role == 'assistant' -%}
    {%- set content = render_content(message['content'], role) -%}
    {#- Reasoning comes from reasoning_content, or from a <think>...</think> the client left in
        the content; it is kept for every turn so prompts grow append-only. -#}
    {%- if message['reasoning_content'] is string -%}
      {%- set reasoning = message['reasoning_content'] -%}
    {%- elif '</think>' in content -%}
      {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}
      {%- set content = content.split('</think>')[-1] -%}
    {%- else -%}
      {%- set reasoning = '' -%}
    {%- endif -%}
    {{- '<|assistant|><think>' ~ reasoning | trim ~ '</think>' ~ content | trim -}}
    {%- if message['tool_calls'] is defined and message['tool_calls'] is not none -%}
      {%- for tc in message['tool_calls'] -%}
        {{- render_tool_call(tc) -}}
      {%- endfor -%}
    {%- endif -%}
  {%- elif role == 'tool' -%}
    {#- A run of consecutive tool results shares one <|observation|>. -#}
    {%- if loop.first or loop.previtem['role'] != 'tool' -%}
      {{- '<|observation|>' -}}
    {%- endif -%}
    {{- '<tool_response>' ~ render_content(message['content'], role) ~ '</tool_response>' -}}
  {%- else -%}
    {{- raise_exception('Unknown message role "' ~ role ~ '"; expected system, developer, user, assistant or tool.') -}}
  {%- endif -%}
{%- endfor -%}

{%- if add_generation_prompt -%}
  {#- Thinking on: the model starts inside the think block. Off: an empty, closed one. -#}
  {%- set thinking_off = thinking is defined and thinking is not none and not thinking -%}
  {{- '<|assistant|><think>' ~ ('</think>' if thinking_off else '') -}}
{%- endif -%}
""".strip()


def _raise_exception(message: str) -> None:
    raise ValueError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Same defaults as transformers' filter: no HTML escaping, UTF-8 kept, key order kept.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


@cache
def _compiled_template() -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(CHAT_TEMPLATE)


def _parse_arguments(arguments: str, where: str) -> dict[str, Any]:
    if not arguments.strip():
        return {}
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: arguments are not valid JSON ({exc.msg})") from None
    except RecursionError:
        raise ValueError(f"{where}: arguments are nested too deeply") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"{where}: arguments must be a JSON object, got {type(parsed).__name__}")
    return parsed


def _normalize_tool_calls(messages: Sequence[Mapping[str, Any]]) -> list[Any]:
    """Copies the messages, turning JSON-string tool-call arguments into dicts.

    jinja cannot parse JSON, and OpenAI clients send arguments as strings, so this is done
    here; the caller's messages are never mutated.
    """
    out: list[Any] = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls") if isinstance(message, Mapping) else None
        if not calls:
            out.append(message)
            continue
        if isinstance(calls, (str, bytes)) or not isinstance(calls, Sequence):
            raise ValueError(f"messages[{i}].tool_calls must be a list")
        new_calls = []
        for j, call in enumerate(calls):
            if not isinstance(call, Mapping):
                raise ValueError(f"messages[{i}].tool_calls[{j}] must be an object")
            nested = isinstance(call.get("function"), Mapping)
            fn = call["function"] if nested else call
            if isinstance(fn.get("arguments"), str):
                fn = {**fn, "arguments": _parse_arguments(
                    fn["arguments"], f"messages[{i}].tool_calls[{j}]")}
                call = {**call, "function": fn} if nested else fn
            new_calls.append(call)
        out.append({**message, "tool_calls": new_calls})
    return out


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = True,
    thinking: bool = True,
    reasoning_effort: str | None = None,
) -> str:
    """Renders a conversation into the GLM-5.3 prompt string.

    `messages` are OpenAI-style dicts (content a string or a list of content parts);
    `thinking=False` closes the think block of the generation prompt; `reasoning_effort`
    "low"/"high" selects those levels, anything else is Max. Raises ValueError on unknown
    roles, malformed content parts or unparsable tool-call arguments.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError("messages must be a list of message objects")
    return _compiled_template().render(
        messages=_normalize_tool_calls(messages),
        tools=list(tools) if tools else None,
        add_generation_prompt=add_generation_prompt,
        thinking=thinking,
        reasoning_effort=reasoning_effort,
    )
