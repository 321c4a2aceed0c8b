"""E2E: two engine replicas of two ranks each (`--tp-size 2 --engine-replicas 2`, gloo on the
CPU). A rank killed with SIGKILL takes its whole group down: the surviving rank is gone within
5 s (a follower killed: rank 0's watcher ends it; rank 0 killed: the follower dies with it), the
requests the group held fail within 5 s (a 503 JSON error, an SSE error event once streaming),
the other engine keeps serving its own requests and new ones throughout, the supervisor restarts
the group, and afterwards no page or slot is in use, no old rank is alive and no rendezvous
file of the dead group is left in the run directory."""

from __future__ import annotations

import glob
import json
import os
import signal
import tempfile
import threading
import time

import httpx
import pytest

from tests.e2e.conftest import metric_sum, process_alive

pytestmark = pytest.mark.slow

BOUND_S = 5.0
LONG = 3000  # decode steps: minutes here, so only a failure (or the test) ends these requests
PLAIN_TIMEOUT_S = 9.0  # a plain request still running after this was not failed


@pytest.fixture(scope="module")
def dep(start_deployment):
    d = start_deployment(["--tp-size", "2", "--engine-replicas", "2", "--dtype", "float32"], name="engine-group")
    yield d
    d.stop(term_wait=10)


def _engines(dep) -> dict[str, dict]:
    return {f"engine/{a['replica']}": a for a in dep.actors("engine")}


class Held:
    """Long requests in threads, two streamed and two plain; the api spreads them 2:2 over the
    engines (least routed first). Each records how and when it ended, and the streams when
    their last chunk came."""

    def __init__(self, dep):
        self.dep = dep
        self.stop = threading.Event()
        self.results: dict[str, dict] = {}
        self.threads = [threading.Thread(target=self._stream, args=(f"stream{i}",), daemon=True) for i in range(2)]
        self.threads += [threading.Thread(target=self._plain, args=(f"plain{i}",), daemon=True) for i in range(2)]

    def _body(self, name: str, stream: bool) -> dict:
        return {"model": self.dep.model_id(), "prompt": f"{name}: a long story", "max_tokens": LONG,
                "temperature": 0, "ignore_eos": True, "stream": stream}

    def _stream(self, name: str) -> None:
        res = self.results.setdefault(name, {"chunks": 0, "last_chunk": None})
        with httpx.Client(timeout=60) as h, h.stream("POST", self.dep.url + "/v1/completions",
                                                     json=self._body(name, True)) as r:
            res["status"] = r.status_code
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    res.update(outcome="error", error=event["error"], t=time.monotonic())
                    return
                res["chunks"] += 1
                res["last_chunk"] = time.monotonic()
                if self.stop.is_set():
                    res.update(outcome="running", t=time.monotonic())
                    return  # leaving the stream closes it: the api aborts the request
        res.update(outcome="ended", t=time.monotonic())

    def _plain(self, name: str) -> None:
        res = self.results.setdefault(name, {})
        try:
            r = httpx.post(self.dep.url + "/v1/completions", json=self._body(name, False), timeout=PLAIN_TIMEOUT_S)
            res.update(outcome="error" if r.status_code >= 400 else "ended", status=r.status_code,
                       error=r.json().get("error"), t=time.monotonic())
        except httpx.TimeoutException:
            res.update(outcome="running", t=time.monotonic())

    def start(self, timeout: float = 60) -> None:
        for t in self.threads[:2]:
            t.start()
        deadline = time.monotonic() + timeout
        while any(self.results.get(f"stream{i}", {}).get("chunks", 0) < 2 for i in range(2)):
            assert time.monotonic() < deadline, f"the streams did not start: {self.results}"
            time.sleep(0.05)
        for t in self.threads[2:]:
            t.start()
        while sum(a["running"] for a in _engines(self.dep).values()) < 4:  # the plain ones decode too
            assert time.monotonic() < deadline, f"the requests did not all start: {_engines(self.dep)}"
            time.sleep(0.1)

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(PLAIN_TIMEOUT_S + 30)
        assert not any(t.is_alive() for t in self.threads), self.results


def _wait_restarted(dep, actor: str, old: list[dict], restarts: int, timeout: float = 90) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = _engines(dep)[actor]
        if row["state"] == "ready" and row["ranks"] and row["ranks"][0]["pid"] != old[0]["pid"]:
            assert row["restarts"] == restarts, row
            return row
        time.sleep(0.2)
    dep.fail(f"{actor} did not come back with new ranks: {_engines(dep)}")


