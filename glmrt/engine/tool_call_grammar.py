"""The structural tag of a forced glm47 tool call (`tool_choice` "required" or a named function).

The format is the chat template's (docs/PROTOCOLS.md, "Tool calls"):
`<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>`, strings raw and
every other value as JSON. xgrammar's own `glm_4_7` tag lets whitespace around each raw value,
which the glm47 parser keeps as part of a string; so for the usual parameter schema (an object
of named properties) the tag is built here with no such whitespace, the markers written as the
special tokens the vocabulary has for them (not spelled out in pieces): the properties in declared
order (required ones always, the others optionally), string values as raw text without `<`
(so a value cannot run into a marker) bounded by `minLength` / `maxLength` or their
`pattern`, enums as their members, other values by their JSON schema. Parameter schemas of
another shape (a root `anyOf`, `$ref`, `allOf`) use xgrammar's `glm_4_7` tag.
"""

from __future__ import annotations

from typing import Any

MARKERS = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")


def tool_call_tag(tools: list[dict], tool_choice: Any, parallel: bool, max_whitespace: int,
                  marker_tokens: frozenset[str] = frozenset()):
    """The StructuralTag that forces one call (or, with `parallel`, one or more calls).
    `marker_tokens`: the markers the vocabulary has as one token; the call writes those as
    that token (as the model was trained to), not spelled out in pieces."""
    import xgrammar as xgr
    from xgrammar import structural_tag as st

    functions = [t["function"] for t in tools if t.get("type", "function") == "function"]
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        functions = [f for f in functions if f["name"] == name]
    if not functions:
        raise ValueError("no function tool to call")

    def mark(text: str):
        return st.TokenFormat(token=text) if text in marker_tokens else st.ConstStringFormat(value=text)

    calls = []
    for fn in functions:
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not _flat_object(params):
            return xgr.get_model_structural_tag("glm_4_7", tools=tools, tool_choice=tool_choice, reasoning="disabled",
                                                max_whitespace_cnt=max_whitespace, parallel_tool_calls=parallel)
        calls.append(st.SequenceFormat(elements=[mark("<tool_call>"), st.ConstStringFormat(value=fn["name"]),
                                                 *_arguments(params, st, mark, max_whitespace), mark("</tool_call>")]))
    body = calls[0] if len(calls) == 1 else st.OrFormat(elements=calls)
    if parallel:
        body = st.PlusFormat(content=body)
    return st.StructuralTag(format=body)


def _flat_object(params: dict) -> bool:
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        return False
    if {"anyOf", "oneOf", "allOf", "$ref", "not", "if", "patternProperties"} & params.keys():
        return False
    props = params.get("properties", {})
    return isinstance(props, dict) and all(isinstance(p, dict) for p in props.values())


def _arguments(params: dict, st, mark, ws: int) -> list:
    props: dict = params.get("properties", {})
    required = [k for k in params.get("required", []) if k in props]
    defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
    pairs = []
    for key in [*required, *[k for k in props if k not in required]]:
        pair = st.SequenceFormat(elements=[mark("<arg_key>"), st.ConstStringFormat(value=key), mark("</arg_key>"),
                                           mark("<arg_value>"), _value(props[key], defs, st, ws), mark("</arg_value>")])
        pairs.append(pair if key in required else st.OptionalFormat(content=pair))
    return pairs


def _value(schema: dict, defs: dict, st, ws: int):
    members = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if members is not None and members and all(isinstance(m, str) for m in members):
        return st.OrFormat(elements=[st.ConstStringFormat(value=m) for m in members])
    if schema.get("type") == "string" and members is None and "format" not in schema:
        # NOTE: a regex's character class matches whole UTF-8 characters (any_text would let
        # half a character through); "<" is left out so a value cannot run into a marker
        lo, hi = schema.get("minLength", 0), schema.get("maxLength", "")
        return st.RegexFormat(pattern=schema.get("pattern", f"[^<]{{{lo},{hi}}}"))
    return st.JSONSchemaFormat(json_schema={**schema, **defs}, style="json", max_whitespace_cnt=ws)
