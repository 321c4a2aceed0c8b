"""The api actor's routes that serve no request: the model list, health, server info, metrics and
the admin routes (status, scale, shutdown). A mixin of actors.api.ApiServer, whose state they
read: the supervisor (`sup`), the served name, the engines' live stats and the metrics."""

from __future__ import annotations

from aiohttp import web

from glmrt.serving import openai_api as oa
from glmrt.serving.openai_api.fields import decode_body


class InfoRoutes:
    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(oa.models_response(self.served_model, self.created, self.context_length()))

    async def model(self, request: web.Request) -> web.Response:
        """GET /v1/models/{id}: the model object of the served name, else OpenAI's 404."""
        name = request.match_info["model_id"]
        listed = oa.models_response(self.served_model, self.created, self.context_length())["data"]
        entry = next((m for m in listed if m["id"] == name), None)
        if entry is None:
            raise oa.not_found_model(name)
        return web.json_response(entry)

    async def health(self, request: web.Request) -> web.Response:
        if self.sup.all_ready() and not self.sup.stopping:
            return web.json_response({"status": "ok"})
        # open without the key: each actor's kind, replica and state, not its pid, host or GPUs
        # (those are /admin/status's)
        return web.json_response({"status": "starting" if not self.sup.stopping else "stopping",
                                  "actors": [{k: a[k] for k in ("kind", "replica", "state")}
                                             for a in self.sup.status()]}, status=503)

    async def server_info(self, request: web.Request) -> web.Response:
        engines = {}
        for a in [a for k in self.sup.topo.engine_kinds for a in self.sup.ready(k)]:
            info = dict(a.info)  # boot facts (pools, backend, dtypes) + the latest live counters
            stats = self.engine_stats.get(a.actor_id)
            if stats is not None:
                info.update({k: int(v) if float(v).is_integer() else v for k, v in stats.counters.items()})
                info.update(running=stats.running, waiting=stats.waiting, pages_free=stats.kv_pages_free,
                            slots_free=stats.state_slots_free)
            engines[a.actor_id] = info
        return web.json_response({"model": self.served_model, "model_path": self.sup.model_path,
                                  "context_length": self.context_length(), "engines": engines,
                                  "actors": self.sup.status()})

    async def metrics_route(self, request: web.Request) -> web.Response:
        self.metrics.update_engines(self.engine_stats, {a.actor_id for k in self.sup.topo.engine_kinds
                                                        for a in self.sup.ready(k)},
                                    len(self.inflight))
        body, ctype = self.metrics.render()
        return web.Response(body=body, headers={"Content-Type": ctype})

    # ---- admin ---------------------------------------------------------------------------
    async def admin_status(self, request: web.Request) -> web.Response:
        return web.json_response({"actors": self.sup.status()})

    async def admin_scale(self, request: web.Request) -> web.Response:
        body = decode_body(await request.read() or b"{}")
        kind, n = body.get("kind"), body.get("replicas")
        if not isinstance(kind, str) or isinstance(n, bool) or not isinstance(n, int):
            raise oa.bad_request('expected a JSON body {"kind": KIND, "replicas": N} (a string and an integer)')
        try:
            changed = await self.sup.scale(kind, n)
        except ValueError as e:
            raise oa.bad_request(str(e), "kind") from None
        return web.json_response({"kind": kind, "replicas": n, "changed": changed, "actors": self.sup.status()})

    async def admin_shutdown(self, request: web.Request) -> web.Response:
        self.shutdown_requested.set()
        return web.json_response({"status": "shutting down"})
