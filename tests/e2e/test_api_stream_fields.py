"""Through the real server and the official `openai` client: a chat stream accumulates to
exactly the non-streamed message, field by field, for each way a choice ends, and a choice
that ends without `</think>` on a stop answers in both `reasoning_content` and `content`.

The tiny random-weight model picks its own tokens, so the texts are the ones greedy decoding
gives; the endings are chosen with `max_tokens` (length) and a stop string taken from the
model's own greedy output (stop). The parsers on chosen texts are covered by
tests/serving/test_stream_equals_whole.py.
"""

from __future__ import annotations

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from tests.e2e.api_cases import GREEDY, TOOLS, client, dep, extra_field, model  # noqa: F401  (fixtures)

MSGS = [{"role": "user", "content": "Plan a trip to Oslo, then call a tool."}]


def message_fields(choice) -> dict:
    msg = choice.message
    return {"content": msg.content, "reasoning_content": extra_field(msg, "reasoning_content"),
            "tool_calls": [(t.function.name, t.function.arguments) for t in msg.tool_calls or []],
            "finish_reason": choice.finish_reason}


def both(client, model, **kw) -> tuple[dict, dict]:
    """The non-streamed message and the stream accumulated by the client's own stream state."""
    whole = client.chat.completions.create(model=model, messages=MSGS, **GREEDY, **kw)
    state = ChatCompletionStreamState()
    for chunk in client.chat.completions.create(model=model, messages=MSGS, stream=True, **GREEDY, **kw):
        state.handle_chunk(chunk)
    return message_fields(whole.choices[0]), message_fields(state.current_completion_snapshot.choices[0])


def stop_inside(text: str) -> tuple[str, int]:
    """A stop string from the middle of `text` whose first occurrence is at the returned index."""
    for start in range(max(1, len(text) // 3), len(text) - 3):
        stop = text[start:start + 3]
        if text.find(stop) == start and not set(stop) & set("<>\ufffd"):
            return stop, start
    raise AssertionError(f"no usable stop string in the greedy output {text!r}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["plain", "tools"])
def test_stream_accumulates_to_the_message_for_length_and_stop(client, model, tools):
    extra = {"tools": tools} if tools else {}
    whole, streamed = both(client, model, max_tokens=24, **extra)
    assert streamed == whole and whole["finish_reason"] == "length"
    text = whole["reasoning_content"] or whole["content"] or ""
    stop, at = stop_inside(text)
    whole, streamed = both(client, model, max_tokens=24, stop=[stop], **extra)
    assert streamed == whole and whole["finish_reason"] == "stop"


@pytest.mark.timeout(120)
def test_stop_without_think_end_answers_in_reasoning_and_content(client, model):
    cut, _ = both(client, model, max_tokens=24)
    reasoning = cut["reasoning_content"]
    # cut by the length limit while thinking: reasoning only
    assert reasoning and cut["content"] == "" and cut["finish_reason"] == "length", cut
    stop, at = stop_inside(reasoning)
    whole, streamed = both(client, model, max_tokens=24, stop=[stop])
    assert whole == streamed == {"content": reasoning[:at], "reasoning_content": reasoning[:at],
                                 "tool_calls": [], "finish_reason": "stop"}
