"""E2E: API keys, `glmrt status|scale|down` on a deployment started with
`--api-key secret --tokenizer-replicas 2`; scaling under concurrent load loses no request."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import openai
import pytest

from tests.e2e.conftest import http, process_alive

pytestmark = pytest.mark.slow

KEY = "secret"
USER = [{"role": "user", "content": "Hello from the admin tests."}]


@pytest.fixture(scope="module")
def dep(start_deployment):
    d = start_deployment(["--tokenizer-replicas", "2"], api_key=KEY, name="api-key-admin")
    yield d
    d.stop(term_wait=5)


def _counts(dep) -> dict[str, int]:
    out: dict[str, int] = {}
    for a in dep.actors():
        out[a["kind"]] = out.get(a["kind"], 0) + 1
    return out


def _wait_for(dep, want: dict[str, int], timeout: float = 60.0) -> list[dict]:
    """Until /admin/status lists exactly `want` replicas per kind, all ready."""
    deadline = time.monotonic() + timeout
    while True:
        actors = dep.actors()
        counts: dict[str, int] = {}
        for a in actors:
            counts[a["kind"]] = counts.get(a["kind"], 0) + 1
        if all(counts.get(k) == n for k, n in want.items()) and all(a["state"] == "ready" for a in actors):
            return actors
        if time.monotonic() > deadline:
            pytest.fail(f"status did not reach {want} within {timeout} s: {actors}\n{dep.output()[-5000:]}")
        time.sleep(0.25)


# ---- keys ------------------------------------------------------------------------------------

PROTECTED = [("GET", "/v1/models", None), ("POST", "/v1/chat/completions", {"messages": USER, "max_tokens": 2}),
             ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2}), ("GET", "/admin/status", None),
             ("POST", "/admin/scale", {"kind": "engine", "replicas": 3}), ("POST", "/admin/shutdown", {}),
             ("GET", "/server_info", None), ("GET", "/metrics", None)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "secret"},
                                     {"x-api-key": "nope"}], ids=["none", "wrong", "no-bearer", "wrong-x-api-key"])
def test_missing_or_wrong_key_is_401_json(dep, headers):
    for method, route, body in PROTECTED:
        status, h, raw = http(method, dep.url + route, body, headers=headers)
        assert status == 401, (route, status, raw[:200])
        assert h.get("Content-Type", "").startswith("application/json"), (route, h)
        err = json.loads(raw)["error"]
        assert err["code"] == "invalid_api_key" and err["message"], (route, err)
    # nothing above scaled or stopped anything
    assert dep.alive()
    assert http("GET", dep.url + "/health")[0] == 200
    assert len(dep.actors("engine")) == 1


@pytest.mark.timeout(30)
def test_health_is_open(dep):
    status, _, raw = http("GET", dep.url + "/health")
    assert status == 200, raw
    status, _, _ = http("GET", dep.url + "/health", headers={"Authorization": "Bearer wrong"})
    assert status == 200


@pytest.mark.timeout(60)
def test_openai_client_with_and_without_key(dep):
    good = dep.client()
    r = good.chat.completions.create(model="tiny", messages=USER, max_tokens=3, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3
    bad = openai.OpenAI(base_url=dep.url + "/v1", api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as ei:
        bad.models.list()
    assert ei.value.status_code == 401
    # x-api-key is accepted too
    status, _, _ = http("GET", dep.url + "/v1/models", headers={"x-api-key": KEY})
    assert status == 200


# ---- status ----------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_status_json(dep):
    deadline = time.monotonic() + 20
    while True:  # the earlier tests' requests (a client that went away mid-stream) may still be ending
        r = dep.cli("status", "--json")
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        busy = [a for a in out["actors"] if a["kind"] == "engine" and (a["running"] or a["waiting"])]
        if not busy or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert set(out) == {"actors"}
    actors = out["actors"]
    for a in actors:
        engine_fields = {"running", "waiting", "tp", "ep", "ranks"} if a["kind"] == "engine" else set()
        assert set(a) == {"kind", "replica", "pid", "host", "gpus", "state", "load"} | engine_fields, a
        if a["kind"] == "engine":   # an idle engine of one rank: nothing decoding, nothing queued
            assert (a["running"], a["waiting"], a["tp"], a["ep"]) == (0, 0, 1, 1), a
            assert a["ranks"] == [{"rank": 0, "pid": a["pid"], "device": "cpu"}], a
        assert isinstance(a["pid"], int) and a["pid"] > 0
        assert isinstance(a["host"], str) and a["host"]
        assert a["gpus"] == []
        assert a["state"] == "ready"
        assert isinstance(a["load"], (int, float))
    toks = sorted(a["replica"] for a in actors if a["kind"] == "tokenizer")
    assert toks == [0, 1]
    assert [a["kind"] for a in actors].count("engine") == 1
    assert [a["kind"] for a in actors].count("detokenizer") == 1
    assert len({a["pid"] for a in actors}) == len(actors)
    table = dep.cli("status")
    assert table.returncode == 0 and "tokenizer" in table.stdout and "engine" in table.stdout


@pytest.mark.timeout(60)
def test_status_cli_without_key_fails_cleanly(dep):
    import subprocess

    from tests.e2e.conftest import REPO, glmrt_cmd
    r = subprocess.run(glmrt_cmd() + ["status", "--json", "--url", dep.url], cwd=str(REPO), env=dep.env,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode != 0
    assert "401" in r.stderr


# ---- scaling under load ----------------------------------------------------------------------


class Load:
    """`workers` concurrent AsyncOpenAI chat requests, again and again, in a background thread."""

    def __init__(self, dep, workers: int = 12):
        self.dep = dep
        self.workers = workers
        self.ok = 0
        self.failures: list[str] = []
        self.per_worker = [0] * workers
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _worker(self, client, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            try:
                stream = (i + n) % 3 == 0
                kw = dict(model="tiny", messages=[{"role": "user", "content": f"worker {i} request {n}"}],
                          max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
                if stream:
                    s = await client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                             **kw)
                    usage = None
                    async for c in s:
                        if c.usage is not None:
                            usage = c.usage
                    assert usage is not None and usage.completion_tokens == 6, usage
                else:
                    r = await client.chat.completions.create(**kw)
                    assert r.usage.completion_tokens == 6, r.usage
                self.ok += 1
                self.per_worker[i] += 1
            except Exception as e:  # noqa: BLE001 - every failure counts
                self.failures.append(f"worker {i} request {n}: {type(e).__name__}: {e}")

    async def _main(self) -> None:
        client = self.dep.async_client(timeout=60)
        try:
            await asyncio.gather(*(self._worker(client, i) for i in range(self.workers)))
        finally:
            await client.close()

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(90)

    def wait_for(self, n: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        start = self.ok
        while self.ok - start < n:
            assert time.monotonic() < deadline, f"load stalled: {self.ok} ok, failures {self.failures[:3]}"
            assert not self.failures, self.failures[:5]
            time.sleep(0.1)


@pytest.mark.timeout(180)
def test_scale_under_load_loses_nothing(dep):
    _wait_for(dep, {"tokenizer": 2, "engine": 1, "detokenizer": 1})
    with Load(dep, workers=12) as load:
        load.wait_for(12)

        r = dep.cli("scale", "tokenizer=1")
        assert r.returncode == 0, r.stderr
        assert "tokenizer" in r.stdout
        actors = _wait_for(dep, {"tokenizer": 1, "engine": 1, "detokenizer": 1})
        assert [a["replica"] for a in actors if a["kind"] == "tokenizer"] == [0]
        load.wait_for(12)

        r = dep.cli("scale", "engine=2")
        assert r.returncode == 0, r.stderr
        assert "engine/1" in r.stdout
        actors = _wait_for(dep, {"tokenizer": 1, "engine": 2, "detokenizer": 1}, timeout=90)
        new_engine = next(a for a in actors if a["kind"] == "engine" and a["replica"] == 1)
        # the new replica takes work (the api routes to the least-loaded engine)
        deadline = time.monotonic() + 30
        took_work = False
        while time.monotonic() < deadline and not took_work:
            a = next((x for x in dep.actors("engine") if x["replica"] == 1), None)
            took_work = a is not None and (a["running"] > 0 or a["load"] > 0)
            time.sleep(0.1)
        assert took_work, f"engine/1 (pid {new_engine['pid']}) never ran a request"
        load.wait_for(12)

        r = dep.cli("scale", "engine=1")
        assert r.returncode == 0, r.stderr
        assert "engine/1" in r.stdout
        _wait_for(dep, {"tokenizer": 1, "engine": 1, "detokenizer": 1}, timeout=60)
        load.wait_for(12)
    assert not load.failures, f"{len(load.failures)} failed requests (ok {load.ok}): {load.failures[:5]}"
    assert load.ok >= 48
    assert all(n > 0 for n in load.per_worker), load.per_worker
    # the retired processes are gone
    time.sleep(0.5)
    assert {a["kind"]: a["replica"] for a in dep.actors() if a["kind"] != "detokenizer"} == {"tokenizer": 0,
                                                                                            "engine": 0}


@pytest.mark.timeout(30)
def test_scale_rejects_bad_requests(dep):
    r = dep.cli("scale", "engine=0")
    assert r.returncode != 0 and "at least 1" in r.stderr
    r = dep.cli("scale", "vision=2")
    assert r.returncode != 0 and "cannot scale" in r.stderr
    r = dep.cli("scale", "engine")
    assert r.returncode == 2
    status, _, raw = dep.post("/admin/scale", {"kind": "engine"})
    assert status == 400 and json.loads(raw)["error"]["message"]
    for body in ({"kind": [], "replicas": 2}, {"kind": "engine", "replicas": True},
                 {"kind": "engine", "replicas": "2"}, {"kind": "engine", "replicas": 2.5}):
        status, _, raw = dep.post("/admin/scale", body)
        assert status == 400 and "a string and an integer" in json.loads(raw)["error"]["message"], (body, raw)
    status, _, raw = dep.post("/admin/scale", {"kind": "tokenizer", "replicas": 100_000})
    assert status == 400 and "at most 64 replicas" in json.loads(raw)["error"]["message"], raw


# ---- down (last: it stops the deployment) ----------------------------------------------------


@pytest.mark.timeout(60)
def test_down_stops_the_deployment(dep):
    pids = [a["pid"] for a in dep.actors()]
    r = dep.cli("down")
    assert r.returncode == 0, r.stderr
    try:
        rc = dep.proc.wait(30)
    except Exception:
        pytest.fail(f"glmrt up still running 30 s after `glmrt down`\n{dep.output()[-5000:]}")
    assert rc == 0, dep.output()[-5000:]
    import os
    deadline = time.monotonic() + 10
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in pids if os.path.exists(f"/proc/{p}") and process_alive(p)]
        time.sleep(0.1)
    assert not alive, f"actor processes left after down: {alive}"
