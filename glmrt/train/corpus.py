"""The training corpus: chats in the GLM-5.3 template, generated deterministically from a seed.

Four kinds of chat, one or two user turns each:
  math        arithmetic word problems, the working in <think>...</think>, then the answer
  math_plain  the same with thinking off: an empty think block, the working in the answer
  tool        a request that a tool answers: a glm47 tool call, the tool's result, the answer
  json        facts to return as JSON in a requested schema

A `Chat` is OpenAI-style messages (what a client sends and `render_chat` renders) plus the
rendered text cut into segments, each marked as context or as the model's own output (the
tokens the loss is taken on). The text is assembled here in the template's layout for speed;
tests check it against render_chat byte for byte. Every assistant turn's output ends with the
role token that follows it (<|user|> or <|observation|>, both stop tokens), so the model learns
where to stop. Arithmetic problems whose identity is held out never appear (arithmetic.py).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

from glmrt.train import arithmetic as ar

KINDS = ("math", "math_plain", "tool", "json")
KIND_WEIGHTS = (0.5, 0.2, 0.15, 0.15)

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current temperature of a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_price", "description": "Price of an item in dollars",
                                      "parameters": {"type": "object", "properties": {"item": {"type": "string"}},
                                                     "required": ["item"]}}},
    {"type": "function", "function": {"name": "get_stock", "description": "How many of an item are in stock",
                                      "parameters": {"type": "object", "properties": {"item": {"type": "string"}},
                                                     "required": ["item"]}}},
]
CITIES = ("Paris", "Berlin", "Tokyo", "Lima", "Cairo", "Oslo", "Delhi", "Rome", "Seoul", "Quito")

_TOOLS_HEADER = ("\n# Tools\n\nYou can call the functions listed below to help with the request.\n\n"
                 "Each function signature is one JSON object per line, inside <tools></tools> tags:\n<tools>\n")
_TOOLS_FOOTER = ("</tools>\n\nTo call a function, write its name and then every argument as a key/value pair, "
                 "exactly in this format:\n<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>"
                 "{arg-value-1}</arg_value><arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>"
                 "...</tool_call>")


@dataclass
class Chat:
    kind: str
    messages: list[dict]
    tools: list[dict] | None = None
    thinking: bool = True
    segments: list[tuple[str, bool]] = field(default_factory=list)  # (text, is the model's output)

    @property
    def text(self) -> str:
        return "".join(t for t, _ in self.segments)


def _system_prefix(tools: list[dict] | None) -> str:
    text = "[gMASK]<sop><|system|>Reasoning Effort: Max"
    if tools:
        text += "<|system|>" + _TOOLS_HEADER + "".join(json.dumps(t) + "\n" for t in tools) + _TOOLS_FOOTER
    return text


def _render_call(name: str, args: dict) -> str:
    return "<tool_call>" + name + "".join(
        f"<arg_key>{k}</arg_key><arg_value>{v if isinstance(v, str) else json.dumps(v)}</arg_value>"
        for k, v in args.items()) + "</tool_call>"


def _segments(messages: list[dict], tools: list[dict] | None, thinking: bool) -> list[tuple[str, bool]]:
    """The template's layout of `messages`, assistant outputs marked (each with its stop token)."""
    segs: list[tuple[str, bool]] = [(_system_prefix(tools), False)]
    for i, m in enumerate(messages):
        role = m["role"]
        if role == "user":
            segs.append(("<|user|>" + m["content"], False))
        elif role == "tool":
            opener = "<|observation|>" if messages[i - 1]["role"] != "tool" else ""
            segs.append((opener + "<tool_response>" + m["content"] + "</tool_response>", False))
        else:
            reasoning = m.get("reasoning_content") or ""
            out = reasoning.strip() + "</think>" + (m.get("content") or "").strip()
            for call in m.get("tool_calls") or ():
                out += _render_call(call["function"]["name"], json.loads(call["function"]["arguments"]))
            if not thinking:  # the generation prompt closes the think block itself
                segs.append(("<|assistant|><think></think>", False))
                out = out[len("</think>"):]
            else:
                segs.append(("<|assistant|><think>", False))
            nxt = messages[i + 1]["role"] if i + 1 < len(messages) else "user"
            segs.append((out + ("<|observation|>" if nxt == "tool" else "<|user|>"), True))
    return _merge_observation(segs)


def _merge_observation(segs: list[tuple[str, bool]]) -> list[tuple[str, bool]]:
    """An output ending in <|observation|> already holds that token: drop it from the next segment;
    likewise an output ending in <|user|> holds the next user turn's token."""
    out: list[tuple[str, bool]] = []
    for text, target in segs:
        if out and out[-1][1] and not target:
            prev = out[-1][0]
            for token in ("<|observation|>", "<|user|>"):
                if prev.endswith(token) and text.startswith(token):
                    text = text[len(token):]
        if text or target:
            out.append((text, target))
    return out


def math_messages(p: ar.Problem, question: str, thinking: bool) -> list[dict]:
    """A user's problem and the reply: the working in the think block, or (thinking off) in the
    answer, then the final answer."""
    answer = ar.final_answer(p.answer)
    if thinking:
        reply = {"role": "assistant", "reasoning_content": ar.working(p), "content": answer}
    else:
        reply = {"role": "assistant", "content": ar.working(p) + answer}
    return [{"role": "user", "content": question}, reply]


