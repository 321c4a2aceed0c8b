"""The detokenizer actor: token ids -> text deltas, stop strings, reasoning and tool calls.

Per choice a ChoiceOutput (glmrt/serving/choice_output.py: the IncrementalDetokenizer with
stop strings, the glm45 reasoning parser, the glm47 tool parser). Streamed requests get its
deltas as tokens arrive; non-streamed ones get one final TextOut, the fold of the same
deltas, so both shapes carry the same text, reasoning and calls.
Tokens may reach it out of order (prefill and decode engines) or before the request's
DetokenizeRequest: both are buffered; tokens it has already (a stale copy) are dropped, and
so is a second DetokenizeRequest of a request it holds or finished a moment ago.
A restarted detokenizer gets each request back from its engine as a DetokenizeReplay: the
tokens the api already has the text of are fed one by one without emitting (so the parsers
reach the state they had, chunk for chunk), the rest are emitted as usual. No torch in this
process.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from actors.base import Actor
from glmrt import protocol as P

ORPHAN_TTL_S = 60.0
FINISHED_TTL_S = 120.0  # a finished request's late duplicates are dropped this long


def _byte_decoder() -> dict[str, int]:
    """Inverse of the byte-level BPE alphabet (printable stand-ins for the 256 bytes)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTES = _byte_decoder()


@dataclass
class Choice:
    output: Any  # a ChoiceOutput
    next_index: int = 0
    pending: dict[int, P.TokenOut] = field(default_factory=dict)
    done: bool = False
    deltas: list[Any] = field(default_factory=list)  # non-streamed: OutputDeltas, folded at the end
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[P.TokenLogprob] = field(default_factory=list)
    sent_any: bool = False


@dataclass
class Req:
    cfg: P.DetokenizeRequest
    choices: dict[int, Choice] = field(default_factory=dict)


