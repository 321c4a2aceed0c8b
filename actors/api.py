"""The api actor: the OpenAI-compatible HTTP server (aiohttp) and the admin routes.

A request: validate -> pick a tokenizer (round robin) and the least-loaded engine -> send a
TokenizeRequest -> await TextOuts from the detokenizer (this actor's inbox) -> SSE chunks or
one JSON body. A client that goes away aborts its request everywhere. An engine that dies
fails the requests routed through it at once (503); a tokenizer or a detokenizer that dies
loses none: the api re-sends the TokenizeRequests a dead tokenizer held to a live replica
(or to the restarted one), and asks the engines to replay a restarted detokenizer's requests,
saying how many tokens of each choice it has the text of. No torch in this process.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from actors.api_routes import InfoRoutes
from actors.base import codec_for, inbox_address
from actors.logs import request_line
from actors.metrics import Metrics
from glmrt import protocol as P
from glmrt.mm_limits import DEFAULT_LIMITS, parse_mm_limits
from glmrt.serving import openai_api as oa
from transport.channels import Inbox

log = logging.getLogger("api/0")


@dataclass
class Inflight:
    key: P.RequestKey  # one prompt's engine request (all its choices)
    queue: asyncio.Queue
    engine: str
    tokenizer: str
    detokenizer: str
    decode: str | None = None
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None
    done: bool = False
    finish_reasons: list[str] = field(default_factory=list)   # one per finished choice, for its log line
    tokenize: P.TokenizeRequest | None = None  # sent again when its tokenizer dies
    resend: bool = False  # its tokenizer died with no live replica: re-sent once it is back
    received: dict[int, int] = field(default_factory=dict)  # choice -> tokens whose text came


def _wire_error(item: P.TokenizerError | P.EngineError, kind: str) -> oa.APIError:
    """The HTTP error for an actor's error message; a context error names the route's prompt field."""
    return oa.error_from_wire(item.status, item.message, getattr(item, "code", None),
                              prompt_param="messages" if kind == "chat" else "prompt")


class ApiServer(InfoRoutes):
    def __init__(self, supervisor, *, served_model: str, host: str, port: int, api_key: str | None,
                 max_request_mb: float, max_queued_requests: int, generation_config: dict,
                 log_requests: bool = True, limit_mm_per_prompt: str = DEFAULT_LIMITS):
        self.sup = supervisor
        self.mm_limits = parse_mm_limits(limit_mm_per_prompt)
        self.served_model = served_model
        self.host, self.port = host, port
        self.api_key = api_key
        self.max_body = max(1, int(max_request_mb * 2**20))   # aiohttp reads 0 as no limit
        self.max_queued = max_queued_requests
        self.generation_config = generation_config
        self.log_requests = log_requests
        ctx = supervisor.ctx
        self.inbox = Inbox(ctx, inbox_address(supervisor.run_dir, "api/0"), codec_for("api/0"))
        self.peers = supervisor.peers
        self.inflight: dict[P.RequestKey, Inflight] = {}
        self._rr = itertools.count()
        self.metrics = Metrics()
        self.engine_stats: dict[str, P.EngineStats] = {}
        self.created = int(time.time())
        self.runner: web.AppRunner | None = None
        self._recv_task: asyncio.Task | None = None
        self._resends: set[asyncio.Task] = set()
        self.shutdown_requested = asyncio.Event()

    # ---- wiring --------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body, middlewares=[self._errors])
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model_id:.+}", self.model)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/server_info", self.server_info)
        app.router.add_get("/metrics", self.metrics_route)
        app.router.add_get("/admin/status", self.admin_status)
        app.router.add_post("/admin/scale", self.admin_scale)
        app.router.add_post("/admin/shutdown", self.admin_shutdown)
        return app

    async def start(self) -> None:
        self._recv_task = asyncio.create_task(self._recv_loop())
        self.runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.host, self.port, reuse_address=True, shutdown_timeout=2.0)
        await site.start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        if self._recv_task:
            self._recv_task.cancel()
        self.inbox.close()

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            if request.path.startswith(("/v1/", "/admin/", "/server_info", "/metrics")):
                self._check_key(request)
            return await handler(request)
        except oa.APIError as e:
            return self._error(e)
        except web.HTTPRequestEntityTooLarge:
            return self._error(oa.too_large(self.max_body))
        except web.HTTPNotFound:
            return self._error(oa.APIError(404, f"no route {request.method} {request.path}", "not_found_error",
                                           code="not_found"))
        except web.HTTPMethodNotAllowed:
            return self._error(oa.APIError(405, f"method {request.method} not allowed on {request.path}",
                                           "invalid_request_error", code="method_not_allowed"))
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception as e:  # never a bare 500 page
            log.exception("unhandled error on %s", request.path)
            return self._error(oa.internal_error(f"internal error: {type(e).__name__}"))

    @staticmethod
    def _error(e: oa.APIError) -> web.Response:
        return web.json_response(e.to_json(), status=e.status, headers=e.headers or None)

    def _check_key(self, request: web.Request) -> None:
        if not self.api_key:
            return
        got = request.headers.get("Authorization", "")
        token = got[7:] if got.startswith("Bearer ") else request.headers.get("x-api-key", "")
        if not hmac.compare_digest(token.encode(), self.api_key.encode()):
            raise oa.unauthorized()

    # ---- inbox ---------------------------------------------------------------------------
    async def _recv_loop(self) -> None:
        while True:
            try:
                msg, _ = await self.inbox.recv()
            except Exception as e:
                log.warning("dropped a message: %s", e)
                continue
            if isinstance(msg, P.TextBatch):
                for item in msg.items:
                    self._deliver(item)
            elif isinstance(msg, (P.TextOut, P.TokenizerError, P.EngineError)):
                self._deliver(msg)
            elif isinstance(msg, P.EngineStats):
                self.engine_stats[f"{msg.actor}/{msg.replica}"] = msg

    def _deliver(self, item: Any) -> None:
        st = self.inflight.get(item.key.request)
        if st is None:
            return
        now = time.monotonic()
        if isinstance(item, P.TextOut):
            st.received[item.key.choice] = st.received.get(item.key.choice, 0) + len(item.token_ids)
        if isinstance(item, P.TextOut) and (item.token_ids or item.text or item.reasoning):
            if st.first_token is None:
                st.first_token = now
                self.metrics.ttft.observe(now - st.arrival)
            elif st.last_token is not None:
                self.metrics.itl.observe(now - st.last_token)
            st.last_token = now
        if isinstance(item, P.TextOut) and item.finished:
            st.finish_reasons.append(item.finish_reason or "stop")
        st.queue.put_nowait(item)

    def fail_actor(self, actor_id: str) -> None:
        """An actor died. An engine's requests fail now (the client gets a 503). A tokenizer's
        are sent to a live replica, or wait for it to restart; a restarting detokenizer's wait
        for its replay (`actor_restarted`). Those of an actor given up on fail too."""
        kind = actor_id.split("/")[0]
        # a dead engine's last counters (pages and slots its requests held) are not its successor's
        self.engine_stats.pop(actor_id, None)
        coming_back = self.sup.actors[actor_id].state == "restarting" if actor_id in self.sup.actors else False
        live = self.sup.ready("tokenizer")
        for st in [s for s in self.inflight.values() if not s.done]:
            if actor_id not in (st.engine, st.tokenizer, st.detokenizer, st.decode):
                continue
            if kind == "tokenizer" and (live or coming_back):
                if st.received:
                    continue  # text came back: the tokenizer had sent it on
                if live:
                    st.tokenizer = live[next(self._rr) % len(live)].actor_id
                    self._resend_tokenize(st)
                else:
                    st.resend = True
            elif not (kind == "detokenizer" and coming_back):
                st.queue.put_nowait(oa.APIError(503, f"{actor_id} failed while serving this request; retry",
                                                "server_error", code="actor_failed", headers={"Retry-After": "1"}))

    def actor_restarted(self, actor_id: str) -> None:
        """A restarted actor is ready: re-send the requests that waited for it (tokenizer), or
        ask every engine holding its requests to replay them to it (detokenizer)."""
        kind = actor_id.split("/")[0]
        waiting = [st for st in self.inflight.values() if not st.done]
        if kind == "tokenizer":
            for st in waiting:
                if st.resend and st.tokenizer == actor_id:
                    st.resend = False
                    self._resend_tokenize(st)
        elif kind == "detokenizer":
            by_engine: dict[str, list[P.ChoiceProgress]] = {}
            for st in waiting:
                if st.detokenizer != actor_id:
                    continue
                progress = [P.ChoiceProgress(key=st.key, received=st.received.get(0, 0))]
                progress += [P.ChoiceProgress(key=st.key.with_choice(c), received=n)
                             for c, n in st.received.items() if c]
                for engine in (st.engine, st.decode):  # PD: the prefill or the decode holds it
                    if engine is not None:
                        by_engine.setdefault(engine, []).extend(progress)
            for engine, progress in by_engine.items():
                self._resend_to(engine, P.ReplayRequest(detokenizer=actor_id, progress=progress))

    def _resend_tokenize(self, st: Inflight) -> None:
        self._resend_to(st.tokenizer, st.tokenize)

    def _resend_to(self, dest: str, msg: P.Msg) -> None:
        task = asyncio.get_running_loop().create_task(self.peers.send(dest, msg))
        self._resends.add(task)
        task.add_done_callback(self._resends.discard)

    # ---- routing -------------------------------------------------------------------------
    @staticmethod
    async def _next(queue: asyncio.Queue, request: web.Request):
        """The next item for a request, giving up when its client has gone (then the caller's
        `finally` aborts the request everywhere and frees its memory)."""
        while True:
            try:
                return await asyncio.wait_for(queue.get(), timeout=0.25)
            except asyncio.TimeoutError:
                transport = request.transport
                if transport is None or transport.is_closing():
                    raise ConnectionResetError("client disconnected")

    def _least_loaded(self, kind: str, attr: str = "engine"):
        counts: dict[str, int] = {}
        for st in self.inflight.values():
            key = getattr(st, attr)
            counts[key] = counts.get(key, 0) + 1
        return min(self.sup.ready(kind), key=lambda a: (counts.get(a.actor_id, 0), a.load, a.replica))

    def _route(self, engine_requests: int = 1) -> tuple[str, str, str, str | None]:
        kinds = self.sup.topo.engine_kinds
        toks = self.sup.ready("tokenizer")
        detoks = self.sup.ready("detokenizer")
        if not (toks and detoks and all(self.sup.ready(k) for k in kinds)):
            raise oa.APIError(503, "the server is not ready (actors starting or restarting); retry",
                              "server_error", code="not_ready", headers={"Retry-After": "1"})
        if engine_requests > self.max_queued:   # never admitted, however long it waits
            raise oa.bad_request(f"this request makes {engine_requests} engine requests (one per prompt); the "
                                 f"server queues at most {self.max_queued} (--max-queued-requests).", "prompt")
        if len(self.inflight) + engine_requests > self.max_queued:
            raise oa.overloaded(1)
        turn = next(self._rr)  # one turn per request: each kind's replicas take it in order
        tok, det = toks[turn % len(toks)], detoks[turn % len(detoks)]
        if kinds == ("engine",):
            return tok.actor_id, self._least_loaded("engine").actor_id, det.actor_id, None
        pre, dec = self._least_loaded("prefill"), self._least_loaded("decode", "decode")
        return tok.actor_id, pre.actor_id, det.actor_id, dec.actor_id

    def context_length(self) -> int | None:
        lens = [a.info.get("context_length") for k in self.sup.topo.engine_kinds for a in self.sup.ready(k)
                if a.info.get("context_length")]
        return min(lens) if lens else None

    async def _submit(self, req, rid: str) -> list[Inflight]:
        tok, eng, det, dec = self._route(oa.engine_request_count(req))
        ctx = self.context_length()
        sampling = oa.to_sampling_params(req, defaults=self.generation_config, max_model_len=ctx)
        queue: asyncio.Queue = asyncio.Queue()
        states = []
        for tr in oa.to_tokenize_requests(req, rid, det, sampling=sampling, arrival=time.time(), max_model_len=ctx):
            tr.engine, tr.decode = eng, dec
            st = Inflight(tr.key, queue, eng, tok, det, decode=dec, tokenize=tr)
            self.inflight[tr.key] = st
            states.append(st)
            try:
                await self.peers.send(tok, tr)
            except BaseException:  # cancelled or failed mid-way: nothing of this request stays queued
                await self._abort(states)
                raise
        return states

    async def _abort(self, states: list[Inflight]) -> None:
        for st in states:
            if not st.done:
                # the tokenizer too while nothing came back: the request may still wait in its queue
                tok = st.tokenizer if st.first_token is None else None
                for dest in (tok, st.engine, st.detokenizer, st.decode):
                    if dest is None:
                        continue
                    try:
                        await asyncio.wait_for(self.peers.send(dest, P.Abort(key=st.key)), 1.0)
                    except Exception:
                        pass
            self.inflight.pop(st.key, None)

    def _finish_metrics(self, states: list[Inflight], usage: dict | None, status: str) -> None:
        self.metrics.requests.labels(status=status).inc()
        now = time.monotonic()
        for st in states:
            self.metrics.e2e.observe(now - st.arrival)
        if usage:
            self.metrics.prompt_tokens.inc(usage.get("prompt_tokens", 0))
            self.metrics.generation_tokens.inc(usage.get("completion_tokens", 0))
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            self.metrics.cached_prompt_tokens.inc(cached)
            n_out = usage.get("completion_tokens", 0)
            st = states[0]
            if st.first_token is not None and n_out > 1:
                self.metrics.tpot.observe((now - st.first_token) / (n_out - 1))

    def _log_request(self, states: list[Inflight], status: int | str, *, usage: dict | None = None,
                     error: str | None = None, streamed: bool = True) -> None:
        """The info line of one finished request (all its prompts), unless --disable-log-requests.
        A non-streamed answer reaches the api whole: its first token's time is not known here."""
        if not self.log_requests:
            return
        first = states[0]
        ttft = None if first.first_token is None or not streamed else first.first_token - first.arrival
        log.info(request_line(first.key.rid, status=status, duration=time.monotonic() - first.arrival, ttft=ttft,
                              usage=usage, finish=[r for st in states for r in st.finish_reasons], error=error))

    # ---- OpenAI routes -------------------------------------------------------------------
    async def _body(self, request: web.Request) -> bytes:
        if request.content_length is not None and request.content_length > self.max_body:
            raise oa.too_large(self.max_body)
        return await request.read()

    async def chat(self, request: web.Request) -> web.StreamResponse:
        req = oa.parse_chat_request(await self._body(request), self.served_model, max_model_len=self.context_length(),
                                    mm_limits=self.mm_limits)
        return await self._serve(request, req, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = oa.parse_completion_request(await self._body(request), self.served_model,
                                          max_model_len=self.context_length())
        return await self._serve(request, req, "completion")

    async def _serve(self, request: web.Request, req, kind: str) -> web.StreamResponse:
        rid = oa.new_request_id(kind)
        states = await self._submit(req, rid)
        queue = states[0].queue
        n_prompts = len(states)
        total = n_prompts * req.n
        created = int(time.time())
        status = "error"
        try:
            if req.stream:
                resp, error = await self._stream(request, req, kind, rid, created, queue, states, total)
                status = "success" if error is None else "error"
                if error is not None:
                    self.metrics.requests.labels(status="error").inc()
                    self._log_request(states, error.status, error=error.code or error.type)
                return resp
            accs: dict[int, oa.ChoiceAccumulator] = {}
            finished = 0
            while finished < total:
                item = await self._next(queue, request)
                if isinstance(item, oa.APIError):
                    raise item
                if isinstance(item, (P.TokenizerError, P.EngineError)):
                    raise _wire_error(item, kind)
                index = oa.response_index(item.key, req.n)
                acc = accs.get(index)
                if acc is None:
                    acc = accs[index] = oa.ChoiceAccumulator(
                        index, kind=kind, logprobs=bool(req.logprobs), return_token_ids=req.return_token_ids,
                        parallel_tool_calls=getattr(req, "parallel_tool_calls", True))
                acc.add(item)
                if item.finished:
                    finished += 1
            for st in states:
                st.done = True
            totals = oa.UsageTotals()
            for i, acc in accs.items():
                if acc.usage is not None:
                    totals.add(i // req.n, acc.usage)  # the prompt's index
            usage = totals.to_json()
            ordered = [accs[i] for i in sorted(accs)]
            if kind == "chat":
                body = oa.chat_completion_response(rid, self.served_model, created, [a.chat_choice() for a in ordered],
                                                   usage, prompt_token_ids=ordered[0].prompt_token_ids
                                                   if req.return_token_ids else None)
            else:
                body = oa.completion_response(rid, self.served_model, created, [a.completion_choice() for a in ordered],
                                              usage)
            status = "success"
            self._finish_metrics(states, usage, status)
            self._log_request(states, 200, usage=usage, streamed=False)
            return web.json_response(body)
        except oa.APIError as e:
            self.metrics.requests.labels(status="error").inc()
            self._log_request(states, e.status, error=e.code or e.type, streamed=req.stream)
            raise
        except ConnectionResetError:
            self._log_request(states, "aborted", error="client_disconnected", streamed=req.stream)
            raise
        finally:
            if status != "success" or not all(st.done for st in states):
                await self._abort(states)
            for st in states:
                self.inflight.pop(st.key, None)

    async def _stream(self, request, req, kind, rid, created, queue, states, total) -> web.StreamResponse:
        if kind == "chat":
            stream = oa.ChatStream(rid, self.served_model, created, include_usage=req.include_usage,
                                   logprobs=bool(req.logprobs), return_token_ids=req.return_token_ids,
                                   parallel_tool_calls=req.parallel_tool_calls)
        else:
            stream = oa.CompletionStream(rid, self.served_model, created, n=req.n, include_usage=req.include_usage,
                                         logprobs=bool(req.logprobs), return_token_ids=req.return_token_ids)
        # Wait for the first item before committing to 200: an early error is still a JSON error.
        first = await self._next(queue, request)
        if isinstance(first, oa.APIError):
            raise first
        if isinstance(first, (P.TokenizerError, P.EngineError)):
            raise _wire_error(first, kind)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        error = None
        try:
            error = await self._stream_items(request, first, stream, kind, queue, states, total, resp)
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception as e:   # the 200 is out: the error goes into the stream, as an SSE error event
            log.exception("stream of %s failed", rid)
            error = oa.internal_error(f"internal error: {type(e).__name__}")
            await resp.write(oa.sse_error(error))
        await resp.write(oa.SSE_DONE)
        await resp.write_eof()
        return resp, error

    async def _stream_items(self, request, item, stream, kind, queue, states, total, resp) -> oa.APIError | None:
        """Writes each item's chunks until every choice finished (then the usage chunk) or an
        error came (its SSE error event); returns that error."""
        finished = 0
        while True:
            if isinstance(item, (P.TokenizerError, P.EngineError)):
                item = _wire_error(item, kind)
            if isinstance(item, oa.APIError):
                await resp.write(oa.sse_error(item))
                return item
            for c in stream.on_text(item):
                await resp.write(oa.sse(c))
            if item.finished:
                finished += 1
                if finished >= total:
                    for s in states:
                        s.done = True
                    u = stream.usage_chunk()
                    if u is not None:
                        await resp.write(oa.sse(u))
                    self._finish_metrics(states, stream.usage.to_json(), "success")
                    self._log_request(states, 200, usage=stream.usage.to_json())
                    return None
            item = await self._next(queue, request)
