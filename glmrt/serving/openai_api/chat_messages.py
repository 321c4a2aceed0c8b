"""Validation of a chat request's `messages`, `tools`, `tool_choice` and template options."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

from glmrt.mm_limits import MM_KINDS
from glmrt.serving.openai_api.errors import bad_request, not_supported
from glmrt.serving.openai_api.fields import read_object, type_error, value_error

_ROLES = ("system", "developer", "user", "assistant", "tool")
_IMAGE_TYPES = ("image_url", "image")
_VIDEO_TYPES = ("video_url", "video")


def _each_object(items: list, p: str) -> Iterator[tuple[str, dict]]:
    """(`p[i]`, item) for each item of an array that must hold objects."""
    for i, item in enumerate(items):
        param = f"{p}[{i}]"
        if not isinstance(item, dict):
            raise type_error(param, "an object", item)
        yield param, item


def _check_content(content: Any, role: str, p: str) -> None:
    if content is None:
        if role in ("assistant",):
            return
        raise bad_request(f"Missing content for a '{role}' message.", p, "missing_required_parameter")
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise type_error(p, "a string or an array of content parts", content)
    media_ok = role == "user"
    for pp, part in _each_object(content, p):
        t = part.get("type")
        if not isinstance(t, str):
            raise bad_request(f"Missing or invalid 'type' in content part '{pp}'.", f"{pp}.type", "invalid_value")
        if t == "text":
            if not isinstance(part.get("text"), str):
                raise type_error(f"{pp}.text", "a string", part.get("text"))
        elif t in _IMAGE_TYPES or t in _VIDEO_TYPES:
            if not media_ok:
                raise bad_request(f"Content part type '{t}' is only allowed in 'user' messages.", f"{pp}.type",
                                  "invalid_value")
            key = t if t.endswith("_url") else None
            if key is not None:
                ref = part.get(key)
                url = ref.get("url") if isinstance(ref, dict) else ref
                if not isinstance(url, str) or not url:
                    raise bad_request(f"Content part '{pp}' needs '{key}.url' as a string.", f"{pp}.{key}.url",
                                      "invalid_value")
        else:
            raise not_supported(f"Content part type '{t}' in '{pp}' is not supported; use text, image_url or "
                                "video_url.",
                                f"{pp}.type")


def _check_tool_calls(calls: Any, p: str) -> None:
    if not isinstance(calls, list):
        raise type_error(p, "an array", calls)
    for pp, call in _each_object(calls, p):
        if call.get("type", "function") != "function":
            raise not_supported(f"Tool call type {call.get('type')!r} is not supported.", f"{pp}.type")
        fn = call.get("function")
        if not isinstance(fn, dict):
            raise type_error(f"{pp}.function", "an object", fn)
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"'{pp}.function.name' must be a non-empty string.", f"{pp}.function.name",
                              "invalid_value")
        args = fn.get("arguments")
        if isinstance(args, str):
            if args.strip():
                try:
                    parsed = json.loads(args)
                except (ValueError, RecursionError):
                    raise value_error(f"{pp}.function.arguments", "must be a JSON object encoded as a string.") \
                        from None
                if not isinstance(parsed, dict):
                    raise value_error(f"{pp}.function.arguments", "must encode a JSON object.")
        elif args is not None and not isinstance(args, dict):
            raise type_error(f"{pp}.function.arguments", "a string", args)


def check_media_count(messages: list[dict[str, Any]], limits: Mapping[str, int]) -> None:
    """At most `limits[kind]` image / video parts in the whole conversation: each is opened and
    preprocessed before the prompt's length is known (glmrt.mm_limits)."""
    counts = dict.fromkeys(MM_KINDS, 0)
    for m in messages:
        content = m.get("content")
        for part in content if isinstance(content, list) else ():
            t = part.get("type")
            if t in _IMAGE_TYPES:
                counts["image"] += 1
            elif t in _VIDEO_TYPES:
                counts["video"] += 1
    for kind in MM_KINDS:
        if kind in limits and counts[kind] > limits[kind]:
            raise bad_request(f"At most {limits[kind]} {kind}(s) may be provided in one request; this one has "
                              f"{counts[kind]} (the server's --limit-mm-per-prompt).", "messages",
                              "too_many_media_items")