class DetokenizerActor(Actor):
    kind = "detokenizer"

    async def setup(self) -> dict[str, Any]:
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(os.path.join(self.spec.config.model_path, "tokenizer.json"))
        self.reqs: dict[str, Req] = {}
        self.orphans: dict[str, tuple[float, list[P.TokenOut]]] = {}
        self.finished: dict[P.RequestKey, float] = {}  # ended requests -> when
        self._sends: set = set()  # stop-string aborts in flight (a task nobody holds may be collected)
        return {}

    def busy(self) -> bool:
        return bool(self.reqs)

    def load(self) -> tuple[float, int, int]:
        return 0.0, len(self.reqs), 0

    async def handle(self, msg: Any, frames: list) -> None:
        if isinstance(msg, P.DetokenizeRequest):
            if msg.key in self.reqs or msg.key in self.finished:
                return  # a re-sent request: its first registration is in force
            self.reqs[msg.key] = Req(msg)
            _, early = self.orphans.pop(msg.key, (0.0, []))
            if early:
                await self._process(early)
        elif isinstance(msg, P.DetokenizeReplay):
            await self._replay(msg)
        elif isinstance(msg, P.TokenBatch):
            await self._process(msg.items)
        elif isinstance(msg, P.TokenOut):
            await self._process([msg])
        elif isinstance(msg, P.EngineError):
            if msg.key in self.finished:  # a late error (e.g. a refused handoff) after the answer
                return
            self._end(msg.key)
            await self.send("api/0", msg)
        elif isinstance(msg, P.Abort):
            self._end(msg.key.request)

    def _end(self, key: P.RequestKey) -> None:
        self.reqs.pop(key, None)
        self.orphans.pop(key, None)
        self.finished[key] = time.monotonic()

    # ---- tokens -> text ------------------------------------------------------------------
    async def _process(self, items: list[P.TokenOut]) -> None:
        outs: list[P.TextOut] = []
        now = time.monotonic()
        for item in items:
            key = item.key.request
            req = self.reqs.get(key)
            if req is None and key in self.finished:
                continue  # a stale copy (sent again to this detokenizer after a restart)
            if req is None:
                t, buf = self.orphans.setdefault(key, (now, []))
                buf.append(item)
                continue
            ch = self._choice(req, item.key.choice)
            if ch.done or item.first_index < ch.next_index:
                continue
            ch.pending[item.first_index] = item
            while ch.next_index in ch.pending and not ch.done:
                it = ch.pending.pop(ch.next_index)
                ch.next_index += len(it.token_ids)
                out = self._advance(req, ch, it)
                if out is not None:
                    outs.append(out)
            if all(c.done for c in req.choices.values()) and len(req.choices) >= req.cfg.sampling.n:
                del self.reqs[key]
                self.finished[key] = now
        for key in [k for k, (t, _) in self.orphans.items() if now - t > ORPHAN_TTL_S]:
            del self.orphans[key]
        for key in [k for k, t in self.finished.items() if now - t > FINISHED_TTL_S]:
            del self.finished[key]
        if outs:
            await self.send("api/0", P.TextBatch(items=outs))

    async def _replay(self, msg: P.DetokenizeReplay) -> None:
        """Rebuild a request from its engine's replay: the first `received` tokens of each choice
        fed silently, one at a time as they first came, then the rest (and any tokens that beat
        the replay here) processed as usual."""
        key = msg.request.key
        if key in self.finished:
            return
        req = self.reqs.setdefault(key, Req(msg.request))
        rest = []
        for replayed in msg.choices:
            it, ch = replayed.tokens, self._choice(req, replayed.tokens.key.choice)
            if req.cfg.stream:  # a non-streamed request's text reaches the api only at its end
                for tid in it.token_ids[ch.next_index:replayed.received]:
                    ch.output.feed([tid])
                    ch.next_index += 1
                    ch.sent_any = True
            start = ch.next_index
            if start < len(it.token_ids) or it.finished:
                rest.append(msgspec.structs.replace(
                    it, token_ids=it.token_ids[start:], first_index=start,
                    logprobs=it.logprobs[start:] if it.logprobs is not None else None,
                    top_logprobs=it.top_logprobs[start:] if it.top_logprobs is not None else None))
        _, early = self.orphans.pop(key, (0.0, []))
        await self._process(rest + early)

    def _choice(self, req: Req, index: int) -> Choice:
        ch = req.choices.get(index)
        if ch is None:
            from glmrt.serving.choice_output import ChoiceOutput
            s = req.cfg.sampling
            ch = Choice(ChoiceOutput(self.tok, skip_special_tokens=s.skip_special_tokens, stop=s.stop,
                                     include_stop_str_in_output=s.include_stop_str_in_output,
                                     reasoning=req.cfg.reasoning, tools=req.cfg.tools, min_tokens=s.min_tokens,
                                     stop_token_ids=s.stop_token_ids))
            req.choices[index] = ch
        return ch

    def _logprobs(self, it: P.TokenOut) -> list[P.TokenLogprob]:
        out = []
        for k, (tid, lp) in enumerate(zip(it.token_ids, it.logprobs or [])):
            tops = (it.top_logprobs or [[]] * len(it.token_ids))[k] or []
            out.append(P.TokenLogprob(token_id=tid, token=self._token_text(tid), logprob=lp,
                                      top_logprobs=[P.TopLogprob(token_id=t, token=self._token_text(t), logprob=v)
                                                    for t, v in tops]))
        return out

    def _token_text(self, tid: int) -> str:
        piece = self.tok.id_to_token(tid)
        if piece is None:
            return ""
        try:
            raw = bytes(_BYTES[c] for c in piece)
        except KeyError:  # a special token: its text as is
            return piece
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def _advance(self, req: Req, ch: Choice, it: P.TokenOut) -> P.TextOut | None:
        cfg = req.cfg
        delta = ch.output.feed(it.token_ids, it.finish_reason if it.finished else None)
        if delta.stop_string and not it.finished:  # the engine is still generating it
            self._abort_choice(cfg, it.key)
        finished = delta.finish_reason is not None
        ch.done = finished
        lps = self._logprobs(it) if it.logprobs is not None else None
        usage = P.Usage(prompt_tokens=it.prompt_tokens or cfg.prompt_tokens, completion_tokens=it.completion_tokens,
                        cached_tokens=it.cached_tokens, spec_verify_ct=it.spec_verify_ct) if finished else None
        prompt_ids = None
        if cfg.prompt_token_ids is not None and not ch.sent_any:  # every choice's first output
            prompt_ids = list(cfg.prompt_token_ids)
        token_ids = list(it.token_ids)
        if not cfg.stream:
            ch.deltas.append(delta)
            ch.token_ids += it.token_ids
            if lps:
                ch.logprobs += lps
            if not finished:
                return None
            from glmrt.serving.choice_output import OutputDelta
            delta, token_ids, lps = OutputDelta.fold(ch.deltas), ch.token_ids, ch.logprobs or None
        ch.sent_any = True
        return P.TextOut(key=it.key, text=delta.text, reasoning=delta.reasoning, tool_calls=delta.tool_calls,
                         token_ids=token_ids, finished=finished, finish_reason=delta.finish_reason,
                         stop_reason=delta.stop_reason, usage=usage,
                         logprobs=lps, prompt_token_ids=prompt_ids)

    def _abort_choice(self, cfg: P.DetokenizeRequest, key: P.RequestKey) -> None:
        import asyncio
        if cfg.engine:
            msg = P.Abort(key=key, choice_only=cfg.sampling.n > 1)
            task = asyncio.get_running_loop().create_task(self.send(cfg.engine, msg))
            self._sends.add(task)
            task.add_done_callback(self._sends.discard)
