"""One request of `glmrt bench serving`: send it, read its SSE stream, and time it (TTFT, ITL,
TPOT, e2e) into a `Result`, with the server's token counts."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field


@dataclass
class Result:
    conversation: int
    turn: int
    ok: bool = False
    error: str | None = None
    start: float = 0.0                 # seconds since the run began
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0             # usage.completion_tokens (or the streamed ids / chunks)
    streamed_token_ids: int | None = None   # token ids seen in the stream (None: the server sends none)
    usage_reported: bool = False
    finish_reason: str | None = None
    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    itls: list[float] = field(default_factory=list)
    # not in the JSON: what the next turn of the conversation appends
    answer_text: str = field(default="", repr=False)
    answer_reasoning: str = field(default="", repr=False)
    answer_ids: list[int] = field(default_factory=list, repr=False)

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("answer_text")
        d.pop("answer_reasoning")
        d.pop("answer_ids")
        return d


def _error_message(raw: bytes | str, status: int | None = None) -> str:
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    msg = text.strip()[:500]
    try:
        obj = json.loads(text)
        err = obj.get("error", obj) if isinstance(obj, dict) else obj
        if isinstance(err, dict):
            msg = str(err.get("message") or err)[:500]
        elif isinstance(err, str):
            msg = err[:500]
    except ValueError:
        pass
    return f"HTTP {status}: {msg}" if status is not None else msg


async def _sse_events(resp):
    """The `data:` payloads of an SSE body (lines of any length: a first chunk may echo a long
    prompt's token ids)."""
    buf = bytearray()
    async for chunk in resp.content.iter_any():
        scan = len(buf)
        buf += chunk
        begin = 0
        while (nl := buf.find(b"\n", scan)) >= 0:
            line = bytes(buf[begin:nl]).rstrip(b"\r")
            begin = scan = nl + 1
            if line.startswith(b"data:"):
                yield line[5:].strip()
        del buf[:begin]
    rest = bytes(buf).strip()
    if rest.startswith(b"data:"):
        yield rest[5:].strip()


async def send_request(session, url: str, headers: dict, body: dict, res: Result, t_run: float,
                       timeout: float) -> Result:
    import aiohttp

    t0 = time.perf_counter()
    res.start = t0 - t_run
    last = None
    ids_mode = False
    n_ids = 0
    text_parts: list[str] = []
    reasoning_parts: list[str] = []
    try:
        async with session.post(url, json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 200:
                res.error = _error_message(await resp.read(), resp.status)
                return res
            async for payload in _sse_events(resp):
                if payload == b"[DONE]":
                    break
                if not payload:
                    continue
                now = time.perf_counter()
                try:
                    obj = json.loads(payload)
                except ValueError:
                    res.error = f"bad SSE payload: {payload[:200]!r}"
                    return res
                if not isinstance(obj, dict):
                    continue
                if obj.get("error") is not None and not obj.get("choices"):
                    res.error = "stream error: " + _error_message(json.dumps(obj))
                    return res
                usage = obj.get("usage")
                if usage:
                    res.usage_reported = True
                    res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    res.output_tokens = int(usage.get("completion_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    res.cached_tokens = int(details.get("cached_tokens") or 0)
                new = 0
                has_text = False
                for ch in obj.get("choices") or []:
                    delta = ch.get("delta") or {}
                    text = ch.get("text") or delta.get("content") or ""
                    reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
                    if text or reasoning or delta.get("tool_calls"):
                        has_text = True
                    if text:
                        text_parts.append(text)
                    if reasoning:
                        reasoning_parts.append(reasoning)
                    ids = ch.get("token_ids")
                    if ids is not None:
                        ids_mode = True
                        new += len(ids)
                        res.answer_ids.extend(ids)
                    if ch.get("finish_reason"):
                        res.finish_reason = ch["finish_reason"]
                if not ids_mode and has_text:
                    new = 1  # a server without token ids: one token per chunk carrying output
                if new:
                    n_ids += new
                    if res.ttft is None:
                        res.ttft = now - t0
                    else:
                        res.itls.extend([(now - last) / new] * new)
                    last = now
    except asyncio.TimeoutError:
        res.error = f"timed out after {timeout:g} s"
        return res
    except (aiohttp.ClientError, OSError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2e = time.perf_counter() - t0
    res.answer_text = "".join(text_parts)
    res.answer_reasoning = "".join(reasoning_parts)
    res.streamed_token_ids = n_ids if ids_mode else None
    if not res.usage_reported:
        res.output_tokens = n_ids
    if res.ttft is None:
        res.error = "the stream carried no output"
        return res
    if res.output_tokens > 1:
        res.tpot = (res.e2e - res.ttft) / (res.output_tokens - 1)
    res.ok = True
    return res
