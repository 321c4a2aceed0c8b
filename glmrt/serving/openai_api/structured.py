"""The structured-output fields of a request body, checked into one `Grammar` (or None).

Spellings: OpenAI's `response_format` (`{"type": "text" | "json_object" | "json_schema",
"json_schema": {"name", "schema", "strict"}}`, on chat and completions), SGLang's top-level
`regex` and `ebnf`, vLLM's `guided_json` / `guided_regex` / `guided_grammar`; chat's
`tool_choice` "required" or a named function (built by the chat parser: `tool_call_grammar`).
At most one of them per request. Only the shape is checked here (the api never imports
xgrammar): the engine compiles the grammar and answers 400 with xgrammar's reason when it
cannot.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from glmrt.sampling_params import Grammar
from glmrt.serving.openai_api.errors import bad_request, not_supported
from glmrt.serving.openai_api.fields import read_object, type_error, value_error

# vLLM spellings we read as ours, and the ones we refuse naming what to send instead
_VLLM_ALIASES = {"guided_regex": "regex", "guided_grammar": "ebnf", "guided_json": "json_schema"}
_VLLM_REFUSED = {
    "guided_choice": "send 'regex' with the alternatives, e.g. \"(yes|no)\"",
    "structured_outputs": "send 'response_format', 'regex' or 'ebnf'",
    "guided_decoding_backend": "glmrt always uses xgrammar; leave it out",
    "guided_whitespace_pattern": "leave it out (JSON whitespace is bounded by the engine)",
}


def parse_structured(body: Mapping) -> Grammar | None:
    """The request's grammar from its structured-output fields; APIError (400) for a bad shape,
    for an unsupported spelling, or for more than one constraint."""
    for name, why in _VLLM_REFUSED.items():
        if body.get(name) is not None:
            raise not_supported(f"'{name}' is not supported: {why}.", name)
    found: list[tuple[str, Grammar]] = []
    rf = _response_format(body)
    if rf is not None:
        found.append(("response_format", rf))
    for name in ("regex", "ebnf", *_VLLM_ALIASES):
        if body.get(name) is None:
            continue
        kind = _VLLM_ALIASES.get(name, name)
        value = body[name]
        if kind == "json_schema":
            found.append((name, _schema_grammar(value, name)))
            continue
        if not isinstance(value, str):
            raise type_error(name, "a string", value)
        if not value:
            raise value_error(name, "must not be empty.")
        found.append((name, Grammar(kind, value)))
    if len(found) > 1:
        names = ", ".join(f"'{n}'" for n, _ in found)
        raise bad_request(f"Only one structured-output constraint per request: got {names}.", found[1][0],
                          "invalid_value")
    return found[0][1] if found else None


def _response_format(body: Mapping) -> Grammar | None:
    rf = read_object(body, "response_format")
    if rf is None:
        return None
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar("json_object")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise bad_request("Missing required parameter: 'response_format.json_schema'.",
                              "response_format.json_schema", "missing_required_parameter")
        name = js.get("name")
        if name is not None and not isinstance(name, str):
            raise type_error("response_format.json_schema.name", "a string", name)
        strict = js.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise type_error("response_format.json_schema.strict", "a boolean", strict)
        schema = js.get("schema")
        if schema is None:  # OpenAI's schema is optional: then any JSON object
            return Grammar("json_object")
        return _schema_grammar(schema, "response_format.json_schema.schema")
    if not isinstance(kind, str):
        raise type_error("response_format.type", "a string", kind)
    raise not_supported(f"response_format type {kind!r} is not supported; use 'text', 'json_object' or "
                        "'json_schema'.", "response_format.type")


def _schema_grammar(schema: Any, param: str) -> Grammar:
    if isinstance(schema, str):  # vLLM's guided_json may be the schema's JSON text
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError):
            raise value_error(param, "is not valid JSON.") from None
    if not isinstance(schema, (dict, bool)):
        raise type_error(param, "an object (a JSON schema)", schema)
    return Grammar("json_schema", json.dumps(schema, ensure_ascii=False))


def tool_call_grammar(tools: list[dict[str, Any]], tool_choice: Any, parallel_tool_calls: bool) -> Grammar:
    """The grammar of a forced call: `tool_choice` "required" (any of `tools`) or a named function."""
    return Grammar("tool_call", json.dumps({"tools": tools, "tool_choice": tool_choice,
                                            "parallel_tool_calls": parallel_tool_calls}, ensure_ascii=False))

