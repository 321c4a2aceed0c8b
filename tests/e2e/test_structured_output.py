"""E2E: structured output through the real `openai` client on one deployment of the random tiny
checkpoint. At temperature 1.0 only the grammar keeps its answers valid: every case runs 52
generations (streamed and not, n = 4) that must stop by themselves (a "length" finish fails)
and parse, validate (jsonschema) or fully match; thinking on, with a thinking budget that
forces `</think>`, puts the answer in `content`; bad grammars answer 400 and harm nothing;
afterwards no request or matcher is left on the engine."""

from __future__ import annotations

import asyncio
import json
import re
import time

import jsonschema
import pytest

from tests.e2e.api_cases import CONTEXT, extra_field

pytestmark = pytest.mark.slow

NOTHINK = {"chat_template_kwargs": {"thinking": False}}
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 400}
ROUNDS, N = 13, 4  # 13 requests of 4 choices: 52 generations per case, 7 of them streamed

NESTED = {"type": "object", "properties": {
    "user": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8},
        "role": {"enum": ["admin", "guest", "dev"]}}, "required": ["name", "role"], "additionalProperties": False},
    "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
    "ok": {"type": "boolean"}}, "required": ["user", "scores", "ok"], "additionalProperties": False}
UNION = {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                                              "y": {"type": "integer", "minimum": -9, "maximum": 9}},
                             "required": ["x", "y"], "additionalProperties": False}},
         "type": "object", "properties": {
             "shape": {"anyOf": [{"$ref": "#/$defs/point"}, {"type": "null"}, {"enum": ["circle", "square"]}]},
             "label": {"type": "string", "maxLength": 5}},
         "required": ["shape", "label"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                         "unit": {"enum": ["c", "f"]}},
        "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "set_alarm", "description": "An alarm", "parameters": {
        "type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                                         "loud": {"type": "boolean"}},
        "required": ["hour", "loud"]}}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def dep(start_deployment):
    d = start_deployment(["--context-length", str(CONTEXT)], name="structured")
    yield d
    d.stop(term_wait=5)


@pytest.fixture(scope="module")
def aclient(dep):
    return dep  # each asyncio.run gets its own AsyncOpenAI client (one event loop each)


@pytest.fixture(scope="module")
def model(dep):
    return dep.model_id()


def run_all(dep, make):
    async def main():
        client = dep.async_client(timeout=120.0)
        try:
            return await asyncio.gather(*make(client))
        finally:
            await client.close()
    return asyncio.run(main())


async def _chat(aclient, stream: bool, **kw) -> list[dict]:
    """One request of N choices -> per choice {content, reasoning, tool_calls, finish}."""
    if not stream:
        r = await aclient.chat.completions.create(n=N, **kw)
        return [{"content": c.message.content, "reasoning": extra_field(c.message, "reasoning_content"),
                 "tool_calls": [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []],
                 "finish": c.finish_reason, "token_ids": extra_field(c, "token_ids")}
                for c in sorted(r.choices, key=lambda c: c.index)]
    out = [{"content": "", "reasoning": "", "tool_calls": {}, "finish": None, "token_ids": []} for _ in range(N)]
    async for chunk in await aclient.chat.completions.create(n=N, stream=True, **kw):
        for c in chunk.choices:
            o = out[c.index]
            o["content"] += c.delta.content or ""
            o["reasoning"] += extra_field(c.delta, "reasoning_content") or ""
            for t in c.delta.tool_calls or []:
                name, args = o["tool_calls"].get(t.index, ("", ""))
                o["tool_calls"][t.index] = (name + (t.function.name or ""), args + (t.function.arguments or ""))
            o["finish"] = c.finish_reason or o["finish"]
            o["token_ids"] += extra_field(c, "token_ids") or []
    for o in out:
        o["tool_calls"] = [o["tool_calls"][i] for i in sorted(o["tool_calls"])]
    return out


def generations(aclient, **kw) -> list[dict]:
    kw["extra_body"] = {**kw.get("extra_body", {}), "return_token_ids": True}  # shown when a case fails
    results = run_all(aclient, lambda client: [_chat(client, stream=i % 2 == 1, **kw) for i in range(ROUNDS)])
    gens = [g for r in results for g in r]
    assert len(gens) == ROUNDS * N
    bad = [g for g in gens if g["finish"] not in ("stop", "tool_calls")]
    assert not bad, f"{len(bad)} generations did not stop by themselves: {bad[:2]}"
    return gens


