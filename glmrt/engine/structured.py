"""Structured output on the engine: grammars compiled with xgrammar, one matcher per
constrained choice, and the token bitmask applied to the logits before sampling.

    so = StructuredOutput(tokenizer_json, vocab_size, eos_ids)
    so.compile(grammar)            # a Future, cached by the grammar (the api awaits nothing here)
    so.attach(req, compiled)       # the choice's constraint; output tokens it already has replay
    mask = so.fill(reqs)           # host bitmask for this step's rows (None: nobody constrained)
    ops.apply_token_bitmask(logits, mask.device_bits, mask.rows)
    so.accept(req, token)          # after the token is known

Compiling runs in a thread pool off the step thread (xgrammar releases the GIL while it
compiles); `GrammarCompiler`'s own cache dedupes equal grammars and this module keeps the
futures of the last `CACHE_SIZE` grammars, so a repeated schema costs a dict lookup.

Reasoning: a choice whose prompt ends with `<think>` starts inside the think block. There
the grammar is not applied (the model thinks freely), except that a constrained choice may
not end or leave the block other than by `</think>` (stop ids and `<tool_call>`, which the
reasoning parser would take for the answer's start, are masked), and once it has thought
`max_thinking_tokens` tokens the only token allowed is `</think>`. The matcher sees the
tokens after `</think>`. A choice with a thinking budget and no grammar is constrained the
same way, inside its think block only.

Requests without a constraint pay nothing: `fill` returns None when no row needs a mask.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import re
import threading
from dataclasses import dataclass

import torch

from glmrt.engine.request import Request
from glmrt.sampling_params import Grammar

CACHE_SIZE = 256
COMPILE_THREADS = 2
THINK_START, THINK_END, TOOL_CALL_START = "<think>", "</think>", "<tool_call>"
# JSON answers are written on one line with xgrammar's separators (", " and ": "): bounded
# (a model cannot loop on blanks) and the fewest tokens. Tool-call values that are JSON may
# put up to this many blanks between their tokens.
MAX_JSON_WHITESPACE = 4
_XGRAMMAR_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


class GrammarError(ValueError):
    """A grammar xgrammar cannot compile (or this engine cannot serve): a 400 for the client."""


def _reason(exc: BaseException) -> str:
    """xgrammar's message without its C++ source location."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _XGRAMMAR_LOCATION.sub("", text)


def encoded_vocab(tokenizer_json: str, vocab_size: int) -> tuple[list[str], dict[str, int]]:
    """The tokenizer's tokens in id order, as xgrammar reads them, and the added tokens' ids.

    Byte-level strings as tokenizer.json stores them. Special tokens the detokenizer drops (all
    but the reasoning and tool markers it keeps as text) are empty strings, which xgrammar
    never allows inside a grammar (the EOS ids are its stop tokens, allowed by id where the
    grammar may end): their text would vanish from the answer the grammar matched. Ids the
    tokenizer lacks are empty too."""
    from glmrt.serving.detokenizer import DEFAULT_KEEP_TOKENS

    with open(tokenizer_json, encoding="utf-8") as f:
        data = json.load(f)
    vocab = [""] * vocab_size
    for text, i in data["model"]["vocab"].items():
        if 0 <= i < vocab_size:
            vocab[i] = text
    added = {}
    for tok in data.get("added_tokens", []):
        if 0 <= tok["id"] < vocab_size:
            dropped = tok.get("special", False) and tok["content"] not in DEFAULT_KEEP_TOKENS
            vocab[tok["id"]] = "" if dropped else tok["content"]
            added[tok["content"]] = tok["id"]
    return vocab, added


@dataclass
class Constraint:
    """One choice's constraint: its matcher (None: a thinking budget only) and think state."""

    matcher: object | None
    thinking: bool
    budget: int | None
    thought: int = 0  # tokens inside the think block so far
    broken: bool = False  # a token the grammar refused came in (another engine's): unconstrained
    pending: bytes = b""  # the bytes of a UTF-8 character the last answer token left unfinished