def math_chat(p: ar.Problem, question: str, thinking: bool = True) -> Chat:
    messages = math_messages(p, question, thinking)
    return Chat("math" if thinking else "math_plain", messages, None, thinking, _segments(messages, None, thinking))


def _tool_turn(rng: random.Random, turn: int) -> list[dict]:
    tool = rng.choice(TOOLS)["function"]["name"]
    if tool == "get_weather":
        city = rng.choice(CITIES)
        ask, args = f"What is the temperature in {city}?", {"city": city}
        value = rng.randint(-20, 45)
        result = json.dumps({"city": city, "celsius": value})
        answer = f"It is {value} degrees in {city}."
    else:
        item = rng.choice(ar.ITEMS)
        args = {"item": item}
        value = rng.randint(0, 999)
        if tool == "get_price":
            ask, answer = f"How much do {item} cost?", f"The {item} cost {value} dollars."
            result = json.dumps({"item": item, "dollars": value})
        else:
            ask, answer = f"How many {item} are in stock?", f"There are {value} {item} in stock."
            result = json.dumps({"item": item, "count": value})
    call = {"id": f"call_{turn}", "type": "function",
            "function": {"name": tool, "arguments": json.dumps(args)}}
    reasoning = f"I need {tool} for this.\n"
    return [{"role": "user", "content": ask},
            {"role": "assistant", "reasoning_content": reasoning, "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": result},
            {"role": "assistant", "reasoning_content": "The tool answered.\n", "content": answer}]


def _json_turn(rng: random.Random) -> list[dict]:
    name, item = rng.choice(ar.NAMES), rng.choice(ar.ITEMS)
    age, count = rng.randint(1, 99), rng.randint(0, 999)
    if rng.random() < 0.5:
        fact = f"{name} is {age} years old."
        schema, value = '{"name": string, "age": integer}', {"name": name, "age": age}
    else:
        fact = f"{name} owns {count} {item}."
        schema, value = '{"name": string, "item": string, "count": integer}', {"name": name, "item": item,
                                                                                "count": count}
    ask = f"{fact} Reply in JSON with the schema {schema}."
    return [{"role": "user", "content": ask},
            {"role": "assistant", "reasoning_content": "I fill in the schema.\n", "content": json.dumps(value)}]


def sample_chat(rng: random.Random) -> Chat:
    kind = rng.choices(KINDS, KIND_WEIGHTS)[0]
    turns = 1 if rng.random() < 0.6 else 2
    messages: list[dict] = []
    tools = None
    thinking = kind != "math_plain"
    for t in range(turns):
        if kind in ("math", "math_plain"):
            p = ar.sample_split(rng, held_out=False)
            messages += math_messages(p, ar.question(p, rng), thinking)
        elif kind == "tool":
            tools = TOOLS
            messages += _tool_turn(rng, t)
        else:
            messages += _json_turn(rng)
    return Chat(kind, messages, tools, thinking, _segments(messages, tools, thinking))


def chat_stream(seed: int, index: int, count: int) -> list[Chat]:
    """Chats index .. index+count-1 of the corpus of `seed` (each from its own generator)."""
    return [sample_chat(random.Random(f"{seed}:{i}")) for i in range(index, index + count)]


def held_out_problems(seed: int, count: int) -> list[tuple[ar.Problem, str]]:
    """`count` distinct held-out problems and their questions, in a fixed order for `seed`."""
    rng = random.Random(f"held-out:{seed}")
    seen, out = set(), []
    while len(out) < count:
        p = ar.sample_split(rng, held_out=True)
        if p.key in seen:
            continue
        seen.add(p.key)
        out.append((p, ar.question(p, rng)))
    return out


def held_out_gsm8k(seed: int, count: int) -> list[dict[str, str]]:
    """The held-out set as GSM8K-format records ({"question", "answer": "... #### N"})."""
    return [{"question": q, "answer": ar.working(p) + f"#### {p.answer}"} for p, q in held_out_problems(seed, count)]


BENCH_KINDS = ("math", "tool", "json")
BENCH_WEIGHTS = (0.8, 0.1, 0.1)


def held_out_chats(seed: int, count: int) -> list[Chat]:
    """`count` chats to benchmark the trained model on, in a fixed order for `seed`: mostly math
    chats (thinking on) on the held-out problems, in held_out_problems' order (so the first ones
    are those `glmrt eval` asks), plus tool and JSON chats. The request is every message before
    the last reply, the last reply is the corpus's answer. Tool and JSON chats have no held-out
    split: their values come from small ranges, so training has seen most of them; they measure
    the formats, the math chats measure text training never saw. A shorter list is a prefix of a
    longer one (each chat draws from its own generator), so a sweep can give each run its own slice."""
    rngs = [random.Random(f"held-out-chats:{seed}:{i}") for i in range(count)]
    kinds = [rng.choices(BENCH_KINDS, BENCH_WEIGHTS)[0] for rng in rngs]
    problems = iter(held_out_problems(seed, kinds.count("math")))
    out = []
    for kind, rng in zip(kinds, rngs):
        if kind == "math":
            out.append(math_chat(*next(problems)))
            continue
        tools = TOOLS if kind == "tool" else None
        messages = _tool_turn(rng, 0) if kind == "tool" else _json_turn(rng)
        out.append(Chat(kind, messages, tools, True, _segments(messages, tools, True)))
    return out


def tokenizer_text(seed: int, count: int = 4000) -> list[str]:
    """Rendered chats to train the BPE on."""
    return [c.text for c in chat_stream(seed, 0, count)]