@pytest.mark.timeout(240)
@pytest.mark.parametrize("schema", [NESTED, UNION], ids=["nested", "anyof-ref"])
def test_json_schema_answers_validate(aclient, model, schema):
    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    for g in generations(aclient, model=model, messages=[{"role": "user", "content": "JSON please"}],
                         response_format=rf, extra_body=NOTHINK, **SAMPLING):
        jsonschema.validate(json.loads(g["content"]), schema)


@pytest.mark.timeout(240)
def test_regex_answers_fully_match(aclient, model):
    pattern = r"(yes|no), [a-z]{1,6} [0-9]{2}"
    for g in generations(aclient, model=model, messages=[{"role": "user", "content": "Answer"}],
                         extra_body={"regex": pattern, **NOTHINK}, **SAMPLING):
        assert re.fullmatch(pattern, g["content"]), g


@pytest.mark.timeout(240)
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "set_alarm"}}],
                         ids=["required", "named"])
def test_forced_tool_calls_parse_into_the_tool_schema(aclient, model, choice):
    for g in generations(aclient, model=model, messages=[{"role": "user", "content": "Call a tool"}],
                         tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, extra_body=NOTHINK, **SAMPLING):
        assert g["finish"] == "tool_calls" and len(g["tool_calls"]) == 1, g
        name, args = g["tool_calls"][0]
        if isinstance(choice, dict):
            assert name == "set_alarm"
        try:
            jsonschema.validate(json.loads(args), PARAMS[name])
        except jsonschema.ValidationError as e:
            raise AssertionError(f"{e.message}: {g}") from None
        assert not (g["content"] or "").strip()


@pytest.mark.timeout(240)
def test_thinking_then_the_answer_in_content(aclient, model):
    budget = 8
    gens = generations(aclient, model=model, messages=[{"role": "user", "content": "Think, then JSON"}],
                       response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": NESTED}},
                       extra_body={"max_thinking_tokens": budget}, **SAMPLING)
    for g in gens:
        jsonschema.validate(json.loads(g["content"]), NESTED)
    assert any(g["reasoning"] for g in gens)  # the think block was free text, ended by </think>


@pytest.mark.timeout(120)
def test_completions_with_a_schema(dep, model):
    schema = {"type": "object", "properties": {"v": {"enum": [1, 2, 3]}}, "required": ["v"],
              "additionalProperties": False}
    c = dep.client(timeout=60.0)
    r = c.completions.create(model=model, prompt="A JSON object:", n=8, temperature=1.0, max_tokens=100,
                             extra_body={"response_format": {"type": "json_schema",
                                                             "json_schema": {"name": "v", "schema": schema}}})
    assert len(r.choices) == 8
    for ch in r.choices:
        assert ch.finish_reason == "stop", ch
        jsonschema.validate(json.loads(ch.text), schema)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("extra, reason", [
    ({"regex": "(unclosed"}, "regex cannot be compiled"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "JSON schema cannot be compiled"),
    ({"ebnf": "root ::= missing"}, 'Rule "missing" is not defined'),
])
def test_bad_grammars_answer_400_with_the_reason(dep, model, extra, reason):
    import openai
    c = dep.client(timeout=30.0)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as ei:
            r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=5,
                                          stream=stream, extra_body=extra)
            if stream:
                list(r)
        assert ei.value.status_code == 400 and reason in ei.value.message, ei.value.message
    ok = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                   extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == 3  # nothing else harmed


@pytest.mark.timeout(60)
def test_nothing_is_left_on_the_engine(dep):
    deadline = time.monotonic() + 10
    while True:
        time.sleep(1.1)  # an EngineStats period
        eng = next(iter(dep.get_json("/server_info")["engines"].values()))
        if eng.get("running") == 0 and eng.get("waiting") == 0 and eng.get("constrained") == 0:
            break
        assert time.monotonic() < deadline, eng
    assert isinstance(eng["grammars_compiled"], (int, float))