def _wait_nothing_in_use(dep, timeout: float = 15) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = dep.metrics()
        held = {e: (metric_sum(m, "glmrt_kv_pool_tokens", engine=e, state="in_use"),
                    metric_sum(m, "glmrt_state_pool_slots", engine=e, state="in_use"),
                    metric_sum(m, "glmrt_running_requests", engine=e)) for e in ("engine/0", "engine/1")}
        if all(v == (0, 0, 0) for v in held.values()) and metric_sum(m, "glmrt_api_inflight_requests") == 0:
            info = dep.get_json("/server_info")["engines"]
            assert sorted(info) == ["engine/0", "engine/1"], info
            return info
        assert time.monotonic() < deadline, f"pages, slots or requests still held: {held}"
        time.sleep(0.3)


def _rendezvous_files(dep) -> list[str]:
    (run_dir,) = glob.glob(os.path.join(tempfile.gettempdir(), f"glmrt-{dep.proc.pid}-*"))  # make_run_dir's name
    return sorted(f for f in os.listdir(run_dir) if f.endswith(".ranks"))


def _kill_rank_holding_requests(dep, rank: int, restarts: int) -> None:
    """Kill rank `rank` of the engine that serves the first stream; check the bounds."""
    _wait_nothing_in_use(dep)
    held = Held(dep)
    held.start()
    engines = _engines(dep)
    assert [a["running"] for a in engines.values()] == [2, 2], engines
    victim_engine = "engine/0"  # the first request goes to the least loaded engine, replica 0 first
    other = "engine/1"
    old = engines[victim_engine]["ranks"]
    other_pids = [r["pid"] for r in engines[other]["ranks"]]
    t_kill = time.monotonic()
    os.kill(old[rank]["pid"], signal.SIGKILL)
    survivor = old[1 - rank]["pid"]
    while process_alive(survivor):
        assert time.monotonic() - t_kill < BOUND_S, f"rank {1 - rank} (pid {survivor}) outlived its group by 5 s"
        time.sleep(0.02)
    survived_s = time.monotonic() - t_kill
    while _engines(dep)[victim_engine]["state"] == "ready":
        assert time.monotonic() - t_kill < BOUND_S, f"the supervisor did not see {victim_engine} die"
        time.sleep(0.02)
    m = dep.metrics()  # the dead group's pools are not reported (nor, later, as its successor's)
    assert not any(n in ("glmrt_kv_pool_tokens", "glmrt_state_pool_slots") and dict(lab)["engine"] == victim_engine
                   for n, lab in m), m
    # the other engine serves new requests while the group restarts
    served = 0
    with httpx.Client(timeout=30) as h:
        while time.monotonic() - t_kill < BOUND_S + 1:
            r = h.post(dep.url + "/v1/completions", json={"model": dep.model_id(), "prompt": f"probe {served}",
                                                          "max_tokens": 3, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            served += 1
    held.finish()
    failed = {n: r for n, r in held.results.items() if r["outcome"] == "error"}
    kept = {n: r for n, r in held.results.items() if r["outcome"] == "running"}
    assert len(failed) == 2 and len(kept) == 2, held.results
    for name, r in failed.items():
        assert r["t"] - t_kill < BOUND_S, f"{name} failed only {r['t'] - t_kill:.1f} s after the kill: {r}"
        assert victim_engine in r["error"]["message"] and r["error"]["type"] == "server_error", r
        if name.startswith("plain"):
            assert r["status"] == 503, r
    for name, r in kept.items():  # the other engine's requests went on
        if name.startswith("stream"):
            assert r["last_chunk"] > t_kill + BOUND_S, (name, r, t_kill)
    assert served >= 1 and all(process_alive(p) for p in other_pids), "the other engine stopped serving"
    row = _wait_restarted(dep, victim_engine, old, restarts)
    m = dep.metrics()
    assert metric_sum(m, "glmrt_kv_pool_tokens", engine=victim_engine, state="in_use") == 0, m
    assert metric_sum(m, "glmrt_state_pool_slots", engine=victim_engine, state="in_use") == 0, m
    assert not any(process_alive(r["pid"]) for r in old), old
    assert all(process_alive(r["pid"]) for r in row["ranks"]), row
    assert _engines(dep)[other]["restarts"] == 0 and [r["pid"] for r in _engines(dep)[other]["ranks"]] == other_pids
    _wait_nothing_in_use(dep)
    assert len(_rendezvous_files(dep)) == 2, _rendezvous_files(dep)  # one per live group
    r = httpx.post(dep.url + "/v1/completions", json={"model": dep.model_id(), "prompt": "after", "max_tokens": 4,
                                                      "temperature": 0, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    print(f"rank {1 - rank} gone {survived_s:.2f} s after rank {rank} was killed")


@pytest.mark.timeout(180)
def test_a_dead_follower_ends_rank_0_fails_its_requests_and_spares_the_other_engine(dep):
    _kill_rank_holding_requests(dep, rank=1, restarts=1)


@pytest.mark.timeout(180)
def test_a_dead_rank_0_ends_its_follower_fails_its_requests_and_spares_the_other_engine(dep):
    _kill_rank_holding_requests(dep, rank=0, restarts=2)
