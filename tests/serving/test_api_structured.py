"""Structured-output fields of chat and completions bodies: each spelling becomes one Grammar
that travels in the TokenizeRequest; forced tool calls keep their tools for the template and
the parser; a thinking budget is a sampling field."""

from __future__ import annotations

import json

from glmrt import protocol as P
from glmrt.sampling_params import Grammar
from glmrt.serving import openai_api as A
from tests.serving.openai_cases import TOOLS, chat, chat_err, comp, comp_err

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_response_format_spellings_on_chat_and_completions():
    for parse in (chat, comp):
        assert parse().grammar is None
        assert parse(response_format={"type": "text"}).grammar is None
        assert parse(response_format={"type": "json_object"}).grammar == Grammar("json_object")
        g = parse(response_format={"type": "json_schema",
                                   "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}).grammar
        assert g.kind == "json_schema" and json.loads(g.spec) == SCHEMA
        # OpenAI's schema is optional: then any JSON object
        assert parse(response_format={"type": "json_schema", "json_schema": {"name": "x"}}).grammar == \
            Grammar("json_object")


def test_sglang_and_vllm_top_level_fields():
    assert chat(regex="(yes|no)").grammar == Grammar("regex", "(yes|no)")
    assert comp(ebnf='root ::= "a"').grammar == Grammar("ebnf", 'root ::= "a"')
    assert chat(guided_regex="[0-9]+").grammar == Grammar("regex", "[0-9]+")
    assert chat(guided_grammar='root ::= "b"').grammar == Grammar("ebnf", 'root ::= "b"')
    for value in (SCHEMA, json.dumps(SCHEMA)):
        g = chat(guided_json=value).grammar
        assert g.kind == "json_schema" and json.loads(g.spec) == SCHEMA
    err = comp_err({"model": "glm-5.3-flash", "prompt": "x", "structured_outputs": {"regex": "a"}})
    assert err.status == 400 and err.param == "structured_outputs" and "'regex'" in err.message


def test_forced_tool_calls_become_a_tool_call_grammar_and_keep_their_tools():
    req = chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert req.tools == TOOLS and req.tool_choice == "required"
    spec = json.loads(req.grammar.spec)
    assert req.grammar.kind == "tool_call"
    assert spec == {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
    named = {"type": "function", "function": {"name": "get_weather"}}
    req = chat(tools=TOOLS, tool_choice=named)
    assert json.loads(req.grammar.spec)["tool_choice"] == named and req.tools == TOOLS
    assert chat(tools=TOOLS).grammar is None  # "auto": free text or calls, no grammar
    (tok,) = A.to_tokenize_requests(req, "r", "detokenizer/0")
    assert tok.tools == TOOLS and tok.grammar == req.grammar  # the template shows the tools


def test_the_grammar_travels_in_every_tokenize_request():
    req = comp(prompt=["a", "b"], regex="x+")
    toks = A.to_tokenize_requests(req, "r", "detokenizer/0")
    assert [t.grammar for t in toks] == [Grammar("regex", "x+")] * 2
    codec_back = P.TokenizeRequest  # the grammar is a positional msgspec field like the rest
    assert codec_back.__struct_fields__[-1] == "grammar"


def test_thinking_budget_is_a_sampling_field():
    assert A.to_sampling_params(chat(max_thinking_tokens=12)).max_thinking_tokens == 12
    assert A.to_sampling_params(chat()).max_thinking_tokens is None
    err = chat_err({"model": "glm-5.3-flash", "messages": [{"role": "user", "content": "x"}],
                    "max_thinking_tokens": "many"})
    assert err.param == "max_thinking_tokens" and err.code == "invalid_type"
