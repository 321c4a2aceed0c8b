"""Structured output in the engine: the random tiny model at temperature 1 (only the mask keeps
it valid), every answer parses and validates; think blocks stay free, thinking budgets force
`</think>`; bad grammars are refused with the reason; constrained rows skip the overlap path."""

from __future__ import annotations

import json
import os
import re

import jsonschema
import pytest
import torch

torch.set_num_threads(1)

from glmrt.checkpoint.tokenizer import special_token_ids  # noqa: E402
from glmrt.engine.config import EngineConfig  # noqa: E402
from glmrt.engine.engine import Engine  # noqa: E402
from glmrt.engine.structured import GrammarError, utf8_tail  # noqa: E402
from glmrt.sampling_params import Grammar, SamplingParams  # noqa: E402
from glmrt.serving.tool_parser import Glm47ToolParser  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    "size": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "tags", "size"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"]}}}]


@pytest.fixture(scope="module")
def engine(ckpt, model):
    e = Engine(EngineConfig(model=ckpt, page_size=8), model=model, log=lambda *a: None)
    yield e
    e.runner.structured.close()


@pytest.fixture(scope="module")
def tok(ckpt):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(os.path.join(ckpt, "tokenizer.json"))


@pytest.fixture(scope="module")
def ids(engine):
    return special_token_ids(engine.model_config.text.vocab_size)


def answers(engine, tok, grammar, n=8, prompt=(5, 6, 7), **kw):
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=kw.pop("max_tokens", 200), n=n, seed=1, **kw)
    (choices,) = engine.generate([list(prompt)], params) if grammar is None else _generate(engine, prompt, params, grammar)
    out = []
    for c in choices:
        assert c.finish_reason == "stop", (c.finish_reason, tok.decode(c.output_ids, skip_special_tokens=False))
        body = c.output_ids[:-1] if c.output_ids[-1] in engine.eos_ids else c.output_ids
        out.append((c, tok.decode(body, skip_special_tokens=False)))
    return out


def _generate(engine, prompt, params, grammar):
    rids = engine.add_request(list(prompt), params, grammar=grammar)
    while engine.has_work():
        engine.step()
    return [[engine._completion(engine.requests.pop(r)) for r in rids]]


def test_json_schema_answers_validate(engine, tok):
    for _, text in answers(engine, tok, Grammar("json_schema", json.dumps(SCHEMA))):
        jsonschema.validate(json.loads(text), SCHEMA)
    assert not engine.runner.structured.constraints  # every finished choice let go of its matcher


def test_regex_answers_fully_match(engine, tok):
    pattern = r"(yes|no)-[0-9]{2,4}"
    for _, text in answers(engine, tok, Grammar("regex", pattern)):
        assert re.fullmatch(pattern, text), text


def test_json_object_answers_are_objects(engine, tok):
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=300, n=8, seed=3)
    (choices,) = _generate(engine, (5, 6, 7), params, Grammar("json_object"))
    stopped = [c for c in choices if c.finish_reason == "stop"]
    assert stopped  # an unbounded grammar: a random model may run to the limit, but not always
    for c in stopped:
        assert isinstance(json.loads(tok.decode(c.output_ids[:-1], skip_special_tokens=False)), dict)


def test_forced_tool_call_parses_into_the_tool_schema(engine, tok):
    spec = json.dumps({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                       "parallel_tool_calls": False})
    for _, text in answers(engine, tok, Grammar("tool_call", spec)):
        content, calls = Glm47ToolParser(TOOLS).parse(text)
        assert len(calls) == 1 and calls[0].complete and content.strip() == "", text
        assert calls[0].name == "get_weather"
        jsonschema.validate(json.loads(calls[0].arguments_json), TOOLS[0]["function"]["parameters"])


def test_thinking_is_free_then_the_grammar_applies(engine, tok, ids):
    prompt = (5, 6, ids["<think>"])  # the template's generation prompt with thinking on
    budget = 6
    for c, text in answers(engine, tok, Grammar("json_schema", json.dumps(SCHEMA)), prompt=prompt,
                           max_thinking_tokens=budget):
        end = c.output_ids.index(ids["</think>"])
        assert end <= budget
        jsonschema.validate(json.loads(tok.decode(c.output_ids[end + 1:-1], skip_special_tokens=False)), SCHEMA)


def test_thinking_budget_alone_forces_the_end_of_the_think_block(engine, tok, ids):
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, max_thinking_tokens=3, n=4)
    (choices,) = engine.generate([[5, 6, ids["<think>"]]], params)
    for c in choices:
        assert ids["</think>"] in c.output_ids[:4]
    (choices,) = engine.generate([[5, 6, ids["</think>"]]], params)  # thinking off: nothing forced
    assert len(choices[0].output_ids) == 12


@pytest.mark.parametrize("grammar, reason", [
    (Grammar("regex", "(unclosed"), "regex cannot be compiled: Regex parsing error"),
    (Grammar("json_schema", '{"type": 5}'), "JSON schema cannot be compiled"),
    (Grammar("ebnf", "root ::= missing"), 'Rule "missing" is not defined'),
])
def test_a_grammar_that_cannot_compile_is_refused_with_its_reason(engine, grammar, reason):
    with pytest.raises(GrammarError, match=re.escape(reason)):
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=4), grammar=grammar)
    assert not engine.requests and not engine.scheduler.waiting
    # the engine goes on serving, and the same grammar is refused again (refusals are not cached)
    (choices,) = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(choices[0].output_ids) == 3
    with pytest.raises(GrammarError):
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=4), grammar=grammar)


def test_equal_grammars_compile_once(engine):
    so = engine.runner.structured
    g = Grammar("regex", "[a-c]{3}")
    first = so.compile(g)
    assert so.compile(Grammar("regex", "[a-c]{3}")) is first
    first.result()


