"""The engine actor (kind `engine`, alias `unified`): the in-process Engine behind an inbox.

The step runs in a worker thread so the event loop keeps receiving and sending while the
model computes; requests and aborts that arrive during a step are applied between steps
(the Engine is only ever touched by one thread at a time).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from typing import Any

from actors.base import Actor
from glmrt import protocol as P

STATS_S = 1.0


class EngineActor(Actor):
    kind = "engine"

    async def setup(self) -> dict[str, Any]:
        import torch

        from glmrt.engine.config import EngineConfig
        from glmrt.engine.engine import Engine

        torch.set_num_threads(int(self.spec.config.get("torch_threads", 1)))
        if self.spec.gpus and torch.cuda.is_available():
            torch.cuda.set_device(self.spec.gpus[0])
        cfg = EngineConfig(**self.spec.config["engine"])
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine-step")
        loop = asyncio.get_running_loop()
        self.engine = await loop.run_in_executor(self._executor, lambda: Engine(cfg, log=self._log))
        self._pending: list[tuple[str, Any]] = []
        self._wake = asyncio.Event()
        self._routes: dict[str, tuple[str, int, str]] = {}   # engine rid -> (api rid, choice index, detok)
        self._prompt_cached: dict[str, int] = {}               # api rid -> cached prompt tokens of choice 0
        info = dict(self.engine.info())
        info.update(backend=self.engine.backend.name, dtype=str(self.engine.dtype).removeprefix("torch."),
                    kv_dtype=self.engine.layout.kv_dtype, state_dtype=self.engine.layout.state_dtype,
                    memory=self.engine.memory.describe())
        return info

    def _log(self, line: str) -> None:
        print(f"[engine/{self.spec.replica}] {line}", flush=True)

    def busy(self) -> bool:
        return bool(self._routes) or bool(self._pending)

    def load(self) -> tuple[float, int, int]:
        s = self.engine.scheduler
        cap = max(1, self.engine.memory.max_running_requests)
        return (len(s.running) + len(s.waiting)) / cap, len(s.running), len(s.waiting)

    async def handle(self, msg: Any, frames: list) -> None:
        if isinstance(msg, P.EngineRequest):
            if not self.accepting:
                await self.send(msg.detokenizer, P.EngineError(rid=msg.rid, status=503,
                                                               message="engine is draining"))
                return
            mm = []
            if msg.mm_items:
                from glmrt.engine.mm import MMInput
                from transport.codec import tensor_from_frame
                for it in msg.mm_items:  # copy: the frames' memory belongs to zmq
                    pixels = tensor_from_frame(it.tensor, frames[it.tensor.frame], as_torch=True).clone()
                    mm.append(MMInput(it.kind, pixels, tuple(it.grid_thw), it.num_tokens))
            self._pending.append(("add", (msg, mm)))
        elif isinstance(msg, P.Abort):
            self._pending.append(("abort", msg))
        elif isinstance(msg, P.EngineStatsQuery):
            await self.send(msg.reply_to, self._stats(msg.qid))
            return
        self._wake.set()

    def _stats(self, qid: int = 0) -> P.EngineStats:
        e = self.engine
        info = e.info()
        counters = {k: float(v) for k, v in info.items() if isinstance(v, (int, float)) and v is not None}
        return P.EngineStats(actor=self.spec.kind, replica=self.spec.replica, qid=qid,
                             kv_pages_total=e.memory.num_pages, kv_pages_free=e.pages.num_free,
                             state_slots_total=e.memory.num_slots, state_slots_free=e.slots.num_free,
                             max_running_requests=e.memory.max_running_requests,
                             running=len(e.scheduler.running), waiting=len(e.scheduler.waiting), counters=counters)

    def _apply_pending(self) -> list[tuple[str, P.Msg]]:
        """Runs in the step thread: add/abort requests. Returns errors to send."""
        from glmrt.engine.engine import ContextLengthExceeded
        from glmrt.sampling_params import SamplingParams

        errors = []
        pending, self._pending = self._pending, []
        for op, arg in pending:
            if op == "abort":
                for rid, (api_rid, index, _) in list(self._routes.items()):
                    if api_rid == arg.rid and (arg.index is None or arg.index == index):
                        self.engine.abort(rid)
                        self.engine.requests.pop(rid, None)
                        del self._routes[rid]
                continue
            m, mm = arg
            s = m.sampling
            params = SamplingParams(
                temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
                frequency_penalty=s.frequency_penalty, presence_penalty=s.presence_penalty,
                repetition_penalty=s.repetition_penalty, seed=s.seed, stop_token_ids=list(s.stop_token_ids),
                ignore_eos=s.ignore_eos, max_tokens=s.max_tokens, min_tokens=s.min_tokens, logprobs=s.logprobs,
                top_logprobs=s.top_logprobs, n=s.n)
            try:
                rids = self.engine.add_request(m.prompt_ids, params, rid=f"{m.rid}#{time.monotonic_ns()}",
                                               mm_items=mm or None)
            except ContextLengthExceeded as e:
                errors.append((m.detokenizer, P.EngineError(rid=m.rid, status=400, message=str(e),
                                                            code="context_length_exceeded")))
                continue
            except ValueError as e:
                errors.append((m.detokenizer, P.EngineError(rid=m.rid, status=400, message=str(e))))
                continue
            for i, rid in enumerate(rids):
                self._routes[rid] = (m.rid, i, m.detokenizer)
        return errors

    def _step(self) -> tuple[list, list]:
        errors = self._apply_pending()
        outs = self.engine.step() if self.engine.has_work() else []
        batches: dict[str, list[P.TokenOut]] = {}
        prompt_cached = self._prompt_cached
        for o in outs:
            route = self._routes.get(o.rid)
            if route is not None and route[1] == 0 and route[0] not in prompt_cached:
                prompt_cached[route[0]] = o.cached_tokens
        for o in outs:
            route = self._routes.get(o.rid)
            if route is None:
                continue
            api_rid, index, detok = route
            req = self.engine.requests.get(o.rid)
            top = [list(map(tuple, t)) if t else [] for t in o.new_top_logprobs] if o.new_top_logprobs else None
            batches.setdefault(detok, []).append(P.TokenOut(
                rid=api_rid, token_ids=o.new_token_ids, first_index=o.completion_tokens - len(o.new_token_ids),
                index=index, finished=o.finished, finish_reason=o.finish_reason, prompt_tokens=o.prompt_tokens,
                completion_tokens=o.completion_tokens,
                # n > 1: the prompt was computed once, by choice 0; report its cached count for all
                cached_tokens=prompt_cached.get(api_rid, o.cached_tokens) if index else o.cached_tokens,
                logprobs=[x if x is not None else 0.0 for x in o.new_logprobs] if o.new_logprobs else None,
                top_logprobs=top))
            if o.finished:
                del self._routes[o.rid]
                if not any(r[0] == api_rid for r in self._routes.values()):
                    prompt_cached.pop(api_rid, None)
                if req is not None:
                    self.engine.requests.pop(o.rid, None)
        return errors, list(batches.items())

    async def background(self) -> None:
        loop = asyncio.get_running_loop()
        last_stats = 0.0
        while True:
            if not self._pending and not self.engine.has_work():
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=STATS_S)
                except asyncio.TimeoutError:
                    pass
            errors, batches = await loop.run_in_executor(self._executor, self._step)
            for dest, err in errors:
                await self.send(dest, err)
            for dest, items in batches:
                await self.send(dest, P.TokenBatch(items=items))
            now = time.monotonic()
            if now - last_stats >= STATS_S:
                last_stats = now
                await self.send("api/0", self._stats())

    async def teardown(self) -> None:
        self._executor.shutdown(wait=False)
