"""What glmrt prints while it serves: the one log format of every process, the line of a finished
request and an engine's periodic stats line. No torch.

Every process glmrt starts (`glmrt up` and each actor process) logs through the standard `logging`
module in one format on standard output, `2026-12-01 21:30:00 INFO engine/0: ...`; the logger's
name says who speaks: an actor id (`engine/0`, `api/0`, `supervisor/0`) or `glmrt` for `glmrt up`.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

from glmrt import protocol as P

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"


def configure_logging(level: str) -> None:
    """Every line of this process at `level` (debug | info | warning | error) or above, in the one format."""
    logging.basicConfig(level=getattr(logging, level.upper()), format=LOG_FORMAT, datefmt=DATE_FORMAT,
                        stream=sys.stdout, force=True)


def request_line(rid: str, *, status: int | str, duration: float, ttft: float | None = None,
                 usage: dict | None = None, finish: list[str] | None = None, error: str | None = None) -> str:
    """The log line of one finished request: `request <id>: status=200 prompt_tokens=12 ...`.

    `usage` is the response's OpenAI usage object (a served request); `error` the code of the
    error a failed one was answered with."""
    parts = [f"request {rid}: status={status}"]
    if usage is not None:
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        parts += [f"prompt_tokens={usage.get('prompt_tokens', 0)}", f"cached_tokens={cached}",
                  f"output_tokens={usage.get('completion_tokens', 0)}"]
    if ttft is not None:
        parts.append(f"ttft={ttft:.3f}s")
    parts.append(f"duration={duration:.3f}s")
    if finish:
        parts.append("finish=" + ",".join(finish))
    if error:
        parts.append(f"error={error}")
    return " ".join(parts)


@dataclass
class _Totals:
    at: float
    prompt: float
    cached: float
    generated: float

    @classmethod
    def of(cls, stats: P.EngineStats, now: float) -> "_Totals":
        c = stats.counters
        return cls(now, c.get("prompt_tokens", 0.0), c.get("cached_prompt_tokens", 0.0),
                   c.get("generation_tokens", 0.0))


class EngineStatsLog:
    """An engine's periodic stats line, like SGLang's decode log: every `interval` seconds, and
    only when the engine took prompts, generated tokens or still holds requests since the last."""

    def __init__(self, interval: float, now: float):
        self.interval = interval
        self._last: _Totals | None = None
        self._next = now + interval
        self._spec = (0.0, 0.0)  # speculative decoding: (drafting steps, tokens they kept) at the last line

    def due(self, now: float) -> bool:
        return self.interval > 0 and now >= self._next

    def line(self, stats: P.EngineStats, now: float) -> str | None:
        """The line for `stats` (taken now, when `due`), or None when the engine was idle."""
        self._next = now + self.interval
        last, cur = self._last, _Totals.of(stats, now)
        self._last = cur
        if last is None:
            last = _Totals(now - self.interval, 0.0, 0.0, 0.0)
        prompt, generated = cur.prompt - last.prompt, cur.generated - last.generated
        if not (prompt or generated or stats.running or stats.waiting):
            return None
        dt = max(cur.at - last.at, 1e-9)
        c = stats.counters
        page = int(c.get("page_size", 1) or 1)
        # pages the prefix cache holds are reclaimable: the pool's use is what requests hold
        cached_pages = int(c.get("cached_pages", 0)) + int(c.get("checkpoint_pages", 0))
        kv_used = max(0, stats.kv_pages_total - stats.kv_pages_free - cached_pages) * page
        slots_used = max(0, stats.state_slots_total - stats.state_slots_free - int(c.get("slots_checkpoint", 0)))
        hit = min(1.0, (cur.cached - last.cached) / prompt) if prompt > 0 else 0.0
        line = (f"running {stats.running}, queued {stats.waiting}, "
                f"KV pool {_percent(kv_used, stats.kv_pages_total * page)} ({kv_used} tokens, "
                f"{cached_pages * page} cached), state slots {_percent(slots_used, stats.state_slots_total)}, "
                f"gen {generated / dt:.1f} tok/s, prompt {prompt / dt:.1f} tok/s, cache hit rate {hit:.1%}")
        if "spec_cycles" in c:
            spec = (c["spec_cycles"], c["spec_emitted_tokens"])
            cycles, kept = spec[0] - self._spec[0], spec[1] - self._spec[1]
            self._spec = spec
            line += f", accept len {kept / cycles:.2f}" if cycles else ", accept len -"
        return line


def _percent(part: float, whole: float) -> str:
    return f"{part / whole:.1%}" if whole else "0.0%"