def test_constrained_rows_run_outside_the_overlap_path(engine):
    class Plan:
        restores = saves = forks = retracted = ()

    class Work:
        num, sample, start = 1, True, 4

    rids = engine.add_request([5, 6, 7], SamplingParams(max_tokens=4), grammar=Grammar("regex", "[a-c]{3}"))
    free = engine.add_request([5, 6, 8], SamplingParams(max_tokens=4))
    engine.runner.eager_async = True
    try:
        plan = Plan()
        w_free, w_con = Work(), Work()
        w_free.req, w_con.req = engine.requests[free[0]], engine.requests[rids[0]]
        plan.work = [w_free]
        assert engine.runner.async_key(plan) == ()
        plan.work = [w_free, w_con]
        assert engine.runner.async_key(plan) is None
    finally:
        engine.runner.eager_async = False
        for r in rids + free:
            engine.abort(r)
            engine.requests.pop(r)




def _allowed(mask, row: int, token: int) -> bool:
    return bool((int(mask.bits[row, token // 32]) >> (token % 32)) & 1)


def test_a_character_a_token_left_unfinished_is_finished_validly(engine):
    so = engine.runner.structured
    so.compiled(Grammar("regex", "x[^a]{0,4}"))  # the tokenizer info is built
    byte_token = {b[0]: i for i, b in enumerate(so._token_bytes) if len(b) == 1}
    (rid,) = engine.add_request([5, 6, 7], SamplingParams(max_tokens=8), grammar=Grammar("regex", "x[^a]{0,4}"))
    req = engine.requests[rid]
    try:
        for b in (ord("x"), 0xE0):  # E0 must be followed by A0..BF (80..9F would be an overlong form)
            req.output_ids.append(byte_token[b])
            so.accept(req, byte_token[b])
        mask = so.fill([req])
        assert _allowed(mask, 0, byte_token[0xA5]) and not _allowed(mask, 0, byte_token[0x85])
        for b in (0xA5, 0x80, 0xED):  # a whole character, then ED: 80..9F only (A0..BF: a surrogate)
            req.output_ids.append(byte_token[b])
            so.accept(req, byte_token[b])
        mask = so.fill([req])
        assert _allowed(mask, 0, byte_token[0x9F]) and not _allowed(mask, 0, byte_token[0xB7])
    finally:
        engine.abort(rid)
        engine.requests.pop(rid)


def test_the_decode_side_replays_the_first_token_through_its_matcher(engine, tok):
    from glmrt.engine.handoff.sink import HandoffSink
    sink = HandoffSink(engine)
    first = tok.token_to_id("y")
    grammar = Grammar("regex", "(yes|no)")
    sink.reserve("handed", [5, 6, 7, 8], first, SamplingParams(max_tokens=8), grammar=grammar)
    try:
        req = engine.requests["handed"]
        mask = engine.runner.structured.fill([req])
        assert _allowed(mask, 0, tok.token_to_id("e")) and not _allowed(mask, 0, tok.token_to_id("o"))
    finally:
        sink.cancel("handed")
    assert "handed" not in engine.runner.structured.constraints


def test_a_retracted_request_keeps_its_matcher(ckpt, model, tok):
    """Retraction frees a request's cache and recomputes its prompt and outputs; the outputs
    stay, so the matcher's state stays right: the answers still fully match."""
    e0 = Engine(EngineConfig(model=ckpt, page_size=8), model=model, log=lambda *a: None)
    lay = e0.layout
    e0.runner.structured.close()
    budget = 64 * lay.state_bytes_per_slot + 5 * lay.kv_bytes_per_page
    e = Engine(EngineConfig(model=ckpt, page_size=8, max_mamba_cache_size=64, cache_memory_gb=budget / 2**30,
                            disable_radix_cache=True), model=model, log=lambda *a: None)
    pattern = "[a-z]{12,16}"
    try:
        groups = [e.add_request([600 + i] * 12, SamplingParams(temperature=1.0, top_p=1.0, max_tokens=40, seed=i),
                                grammar=Grammar("regex", pattern)) for i in range(4)]
        while e.has_work():
            e.step()
        assert e.counters["retractions"] > 0
        for (rid,) in groups:
            req = e.requests.pop(rid)
            assert req.finish_reason == "stop"
            assert re.fullmatch(pattern, tok.decode(req.output_ids[:-1], skip_special_tokens=False))
    finally:
        e.runner.structured.close()


def test_special_tokens_the_detokenizer_drops_are_never_in_an_answer(engine, ids):
    (rid,) = engine.add_request([5, 6, 7], SamplingParams(max_tokens=8), grammar=Grammar("regex", ".{0,20}"))
    try:
        mask = engine.runner.structured.fill([engine.requests[rid]])
        assert _allowed(mask, 0, ids["<tool_call>"])  # a marker the parsers read as text
        for dropped in ("[gMASK]", "<|assistant|>", "<|image|>"):
            assert not _allowed(mask, 0, ids[dropped]), dropped
        assert _allowed(mask, 0, ids["<|endoftext|>"])  # EOS: the grammar may end here
    finally:
        engine.abort(rid)
        engine.requests.pop(rid)


@pytest.mark.parametrize("data, tail", [
    (b"abc", b""), ("é中😀".encode(), b""), (b"a\xe4\xb8", b"\xe4\xb8"), (b"\xf0\x9f", b"\xf0\x9f"),
    (b"\xe0\x95", None), (b"\xed\xa0", None), (b"\xf4\x90", None), (b"\x80", None), (b"\xc0\xaf", None),
])
def test_utf8_tail(data, tail):
    assert utf8_tail(data) == tail