def check_messages(messages: Any) -> list[dict[str, Any]]:
    if messages is None:
        raise bad_request("Missing required parameter: 'messages'.", "messages", "missing_required_parameter")
    if not isinstance(messages, list):
        raise type_error("messages", "an array", messages)
    if not messages:
        raise bad_request("'messages' must contain at least one message.", "messages", "empty_array")
    for p, m in _each_object(messages, "messages"):
        role = m.get("role")
        if not isinstance(role, str):
            raise bad_request(f"Missing or invalid 'role' in '{p}'.", f"{p}.role", "invalid_value")
        if role not in _ROLES:
            raise bad_request(f"Invalid value for '{p}.role': {role!r}; expected one of {', '.join(_ROLES)}.",
                              f"{p}.role", "invalid_value")
        if "content" not in m and role != "assistant":
            raise bad_request(f"Missing required parameter: '{p}.content'.", f"{p}.content",
                              "missing_required_parameter")
        _check_content(m.get("content"), role, f"{p}.content")
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise type_error(f"{p}.name", "a string", m["name"])
        if role == "assistant":
            if m.get("tool_calls") is not None:
                _check_tool_calls(m["tool_calls"], f"{p}.tool_calls")
            rc = m.get("reasoning_content")
            if rc is not None and not isinstance(rc, str):
                raise type_error(f"{p}.reasoning_content", "a string", rc)
        if role == "tool" and m.get("tool_call_id") is not None and not isinstance(m["tool_call_id"], str):
            raise type_error(f"{p}.tool_call_id", "a string", m["tool_call_id"])
    return messages


def check_tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise type_error("tools", "an array", tools)
    for p, tool in _each_object(tools, "tools"):
        if tool.get("type", "function") != "function":
            raise not_supported(f"Tool type {tool.get('type')!r} is not supported; only 'function' tools are.",
                                f"{p}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise bad_request(f"Missing required parameter: '{p}.function'.", f"{p}.function",
                              "missing_required_parameter")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"'{p}.function.name' must be a non-empty string.", f"{p}.function.name",
                              "invalid_value")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise type_error(f"{p}.function.description", "a string", fn["description"])
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise type_error(f"{p}.function.parameters", "an object", fn["parameters"])
    return tools or None


def check_tool_choice(choice: Any, tools: list[dict[str, Any]] | None) -> str | dict[str, Any]:
    """"auto", "none", "required", or a named function `{"type": "function", "function": {"name"}}`
    (one of `tools`); "required" and a named function are enforced by a tool-call grammar."""
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise value_error("tool_choice", f"expected 'none', 'auto' or 'required', got {choice!r}.")
        if choice == "required" and not tools:
            raise bad_request("tool_choice 'required' needs a non-empty 'tools'.", "tool_choice", "invalid_value")
        return choice
    if isinstance(choice, dict):
        if choice.get("type") == "allowed_tools":
            raise not_supported("An allowed-tools tool_choice is not supported yet; use 'required' or a named "
                                "function.", "tool_choice")
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request("A named tool_choice is {\"type\": \"function\", \"function\": {\"name\": ...}}.",
                              "tool_choice", "invalid_value")
        names = [t["function"]["name"] for t in tools or []]
        if fn["name"] not in names:
            raise bad_request(f"tool_choice names the function {fn['name']!r}, which is not in 'tools'"
                              + (f" ({', '.join(map(repr, names))})." if names else "."), "tool_choice.function.name",
                              "invalid_value")
        return {"type": "function", "function": {"name": fn["name"]}}
    raise type_error("tool_choice", "a string or an object", choice)


def thinking_on(template_kwargs: Mapping[str, Any]) -> bool:
    """Whether the prompt opens a think block: yes unless `thinking` (or Qwen's and SGLang's
    spelling `enable_thinking`, read when `thinking` is absent) is false. A null value counts as
    absent, as it does for every field of a request."""
    value = template_kwargs.get("thinking")
    if value is None:
        value = template_kwargs.get("enable_thinking")
    return value is not False


def check_template_kwargs(body: Mapping) -> dict[str, Any]:
    kw = read_object(body, "chat_template_kwargs")
    kw = dict(kw or {})
    for key in ("thinking", "enable_thinking"):   # read by thinking_on
        if kw.get(key) is not None and not isinstance(kw[key], bool):
            raise type_error(f"chat_template_kwargs.{key}", "a boolean", kw[key])
    return kw

