"""The `glm45` reasoning parser: splits GLM-5.3 output into reasoning and content.

Runs in the detokenizer process (no torch). Format and rules: docs/PROTOCOLS.md.

Rules, with thinking on (the prompt ended with `<think>`, so the output starts inside the
think block):

- A `<think>` at the very start of the output is dropped.
- The text up to the first `</think>` is reasoning; the marker is dropped and everything after
  it is content (a later `</think>` or `<think>` is ordinary content text).
- A `<tool_call>` that comes before any `</think>` ends the reasoning there; the marker and
  everything after it is content (the tool parser picks the call up from the content).
- Output that ends with neither marker: when the generation stopped at the length limit
  (`stop_reason == "length"`) the whole text is reasoning and there is no content (the model
  was cut off while thinking); for any other stop (EOS, a stop string, an abort) the model
  answered without closing its thoughts, so the whole text is the answer as well as the
  thinking: it is both `reasoning_content` and content. (SGLang returns it as reasoning only,
  and a client showing only content shows no answer.)

With thinking off (the prompt ended with `<think></think>`) everything is content, verbatim.

`parse` returns `reasoning_content` as None when there is none (thinking off, an empty think
block) and the text verbatim otherwise; content is never stripped here.

Streaming (`Glm45ReasoningParser.feed` / `finish`):

- Reasoning deltas are emitted as they arrive (reasoning is long, clients want to watch it);
  a tail that could be the start of `<think>` (at the very start), `</think>` or `<tool_call>`
  is held back until the next delta or `finish` decides it.
- After the first `</think>`/`<tool_call>` every delta passes through as content.
- A `finish` with a stop other than "length" while still in reasoning mode (no `</think>` and
  no `<tool_call>` seen) flushes the held tail as reasoning and returns the *whole* output
  (after a dropped leading `<think>`) as one content delta: nothing sent before is taken back.

`parse` is the fold of one `feed` and `finish`, and the streamed deltas concatenate to it
whatever the split (tested for every split): with R and C the concatenated reasoning and
content deltas, `(R or None, C) == parse(text, thinking, stop_reason)`.
"""

from __future__ import annotations

THINK_START = "<think>"
THINK_END = "</think>"
TOOL_CALL_START = "<tool_call>"

_END_MARKERS = (THINK_END, TOOL_CALL_START)

__all__ = ["Glm45ReasoningParser", "parse", "THINK_START", "THINK_END", "TOOL_CALL_START"]


def _held_tail(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best


def _first_end_marker(text: str, start: int = 0) -> tuple[int, str] | None:
    """Earliest occurrence of `</think>` or `<tool_call>` at or after `start`."""
    found: tuple[int, str] | None = None
    for marker in _END_MARKERS:
        i = text.find(marker, start)
        if i >= 0 and (found is None or i < found[0]):
            found = (i, marker)
    return found


def parse(text: str, thinking: bool = True, stop_reason: str | None = "stop") -> tuple[str | None, str]:
    """Splits a whole output into `(reasoning_content or None, content)` (see module doc)."""
    parser = Glm45ReasoningParser(thinking)
    reasoning, content = parser.feed(text)
    last_reasoning, last_content = parser.finish(stop_reason)
    return (reasoning + last_reasoning) or None, content + last_content


class Glm45ReasoningParser:
    """Streaming `glm45` reasoning parser for one generation (see module doc).

    `feed(delta)` and `finish(stop_reason)` return `(reasoning_delta, content_delta)`; either
    may be "".
    """

    def __init__(self, thinking: bool = True) -> None:
        self.thinking = thinking
        # "start": a leading <think> may still come; "reasoning"; "content".
        self._mode = "start" if thinking else "content"
        self._buf = ""  # held-back text, not yet emitted
        self._reasoning_sent: list[str] = []
        self._finished = False

    @property
    def in_reasoning(self) -> bool:
        """True while deltas are still reasoning (no `</think>`/`<tool_call>` seen yet)."""
        return self._mode != "content"

    def feed(self, text_delta: str) -> tuple[str, str]:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        if self._mode == "content":
            return "", text_delta
        buf = self._buf + text_delta
        if self._mode == "start":
            if buf.startswith(THINK_START):
                buf = buf[len(THINK_START):]
            elif THINK_START.startswith(buf):
                self._buf = buf  # still could be a leading <think>
                return "", ""
            self._mode = "reasoning"
        hit = _first_end_marker(buf)
        if hit is not None:
            i, marker = hit
            reasoning = buf[:i]
            content = buf[i + len(THINK_END):] if marker == THINK_END else buf[i:]
            self._buf = ""
            self._mode = "content"
            self._reasoning_sent.append(reasoning)
            return reasoning, content
        held = _held_tail(buf, _END_MARKERS)
        reasoning = buf[:len(buf) - held]
        self._buf = buf[len(buf) - held:]
        self._reasoning_sent.append(reasoning)
        return reasoning, ""

    def finish(self, stop_reason: str | None = "stop") -> tuple[str, str]:
        """Flushes the held-back tail; applies the no-`</think>` rule (module doc)."""
        if self._finished:
            return "", ""
        self._finished = True
        buf, self._buf = self._buf, ""
        if self._mode == "content":
            return "", buf
        # Still in reasoning mode: neither </think> nor <tool_call> ever came.
        if stop_reason == "length":
            self._reasoning_sent.append(buf)
            return buf, ""
        # The answer is the thinking: the reasoning already streamed stays, and the whole
        # text comes once more as content.
        self._reasoning_sent.append(buf)
        return buf, "".join(self._reasoning_sent)
