"""One choice's output pipeline: token ids -> text (stop strings) -> reasoning -> tool calls.

Runs in the detokenizer process (no torch). `ChoiceOutput.feed(token_ids, finish_reason)`
chains the IncrementalDetokenizer, the glm45 reasoning parser (when the template opened a
think block) and the glm47 tool parser (when the request has tools) and returns what those
tokens add as one `OutputDelta`. A streamed request sends every delta; a non-streamed one
sends the fold of all of them (`OutputDelta.fold`), so the two cannot differ: the streamed
deltas accumulate to exactly the non-streamed message.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer

from glmrt.protocol import ToolCallDelta
from glmrt.serving.detokenizer import IncrementalDetokenizer
from glmrt.serving.reasoning import Glm45ReasoningParser
from glmrt.serving.tool_parser import ContentDelta, Glm47ToolParser

__all__ = ["ChoiceOutput", "OutputDelta"]


@dataclass
class OutputDelta:
    """What some tokens of a choice add. `finish_reason` is set on the last one: the
    engine's reason, or "stop" when a stop string ended the text (`stop_string` then; the
    engine may still be generating the choice)."""

    text: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    finish_reason: str | None = None
    stop_string: bool = False
    stop_reason: str | int | None = None  # the stop string or stop_token_ids token that ended it

    @classmethod
    def fold(cls, deltas: Iterable[OutputDelta]) -> OutputDelta:
        """The deltas as one: texts concatenated, tool-call fragments in order."""
        folded = cls()
        text: list[str] = []
        reasoning: list[str] = []
        for d in deltas:
            text.append(d.text)
            reasoning.append(d.reasoning)
            folded.tool_calls.extend(d.tool_calls)
            folded.finish_reason = d.finish_reason or folded.finish_reason
            folded.stop_string = folded.stop_string or d.stop_string
            folded.stop_reason = d.stop_reason if d.stop_reason is not None else folded.stop_reason
        folded.text, folded.reasoning = "".join(text), "".join(reasoning)
        return folded


class ChoiceOutput:
    """The parsers of one choice, fed its token ids in order (see module doc)."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True, stop: Sequence[str] | None = (),
                 include_stop_str_in_output: bool = False, reasoning: bool = False,
                 tools: list[dict[str, Any]] | None = None, min_tokens: int = 0,
                 stop_token_ids: Sequence[int] | None = ()) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens, stop=stop,
                                            include_stop_str_in_output=include_stop_str_in_output,
                                            min_tokens=min_tokens)
        self.include_stop = include_stop_str_in_output
        self.stop_token_ids = frozenset(stop_token_ids or ())
        self.reasoning = Glm45ReasoningParser(thinking=True) if reasoning else None
        self.tools = Glm47ToolParser(tools) if tools else None

    def feed(self, token_ids: Sequence[int], finish_reason: str | None = None) -> OutputDelta:
        """The delta `token_ids` add; with `finish_reason` (or once a stop string matched)
        the last one, everything held back flushed. As in vLLM: the text of a matched
        stop_token_ids token is not output (unless include_stop_str_in_output), and a stop string
        the last token completes makes the reason "stop" even where the engine says "length"."""
        stop_reason: str | int | None = None
        if finish_reason == "stop" and token_ids and int(token_ids[-1]) in self.stop_token_ids:
            stop_reason = int(token_ids[-1])
            if not self.include_stop:
                token_ids = token_ids[:-1]
        text = self.detok.feed(token_ids)
        stop_string = self.detok.stopped
        if stop_string:
            finish_reason, stop_reason = "stop", self.detok.stop_reason
        if finish_reason is not None:
            text += self.detok.finish()
        reasoning, content = "", text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(text)
            if finish_reason is not None:
                last_reasoning, last_content = self.reasoning.finish(finish_reason)
                reasoning, content = reasoning + last_reasoning, content + last_content
        calls: list[ToolCallDelta] = []
        if self.tools is not None:
            deltas = self.tools.feed(content)
            if finish_reason is not None:
                deltas += self.tools.finish()
            content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
            calls = [ToolCallDelta(index=d.index, arguments=d.arguments or "", id=d.id, name=d.name)
                     for d in deltas if not isinstance(d, ContentDelta)]
        return OutputDelta(content, reasoning, calls, finish_reason, stop_string, stop_reason)
