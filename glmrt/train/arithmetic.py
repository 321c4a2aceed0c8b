"""Multi-step arithmetic word problems and their column-wise working.

A problem is a start number and two or three operations (+ n, - n, x d with d one digit),
operands up to 999, every intermediate result in [0, 999]. Its identity (`Problem.key`) is the
numbers and operations alone: names and items are surface, so a held-out problem never reaches
training under another name. One hash bucket of identities is held out (`is_held_out`).

The working is written so that a very small model can learn it: digits are single tokens (the
tokenizer splits them), each operation is restated, then worked one column per line from the
units up with the carry or borrow written out, then its result:

    347+586:
    7+6=13
    4+8+1=13
    3+5+1=9
    =933
"""

from __future__ import annotations

import random
import re
import zlib
from dataclasses import dataclass

MAX_OPERAND = 999
HELD_OUT_BUCKETS = 20  # one bucket in 20 of problem identities is held out

NAMES = ("Ana", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Kira", "Liam",
         "Mia", "Noah", "Olga", "Pavel", "Rosa", "Sam", "Tara", "Yuki")
ITEMS = ("apples", "books", "coins", "stamps", "marbles", "cards", "shells", "pencils", "stickers", "boxes")
_ADD = ("Then {p} gets {n} more.", "{P} buys {n} more.", "A friend gives {o} {n} more.")
_SUB = ("Then {p} gives away {n}.", "{P} sells {n} of them.", "{P} loses {n}.")
_MUL = ("Then {p} ends up with {n} times as many.", "{P} multiplies them by {n}.")


@dataclass(frozen=True)
class Problem:
    start: int
    ops: tuple[tuple[str, int], ...]  # ("+", n) | ("-", n) | ("*", d)

    @property
    def key(self) -> str:
        return f"{self.start}" + "".join(f"{op}{n}" for op, n in self.ops)

    def results(self) -> list[int]:
        out, x = [], self.start
        for op, n in self.ops:
            x = x + n if op == "+" else x - n if op == "-" else x * n
            out.append(x)
        return out

    @property
    def answer(self) -> int:
        return self.results()[-1]


def is_held_out(problem: Problem) -> bool:
    return zlib.crc32(problem.key.encode()) % HELD_OUT_BUCKETS == 0


def sample_problem(rng: random.Random, min_ops: int = 2, max_ops: int = 3) -> Problem:
    """A random problem (both splits): every intermediate result stays in [0, 999]."""
    while True:
        x = rng.randint(2, MAX_OPERAND)
        start, ops = x, []
        for _ in range(rng.randint(min_ops, max_ops)):
            kind = rng.choice("+-*") if x <= MAX_OPERAND // 2 else rng.choice("+--")
            if kind == "+" and x < MAX_OPERAND:
                n = rng.randint(1, MAX_OPERAND - x)
            elif kind == "-" and x > 1:
                n = rng.randint(1, x - 1)
            elif kind == "*" and x * 2 <= MAX_OPERAND:
                n = rng.randint(2, min(9, MAX_OPERAND // x))
            else:
                break
            ops.append((kind, n))
            x = x + n if kind == "+" else x - n if kind == "-" else x * n
        if len(ops) >= min_ops:
            return Problem(start, tuple(ops))


def sample_split(rng: random.Random, held_out: bool) -> Problem:
    while True:
        p = sample_problem(rng)
        if is_held_out(p) == held_out:
            return p


def question(problem: Problem, rng: random.Random) -> str:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    she = rng.random() < 0.5
    pron, poss = ("she", "her") if she else ("he", "him")
    parts = [f"{name} has {problem.start} {item}."]
    for op, n in problem.ops:
        table = _ADD if op == "+" else _SUB if op == "-" else _MUL
        parts.append(rng.choice(table).format(p=pron, P=pron.capitalize(), o=poss, n=n))
    parts.append(f"How many {item} does {name} have now?")
    return " ".join(parts)


def _digits(n: int, width: int) -> list[int]:
    return [(n // 10 ** i) % 10 for i in range(width)]


def column_lines(a: int, op: str, b: int) -> list[str]:
    """One line per column, units first, for a op b (b one digit when op is '*')."""
    lines = []
    if op == "*":
        carry = 0
        for d in _digits(a, len(str(a))):
            p = d * b + carry
            lines.append(f"{d}*{b}+{carry}={p}" if carry else f"{d}*{b}={p}")
            carry = p // 10
        return lines
    width = max(len(str(a)), len(str(b)))
    carry = 0
    for da, db in zip(_digits(a, width), _digits(b, width)):
        if op == "+":
            s = da + db + carry
            lines.append(f"{da}+{db}+{carry}={s}" if carry else f"{da}+{db}={s}")
            carry = s // 10
        else:
            r = da - db - carry
            borrow = int(r < 0)
            lines.append(f"{da}-{db}" + (f"-{carry}" if carry else "") + ("+10" if borrow else "") + f"={r + 10 * borrow}")
            carry = borrow
    return lines


def working(problem: Problem) -> str:
    """The step-by-step working, one operation per block, ending with a newline."""
    out, x = [], problem.start
    for (op, n), result in zip(problem.ops, problem.results()):
        out.append(f"{x}{op}{n}:")
        out.extend(column_lines(x, op, n))
        out.append(f"={result}")
        x = result
    return "\n".join(out) + "\n"


def final_answer(n: int) -> str:
    return f"The answer is {n}."


def gsm8k_record(problem: Problem, rng: random.Random) -> dict[str, str]:
    """One GSM8K-format line: the question, and the working ending in `#### N`."""
    return {"question": question(problem, rng), "answer": working(problem) + f"#### {problem.answer}"}


_FINAL = re.compile(r"####\s*(-?[\d,]+)")
_ANSWER_IS = re.compile(r"answer is\s*\$?(-?[\d,]+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*")


def extract_answer(text: str) -> int | None:
    """The final answer of a reply: `#### N`, else `The answer is N`, else the last number of
    the text (GSM8K checks take the last number); None when there is none."""
    for pattern in (_FINAL, _ANSWER_IS):
        found = pattern.findall(text)
        if found:
            return _to_int(found[-1])
    found = _NUMBER.findall(text)
    return _to_int(found[-1]) if found else None


def _to_int(s: str) -> int | None:
    s = s.replace(",", "")
    try:
        return int(s)
    except ValueError:
        return None
