"""Prometheus metrics of a deployment, under fixed names (dashboards and tests rely on them).

Latencies and token counters are measured in the api (so they aggregate over engine
replicas by construction); pool gauges come from each engine's periodic EngineStats and
carry an `engine` label.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOK = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class Metrics:
    def __init__(self):
        self._seen: set[str] = set()  # the engines whose gauges carry samples
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("glmrt_time_to_first_token_seconds", "Time to first token", buckets=_LAT, registry=r)
        self.tpot = Histogram("glmrt_time_per_output_token_seconds", "Time per output token after the first",
                              buckets=_TOK, registry=r)
        self.itl = Histogram("glmrt_inter_token_latency_seconds", "Time between streamed deltas", buckets=_TOK,
                             registry=r)
        self.e2e = Histogram("glmrt_e2e_request_latency_seconds", "End-to-end request latency", buckets=_LAT,
                             registry=r)
        self.running = Gauge("glmrt_running_requests", "Requests running in the engines", ["engine"], registry=r)
        self.waiting = Gauge("glmrt_waiting_requests", "Requests waiting in the engines", ["engine"], registry=r)
        self.max_running = Gauge("glmrt_max_running_requests", "Effective max_running_requests", ["engine"],
                                 registry=r)
        self.kv_tokens = Gauge("glmrt_kv_pool_tokens", "KV pool tokens by state", ["engine", "state"], registry=r)
        self.state_slots = Gauge("glmrt_state_pool_slots", "State pool slots by state", ["engine", "state"],
                                 registry=r)
        self.requests = Counter("glmrt_requests", "Requests by final status", ["status"], registry=r)
        self.prompt_tokens = Counter("glmrt_prompt_tokens", "Prompt tokens served", registry=r)
        self.cached_prompt_tokens = Counter("glmrt_cached_prompt_tokens", "Prompt tokens served from the prefix cache",
                                            registry=r)
        self.generation_tokens = Counter("glmrt_generation_tokens", "Tokens generated", registry=r)
        self.inflight = Gauge("glmrt_api_inflight_requests", "Requests the api is serving", registry=r)
        # the host tier (--enable-hierarchical-cache) and its disk tier, per engine
        self.host_pages = Gauge("glmrt_host_cache_pages", "Host tier KV pages by state", ["engine", "state"],
                                registry=r)
        self.host_slots = Gauge("glmrt_host_cache_slots", "Host tier state slots by state", ["engine", "state"],
                                registry=r)
        self.host_bytes = Gauge("glmrt_host_cache_bytes", "Host tier bytes copied since start, by direction "
                                "(load: host to device, store: device to host)", ["engine", "direction"], registry=r)
        self.host_hit_tokens = Gauge("glmrt_host_cache_hit_tokens", "Prompt tokens loaded from the host tier "
                                     "since start", ["engine"], registry=r)
        self.disk_bytes = Gauge("glmrt_disk_cache_bytes", "Disk tier bytes by state (used, capacity)",
                                ["engine", "state"], registry=r)

        # speculative decoding (--speculative-algorithm), per engine
        self.spec_accept_len = Gauge("glmrt_spec_mean_accepted_length", "Tokens kept per drafting request and "
                                     "step (accepted drafts + the model's own), since start", ["engine"], registry=r)
        self.spec_accept_rate = Gauge("glmrt_spec_acceptance_rate", "Share of drafts at each draft position the "
                                      "model accepted, since start", ["engine", "position"], registry=r)
        self.spec_time = Gauge("glmrt_spec_seconds_per_step", "Mean seconds per speculative step, by phase "
                               "(draft: the MTP layer's chain; verify: the model's forward, sampling, rollback)",
                               ["engine", "phase"], registry=r)
        self.spec_tokens = Gauge("glmrt_spec_tokens", "Speculative tokens since start, by kind (drafted, "
                                 "accepted, emitted)", ["engine", "kind"], registry=r)
        self._spec_positions: dict[str, int] = {}

    def _forget_engine(self, key: str) -> None:
        """An engine that is not serving (dead, restarting, retired) has no samples: its last
        counters (the pages and slots its requests held) are not its successor's."""
        for g in (self.running, self.waiting, self.max_running, self.host_hit_tokens, self.spec_accept_len):
            try:
                g.remove(key)
            except KeyError:
                pass
        for g, states in ((self.kv_tokens, ("free", "cached", "in_use")),
                          (self.state_slots, ("free", "checkpoint", "in_use")), (self.host_pages, ("used", "free")),
                          (self.host_slots, ("used", "free")), (self.host_bytes, ("load", "store")),
                          (self.disk_bytes, ("used", "capacity")), (self.spec_time, ("draft", "verify")),
                          (self.spec_tokens, ("drafted", "accepted", "emitted")),
                          (self.spec_accept_rate, tuple(str(i) for i in range(self._spec_positions.pop(key, 0))))):
            for state in states:
                try:
                    g.remove(key, state)
                except KeyError:
                    pass

    def update_engines(self, stats: dict, live: set[str], inflight: int) -> None:
        self.inflight.set(inflight)
        for key in self._seen - (live & set(stats)):
            self._forget_engine(key)
        self._seen = live & set(stats)
        for key in list(stats):
            if key not in live:
                continue
            s = stats[key]
            c = s.counters
            ps = int(c.get("page_size", 1) or 1)
            # pages held by the prefix cache (tree pages and checkpoints' partial pages) are
            # reclaimable: they count as cached, not in use
            cached = (int(c.get("cached_pages", 0)) + int(c.get("checkpoint_pages", 0))) * ps
            free = s.kv_pages_free * ps
            total = s.kv_pages_total * ps
            self.running.labels(engine=key).set(s.running)
            self.waiting.labels(engine=key).set(s.waiting)
            self.max_running.labels(engine=key).set(s.max_running_requests)
            self.kv_tokens.labels(engine=key, state="free").set(free)
            self.kv_tokens.labels(engine=key, state="cached").set(cached)
            self.kv_tokens.labels(engine=key, state="in_use").set(max(0, total - free - cached))
            ckpt = int(c.get("slots_checkpoint", 0))
            self.state_slots.labels(engine=key, state="free").set(s.state_slots_free)
            self.state_slots.labels(engine=key, state="checkpoint").set(ckpt)
            self.state_slots.labels(engine=key, state="in_use").set(
                max(0, s.state_slots_total - s.state_slots_free - ckpt))
            if "host_pages_total" in c:
                self._host(key, c)
            if "spec_cycles" in c:
                self._spec(key, c)

    def _spec(self, key: str, c: dict) -> None:
        cycles, steps = c["spec_cycles"], c["spec_steps"]
        self.spec_accept_len.labels(engine=key).set(c["spec_emitted_tokens"] / cycles if cycles else 0.0)
        for kind in ("drafted", "accepted", "emitted"):
            self.spec_tokens.labels(engine=key, kind=kind).set(c[f"spec_{'draft' if kind == 'drafted' else kind}_tokens"])
        for phase in ("draft", "verify"):
            self.spec_time.labels(engine=key, phase=phase).set(c[f"spec_{phase}_seconds"] / steps if steps else 0.0)
        i = 0
        while f"spec_drafted_at_{i}" in c:
            n = c[f"spec_drafted_at_{i}"]
            self.spec_accept_rate.labels(engine=key, position=str(i)).set(c[f"spec_accepted_at_{i}"] / n if n else 0.0)
            i += 1
        self._spec_positions[key] = i

    def _host(self, key: str, c: dict) -> None:
        used, total = int(c["host_pages_used"]), int(c["host_pages_total"])
        self.host_pages.labels(engine=key, state="used").set(used)
        self.host_pages.labels(engine=key, state="free").set(total - used)
        used, total = int(c["host_slots_used"]), int(c["host_slots_total"])
        self.host_slots.labels(engine=key, state="used").set(used)
        self.host_slots.labels(engine=key, state="free").set(total - used)
        self.host_bytes.labels(engine=key, direction="load").set(c.get("host_load_bytes", 0))
        self.host_bytes.labels(engine=key, direction="store").set(c.get("host_store_bytes", 0))
        self.host_hit_tokens.labels(engine=key).set(c.get("host_hit_tokens", 0))
        if "disk_capacity_bytes" in c:
            self.disk_bytes.labels(engine=key, state="used").set(c["disk_used_bytes"])
            self.disk_bytes.labels(engine=key, state="capacity").set(c["disk_capacity_bytes"])

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