@dataclass
class StepMask:
    """The bitmask of one step: host words for `rows` (row i of `bits` is rows[i]'s)."""

    bits: torch.Tensor  # [len(rows), words] int32
    rows: list[int]

    def to(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.tensor(self.rows, dtype=torch.long)
        if device.type == "cuda":
            return (self.bits.pin_memory().to(device, non_blocking=True),
                    rows.pin_memory().to(device, non_blocking=True))
        return self.bits.to(device), rows.to(device)


class StructuredOutput:
    """The engine's grammar compiler, its cache and every constrained choice's state.

    `tokenizer_json` None (a dummy model without a checkpoint) leaves structured output
    off: a grammar or a thinking budget is refused with the reason.
    """

    def __init__(self, tokenizer_json: str | None, vocab_size: int, eos_ids: list[int],
                 threads: int = COMPILE_THREADS) -> None:
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self.words = -(-vocab_size // 32)
        self.think_start = self.think_end = self.tool_call_start = None
        self._vocab: list[str] | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._futures: collections.OrderedDict[Grammar, concurrent.futures.Future] = collections.OrderedDict()
        self._compiler_future = None
        self._marker_tokens: frozenset[str] = frozenset()
        self.constraints: dict[str, Constraint] = {}
        self.compiled_count = 0
        if tokenizer_json is not None:
            self._vocab, added = encoded_vocab(tokenizer_json, vocab_size)
            self.think_start = added.get(THINK_START)
            self.think_end = added.get(THINK_END)
            self.tool_call_start = added.get(TOOL_CALL_START)
            from glmrt.engine.tool_call_grammar import MARKERS
            self._marker_tokens = frozenset(m for m in MARKERS if m in added)
            # NOTE: the tokenizer info scans the whole vocabulary (about a second at full size):
            # built on the pool, so the engine starts at once and the first grammar waits for it
            self._compiler_future = self._pool.submit(self._make_compiler)

    @property
    def available(self) -> bool:
        return self._vocab is not None

    def _make_compiler(self):
        import xgrammar as xgr
        info = xgr.TokenizerInfo(self._vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=self.vocab_size,
                                 stop_token_ids=self.eos_ids)
        token_bytes = info.decoded_vocab
        # tokens that start inside a UTF-8 character (a continuation byte first): only they can
        # follow a token that left one unfinished
        self._continuations = [(i, b) for i, b in enumerate(token_bytes) if b and 0x80 <= b[0] <= 0xBF]
        self._token_bytes = token_bytes
        return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)

    # ---- compiling ------------------------------------------------------------------------
    def compile(self, grammar: Grammar) -> concurrent.futures.Future:
        """A Future of the compiled grammar (raising GrammarError); equal grammars share one."""
        with self._lock:
            fut = self._futures.get(grammar)
            if fut is not None:
                self._futures.move_to_end(grammar)
                return fut
            if not self.available:
                fut = concurrent.futures.Future()
                fut.set_exception(GrammarError("structured output needs the checkpoint's tokenizer.json, which "
                                               "this engine was started without"))
                return fut
            fut = self._pool.submit(self._compile, grammar)
            self._futures[grammar] = fut
            while len(self._futures) > CACHE_SIZE:
                self._futures.popitem(last=False)
            return fut

    def compiled(self, grammar: Grammar):
        """The compiled grammar, waiting for its compile when it still runs; GrammarError."""
        return self.compile(grammar).result()

    def _compile(self, grammar: Grammar):
        try:
            compiler = self._compiler_future.result()
        except ImportError as e:
            self._forget_future(grammar)
            raise GrammarError(f"structured output needs xgrammar on the engine's machine: {e}") from None
        try:
            out = _compile_with(compiler, grammar, self._marker_tokens)
        except GrammarError:
            self._forget_future(grammar)
            raise
        except Exception as e:  # xgrammar raises RuntimeError / ValueError with the reason
            self._forget_future(grammar)
            raise GrammarError(f"the {_KIND_NAMES.get(grammar.kind, grammar.kind)} cannot be compiled: "
                               f"{_reason(e)}") from None
        with self._lock:
            self.compiled_count += 1
        return out

    def _forget_future(self, grammar: Grammar) -> None:
        with self._lock:  # a refusal is not cached: the next request gets the reason afresh
            self._futures.pop(grammar, None)

    # ---- per choice -------------------------------------------------------------------------
    def check_budget(self, max_thinking_tokens: int | None) -> None:
        if max_thinking_tokens is not None and self.think_end is None:
            raise ValueError("max_thinking_tokens needs a tokenizer with a </think> token, which this engine lacks")

    def attach(self, req: Request, compiled) -> None:
        """Give `req` its constraint (a matcher of `compiled`, or a thinking budget alone); the
        output tokens it already has (a handoff's first token) go through it first."""
        budget = req.params.max_thinking_tokens
        if compiled is None and budget is None:
            return
        self.check_budget(budget)
        thinking = self.think_start is not None and bool(req.prompt_ids) and req.prompt_ids[-1] == self.think_start
        if compiled is None and not thinking:
            return  # a budget with thinking off: nothing to enforce
        matcher = None
        if compiled is not None:
            import xgrammar as xgr
            matcher = xgr.GrammarMatcher(compiled)
        c = Constraint(matcher, thinking, budget)
        self.constraints[req.rid] = c
        for tok in req.output_ids:
            self._advance(c, tok)

    def constrained(self, req: Request) -> bool:
        return req.rid in self.constraints

    def forget(self, req: Request) -> None:
        self.constraints.pop(req.rid, None)

    def accept(self, req: Request, token: int) -> None:
        c = self.constraints.get(req.rid)
        if c is not None:
            self._advance(c, token)

    def _advance(self, c: Constraint, token: int) -> None:
        if c.thinking:
            if token == self.think_end:
                c.thinking = False
            else:
                c.thought += 1
            return
        if c.matcher is not None and not c.broken and not c.matcher.is_terminated():
            if not c.matcher.accept_token(int(token)):
                c.broken = True
            c.pending = utf8_tail(c.pending + self._token_bytes[token]) or b""

    # ---- the step's bitmask -------------------------------------------------------------------
    def fill(self, reqs: list[Request]) -> StepMask | None:
        """The host bitmask of the rows of `reqs` that are constrained this step, or None."""
        if not self.constraints:
            return None
        todo = [(i, c) for i, r in enumerate(reqs) if (c := self.constraints.get(r.rid)) is not None
                and self._masks(c)]
        if not todo:
            return None
        bits = torch.full((len(todo), self.words), -1, dtype=torch.int32)
        for j, (_, c) in enumerate(todo):
            if not c.thinking:
                c.matcher.fill_next_token_bitmask(bits, j)
                self._finish_characters(c, bits[j])
            elif c.budget is not None and c.thought >= c.budget:
                bits[j].zero_()
                _set_bit(bits[j], self.think_end, True)
            else:  # thinking under a grammar: anything but an exit from the block other than </think>
                for tok in (*self.eos_ids, self.tool_call_start, self.think_start):
                    if tok is not None and tok < self.vocab_size:
                        _set_bit(bits[j], tok, False)
        return StepMask(bits, [i for i, _ in todo])

    def _finish_characters(self, c: Constraint, row: torch.Tensor) -> None:
        """After a token that ended inside a UTF-8 character, allow only tokens that continue it
        validly. NOTE: xgrammar 0.2.8 lets overlong and surrogate forms through (E0 80, ED A0),
        which are not UTF-8: a JSON parser refuses them and the detokenizer shows U+FFFD."""
        if not c.pending:
            return
        before = row.clone()
        for tok, tb in self._continuations:
            if utf8_tail(c.pending + tb) is None:
                _set_bit(row, tok, False)
        if not row.any():  # nothing left (the grammar wants only what this refuses): keep its mask
            row.copy_(before)

    @staticmethod
    def _masks(c: Constraint) -> bool:
        if c.thinking:
            return c.matcher is not None or (c.budget is not None and c.thought >= c.budget)
        return c.matcher is not None and not c.broken and not c.matcher.is_terminated()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# a UTF-8 lead byte -> (continuation bytes, the range of the first of them), per RFC 3629
_UTF8_LEADS = {**{b: (1, 0x80, 0xBF) for b in range(0xC2, 0xE0)}, 0xE0: (2, 0xA0, 0xBF),
               **{b: (2, 0x80, 0xBF) for b in (*range(0xE1, 0xED), 0xEE, 0xEF)}, 0xED: (2, 0x80, 0x9F),
               0xF0: (3, 0x90, 0xBF), **{b: (3, 0x80, 0xBF) for b in range(0xF1, 0xF4)}, 0xF4: (3, 0x80, 0x8F)}


def utf8_tail(data: bytes) -> bytes | None:
    """The unfinished character at the end of `data` (b"" when none), or None when `data` is
    not the start of valid UTF-8."""
    i, n = 0, len(data)
    while i < n:
        if data[i] < 0x80:
            i += 1
            continue
        lead = _UTF8_LEADS.get(data[i])
        if lead is None:
            return None
        need, lo, hi = lead
        for k in range(need):
            j = i + 1 + k
            if j >= n:
                return data[i:]
            if not lo <= data[j] <= hi:
                return None
            lo, hi = 0x80, 0xBF  # only the first continuation byte has a narrower range
        i += 1 + need
    return b""


def _set_bit(row: torch.Tensor, token: int, on: bool) -> None:
    word, bit = divmod(token, 32)
    value = int(row[word]) & 0xFFFFFFFF
    value = value | (1 << bit) if on else value & ~(1 << bit)
    row[word] = value - (1 << 32) if value >= 1 << 31 else value


_KIND_NAMES = {"json_schema": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
               "ebnf": "EBNF grammar", "tool_call": "tool-call grammar"}


def json_safe_lengths(schema):
    """The schema with each length-bounded string rewritten as a pattern over its value.

    NOTE: xgrammar 0.2.8 compiles a string's minLength/maxLength to a character class that
    lets raw control characters (a tab, U+0015) into the string, which is not JSON (json.loads
    refuses it); a pattern is compiled as a regex over the decoded value, escaped correctly.
    Strings that already have a pattern, a format, an enum or a const are left alone."""
    if isinstance(schema, list):
        return [json_safe_lengths(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: json_safe_lengths(v) for k, v in schema.items()}
    if (out.get("type") == "string" and ("minLength" in out or "maxLength" in out)
            and not {"pattern", "format", "enum", "const"} & out.keys()):
        lo, hi = out.get("minLength", 0), out.get("maxLength", "")
        if isinstance(lo, int) and (hi == "" or isinstance(hi, int)):
            out.pop("minLength", None)
            out.pop("maxLength", None)
            out["pattern"] = f"^[^\\x00-\\x1f]{{{lo},{hi}}}$"
    return out


def _compile_with(compiler, grammar: Grammar, marker_tokens: frozenset[str] = frozenset()):
    kind = grammar.kind
    if kind == "json_schema":
        try:
            schema = json_safe_lengths(json.loads(grammar.spec))
        except ValueError as e:
            raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
    if kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
    if kind == "regex":
        return compiler.compile_regex(grammar.spec)
    if kind == "ebnf":
        return compiler.compile_grammar(grammar.spec)
    if kind == "tool_call":
        from glmrt.engine.tool_call_grammar import tool_call_tag
        spec = json.loads(grammar.spec)
        tag = tool_call_tag(spec["tools"], spec["tool_choice"], bool(spec.get("parallel_tool_calls", True)),
                            MAX_JSON_WHITESPACE, marker_tokens)
        return compiler.compile_structural_tag(tag)
    raise GrammarError(f"unknown grammar kind {kind!r}")
