"""The synthetic corpus: deterministic, in the chat template's exact layout, held-out disjoint."""

import random
import re

import pytest

from glmrt.serving.chat_template import render_chat
from glmrt.train import arithmetic as ar
from glmrt.train.corpus import KINDS, chat_stream, held_out_gsm8k, held_out_problems, math_chat


@pytest.fixture(scope="module")
def chats():
    return chat_stream(0, 0, 600)


def test_same_seed_same_chats_and_other_seed_other_chats(chats):
    again = chat_stream(0, 0, 600)
    assert [c.text for c in again] == [c.text for c in chats]
    assert [c.text for c in chat_stream(1, 0, 50)] != [c.text for c in chats[:50]]
    assert chat_stream(0, 10, 5)[0].text == chats[10].text  # a chat depends on (seed, index) only


def test_every_kind_occurs_and_renders_as_the_chat_template_does(chats):
    assert {c.kind for c in chats} == set(KINDS)
    for c in chats:
        ref = render_chat(c.messages, c.tools, add_generation_prompt=False, thinking=c.thinking)
        assert c.text == ref + "<|user|>", c.kind
        outputs = [t for t, is_out in c.segments if is_out]
        assert len(outputs) == sum(m["role"] == "assistant" for m in c.messages)
        assert all(o.endswith(("<|user|>", "<|observation|>")) for o in outputs)


def test_generation_prompt_is_the_context_before_each_reply(chats):
    c = next(c for c in chats if c.kind == "math_plain")
    prompt = render_chat(c.messages[:1], None, add_generation_prompt=True, thinking=False)
    assert c.segments[0][0] + c.segments[1][0] + c.segments[2][0] == prompt
    assert not c.segments[2][1] and c.segments[3][1]


def _problem_keys(text: str) -> list[str]:
    """Problem identities from the working blocks of a chat ("a op b:" lines, chained)."""
    keys, key, prev = [], None, None
    for a, op, b in re.findall(r"(\d+)([+\-*])(\d+):\n", text):
        if key is None or int(a) != prev:
            if key:
                keys.append(key)
            key = a
        key += op + b
        prev = int(a) + int(b) if op == "+" else int(a) - int(b) if op == "-" else int(a) * int(b)
    if key:
        keys.append(key)
    return keys


def test_held_out_problems_never_reach_training(chats):
    held = held_out_problems(0, 500)
    held_keys = {p.key for p, _ in held}
    assert len(held_keys) == 500
    train_keys = [k for c in chats if c.kind.startswith("math") for k in _problem_keys(c.text)]
    assert len(train_keys) > 300
    assert not held_keys & set(train_keys)
    rng = random.Random(5)
    assert not any(ar.is_held_out(ar.sample_split(rng, held_out=False)) for _ in range(2000))


def test_held_out_problems_need_two_operations_with_operands_up_to_999():
    for p, q in held_out_problems(0, 500):
        assert 2 <= len(p.ops) <= 3 and 0 < p.start <= ar.MAX_OPERAND
        assert all(0 < n <= ar.MAX_OPERAND and (op != "*" or n <= 9) for op, n in p.ops)
        assert all(0 <= r <= ar.MAX_OPERAND for r in p.results())
        assert str(p.start) in q


@pytest.mark.parametrize("a,op,b", [(347, "+", 586), (95, "+", 7), (1, "+", 999), (704, "-", 219), (100, "-", 1),
                                    (347, "*", 2), (111, "*", 9), (5, "*", 3)])
def test_column_working_is_correct_arithmetic(a, op, b):
    lines = ar.column_lines(a, op, b)
    for line in lines:
        lhs, rhs = line.split("=")
        assert eval(lhs) == int(rhs)  # noqa: S307 - digits and + - * only
    p = ar.Problem(a, ((op, b),))
    assert ar.working(p).endswith(f"={eval(f'{a}{op}{b}')}\n")  # noqa: S307


def test_gsm8k_export_ends_with_the_answer():
    recs = held_out_gsm8k(0, 20)
    probs = held_out_problems(0, 20)
    for rec, (p, q) in zip(recs, probs):
        assert rec["question"] == q
        assert rec["answer"].endswith(f"#### {p.answer}")
        assert ar.extract_answer(rec["answer"]) == p.answer
    chat = math_chat(*probs[0])
    assert chat.messages[1]["content"] == f"The answer is {probs[0][0].answer}."


def test_held_out_chats_are_deterministic_held_out_and_render_as_training_did(chats):
    from glmrt.train.corpus import held_out_chats

    bench = held_out_chats(0, 60)
    assert [c.messages for c in held_out_chats(0, 60)] == [c.messages for c in bench]
    assert [c.messages for c in held_out_chats(0, 20)] == [c.messages for c in bench[:20]]  # a prefix
    assert [c.messages for c in held_out_chats(1, 20)] != [c.messages for c in bench[:20]]
    kinds = [c.kind for c in bench]
    assert kinds.count("math") > len(bench) // 2 and {"tool", "json"} & set(kinds)
    # the math chats ask the held-out problems in eval's order, none of which training sees
    math = [c for c in bench if c.kind == "math"]
    assert [c.messages[0]["content"] for c in math] == [q for _, q in held_out_problems(0, len(math))]
    train_keys = {k for c in chats if c.kind.startswith("math") for k in _problem_keys(c.text)}
    assert not {k for c in math for k in _problem_keys(c.text)} & train_keys
    for c in bench:  # the request renders as the context training put before the last reply
        last = max(i for i, (_, is_out) in enumerate(c.segments) if is_out)
        assert render_chat(c.messages[:-1], c.tools, thinking=True) == "".join(t for t, _ in c.segments[:last])
