"""Incremental detokenization with stop strings, for one generation's token stream.

Runs in the detokenizer process (no torch): `IncrementalDetokenizer.feed(new_ids)` returns
the text those tokens add, `finish()` the rest.

Text from tokens:
- Regular tokens are decoded in runs with two offsets into the run (as vLLM does): `prefix`
  (the tokens whose text was last emitted, decoded again for context) and `read` (where the
  not-yet-emitted tokens start). New text is `decode(run[prefix:])` minus
  `decode(run[prefix:read])`, emitted only when it does not end in U+FFFD: a byte-level BPE
  token can end inside a UTF-8 character, and the replacement character would be wrong once
  the next token completes it. `finish()` emits whatever is left, U+FFFD included (the bytes
  really were invalid).
- Special tokens named in `keep_tokens` (by default the reasoning/tool markers `<think>`,
  `</think>`, `<tool_call>`, `</tool_call>`, `<arg_key>`, `</arg_key>`, `<arg_value>`,
  `</arg_value>`, which the reasoning and tool parsers need) are rendered as their text and
  end the current run. Other special tokens are dropped when `skip_special_tokens` (they do
  not end the run, so the text equals `tokenizer.decode(ids, skip_special_tokens=True)` with
  the kept markers put back); with `skip_special_tokens=False` every special is rendered.

Stop strings, on the text after special-token handling:
- A stop string ends the output at its first occurrence, and generation stops at the
  occurrence that *ends* first (ties: the one that starts first, i.e. the longest): this is
  what a token-by-token check finds, whatever the token boundaries. The text before it is
  emitted (and the stop string too with `include_stop_str_in_output`); `stopped` becomes True
  and `stop_reason` the stop string; later `feed` calls return "".
- A tail that could be the start of a stop string (at most len(longest stop) - 1 characters)
  is held back until the next tokens or `finish()` decide it.
- With `min_tokens`, the text of the first min_tokens - 1 tokens is never searched (as vLLM
  checks stop strings only from the min_tokens-th token on): a stop string there does not end
  the output, one that starts there and ends later does.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tokenizers import Tokenizer

DEFAULT_KEEP_TOKENS: frozenset[str] = frozenset({
    "<think>", "</think>", "<tool_call>", "</tool_call>",
    "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
})

_REPLACEMENT = "\ufffd"

__all__ = ["IncrementalDetokenizer", "DEFAULT_KEEP_TOKENS"]


class IncrementalDetokenizer:
    """Turns one generation's token ids into text incrementally (rules in the module doc)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        stop: Sequence[str] | None = (),
        include_stop_str_in_output: bool = False,
        keep_tokens: Iterable[str] | None = DEFAULT_KEEP_TOKENS,
        min_tokens: int = 0,
    ) -> None:
        self._tokenizer = tokenizer
        self.min_tokens = min_tokens
        self._count = 0  # tokens fed so far
        self.skip_special_tokens = skip_special_tokens
        self.include_stop_str_in_output = include_stop_str_in_output
        self.stop: tuple[str, ...] = tuple(dict.fromkeys(s for s in (stop or ()) if s))
        keep = frozenset(keep_tokens or ())
        # id -> rendered text for kept specials, None for dropped ones.
        self._special: dict[int, str | None] = {}
        for token_id, added in tokenizer.get_added_tokens_decoder().items():
            if added.special:
                rendered = not skip_special_tokens or added.content in keep
                self._special[token_id] = added.content if rendered else None
        self._run: list[int] = []  # regular ids since the last rendered special
        self._prefix = 0
        self._read = 0
        self._held = ""  # text withheld for a possible stop string
        self.stopped = False
        self.stop_reason: str | None = None
        self._finished = False

    # ------------------------------------------------------------------ tokens -> text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False) if ids else ""

    def _run_text(self, final: bool) -> str:
        """New text of the current run; with `final`, everything left (the run is closed)."""
        if self._read >= len(self._run):
            return ""
        prefix_text = self._decode(self._run[self._prefix:self._read])
        full_text = self._decode(self._run[self._prefix:])
        if not final and (len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT)):
            return ""  # a multi-byte character is still incomplete
        new = full_text[len(prefix_text):]
        # The emitted tokens before `prefix` are never needed again.
        del self._run[:self._read]
        self._prefix = 0
        self._read = len(self._run)
        return new

    def _close_run(self) -> str:
        text = self._run_text(final=True)
        self._run.clear()
        self._prefix = self._read = 0
        return text

    def _tokens_text(self, token_ids: Iterable[int]) -> str:
        parts: list[str] = []
        for token_id in token_ids:
            token_id = int(token_id)
            if token_id in self._special:
                rendered = self._special[token_id]
                if rendered is not None:
                    parts.append(self._close_run())
                    parts.append(rendered)
                continue
            self._run.append(token_id)
        parts.append(self._run_text(final=False))
        return "".join(parts)

    # ------------------------------------------------------------------ stop strings

    def _apply_stop(self, text: str, final: bool, search: bool = True) -> str:
        """`text` less what a stop string ends or may yet end (held back); with `search` False
        (tokens before min_tokens) no stop string ends it here."""
        text = self._held + text
        self._held = ""
        if not self.stop:
            return text
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for s in self.stop if search else ():
            i = text.find(s)
            if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        if best is not None:
            end, start, s = best
            self.stopped = True
            self.stop_reason = s
            return text[:end] if self.include_stop_str_in_output else text[:start]
        if final:
            return text
        held = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), held, -1):
                if text.endswith(s[:k]):
                    held = k
                    break
        self._held = text[len(text) - held:] if held else ""
        return text[:len(text) - held]

    # ------------------------------------------------------------------ API

    def feed(self, token_ids: Sequence[int]) -> str:
        """The text that `token_ids` add ("" once stopped)."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        if self.stopped:
            return ""
        ids = list(token_ids)
        unsearched = max(0, min(len(ids), self.min_tokens - 1 - self._count))
        self._count += len(ids)
        text = self._apply_stop(self._tokens_text(ids[:unsearched]), final=False, search=False) if unsearched else ""
        if unsearched == len(ids):
            return text
        return text + self._apply_stop(self._tokens_text(ids[unsearched:]), final=False)

    def finish(self) -> str:
        """Everything still held back (an incomplete character, a possible stop prefix)."""
        if self._finished:
            return ""
        self._finished = True
        if self.stopped:
            return ""
        return self._apply_stop(self._close_run(), final=True, search=self._count >= self.min_tokens)
