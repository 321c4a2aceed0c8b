"""The pool gauges of an engine that is not serving (dead, restarting) carry no sample: the pages
and slots its requests held are not reported as its successor's."""

from __future__ import annotations

from actors.metrics import Metrics
from glmrt import protocol as P


def _stats(pages_free: int, slots_free: int) -> P.EngineStats:
    return P.EngineStats(actor="engine", replica=0, kv_pages_total=10, kv_pages_free=pages_free,
                         state_slots_total=4, state_slots_free=slots_free, max_running_requests=4, running=2,
                         waiting=0, counters={"page_size": 16})


def _samples(m: Metrics, name: str) -> dict[tuple, float]:
    return {tuple(sorted(s.labels.items())): s.value for fam in m.registry.collect() for s in fam.samples
            if s.name == name}


def test_a_dead_engines_pool_gauges_are_dropped_until_its_successor_reports():
    m = Metrics()
    m.update_engines({"engine/0": _stats(6, 2)}, {"engine/0"}, 2)
    in_use = (("engine", "engine/0"), ("state", "in_use"))
    assert _samples(m, "glmrt_kv_pool_tokens")[in_use] == 4 * 16
    assert _samples(m, "glmrt_state_pool_slots")[in_use] == 2
    m.update_engines({}, set(), 0)  # it died: the api dropped its stats, the supervisor restarts it
    assert not any(dict(k)["engine"] == "engine/0" for k in _samples(m, "glmrt_kv_pool_tokens"))
    assert not any(dict(k)["engine"] == "engine/0" for k in _samples(m, "glmrt_state_pool_slots"))
    assert not _samples(m, "glmrt_running_requests")
    m.update_engines({"engine/0": _stats(10, 4)}, {"engine/0"}, 0)  # the restarted engine's first stats
    assert _samples(m, "glmrt_kv_pool_tokens")[in_use] == 0
