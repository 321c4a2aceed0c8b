"""E2E: actor processes killed with SIGKILL under a default-topology deployment. Requests in
flight fail fast (an error, not a hang), the supervisor restarts the actor, /health comes back
and new requests succeed."""

from __future__ import annotations

import os
import signal
import threading
import time

import openai
import pytest

from tests.e2e.conftest import http, metric_sum

pytestmark = pytest.mark.slow

FAIL_FAST_S = 5.0
LONG = 3000  # decode steps: minutes on this machine, so only a failure ends these requests


@pytest.fixture(scope="module")
def dep(start_deployment):
    d = start_deployment([], name="actor-failure")
    yield d
    d.stop(term_wait=5)


def _pid(dep, kind: str) -> int:
    (a,) = dep.actors(kind)
    assert a["state"] == "ready", a
    return a["pid"]


def _wait_healthy_again(dep, old_pid: int, kind: str, timeout: float = 90.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert dep.alive(), dep.output()[-5000:]
        if http("GET", dep.url + "/health", timeout=5)[0] == 200:
            (a,) = dep.actors(kind)
            if a["state"] == "ready" and a["pid"] != old_pid:
                return a
        time.sleep(0.2)
    pytest.fail(f"/health did not come back after killing {kind} (pid {old_pid}): {dep.actors()}\n"
                f"{dep.output()[-5000:]}")


class Inflight:
    """Long requests in threads: streamed ones wait for their first chunks before `started`."""

    def __init__(self, dep, streams: int = 3, plain: int = 1):
        self.client = dep.client(timeout=120)
        self.results: dict[str, tuple[str, float, str]] = {}
        self.started = threading.Barrier(streams + 1)
        self.threads = [threading.Thread(target=self._stream, args=(f"stream{i}",), daemon=True)
                        for i in range(streams)]
        self.threads += [threading.Thread(target=self._plain, args=(f"plain{i}",), daemon=True) for i in range(plain)]

    def _stream(self, name: str) -> None:
        seen = 0
        try:
            s = self.client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"{name}: talk for a long time"}],
                max_tokens=LONG, temperature=0, stream=True, extra_body={"ignore_eos": True})
            for _ in s:
                seen += 1
                if seen == 3:
                    self.started.wait(60)
            self.results[name] = ("finished", time.monotonic(), f"{seen} chunks")
        except Exception as e:  # noqa: BLE001
            self.results[name] = ("error", time.monotonic(), f"{type(e).__name__}: {e}")
            if seen < 3:
                self.started.abort()

    def _plain(self, name: str) -> None:
        try:
            self.client.completions.create(model="tiny", prompt=f"{name}: a long completion", max_tokens=LONG,
                                           temperature=0, extra_body={"ignore_eos": True})
            self.results[name] = ("finished", time.monotonic(), "")
        except openai.APIStatusError as e:
            self.results[name] = ("error", time.monotonic(), f"{e.status_code} {e.message}")
        except Exception as e:  # noqa: BLE001
            self.results[name] = ("error", time.monotonic(), f"{type(e).__name__}: {e}")

    def start(self) -> None:
        for t in self.threads:
            t.start()
        self.started.wait(60)
        time.sleep(0.3)  # the plain request is decoding too by now

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        self.client.close()


def _kill_and_check_inflight(dep, kind: str, streams: int, plain: int) -> tuple[int, dict]:
    load = Inflight(dep, streams=streams, plain=plain)
    try:
        load.start()
        assert not load.results, f"requests ended before the kill: {load.results}"
        pid = _pid(dep, kind)
        t_kill = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        load.join(FAIL_FAST_S + 5)
        hung = [t.name for t in load.threads if t.is_alive()]
        assert not hung, f"requests still hanging {FAIL_FAST_S + 5:.0f} s after killing {kind}: {load.results}"
        for name, (outcome, t_end, detail) in load.results.items():
            assert outcome == "error", (name, outcome, detail)
            assert t_end - t_kill < FAIL_FAST_S, f"{name} failed only after {t_end - t_kill:.1f} s: {detail}"
            if name.startswith("plain"):
                assert detail.startswith("503"), detail
            else:
                assert f"{kind}/0" in detail or "failed" in detail, detail
        return pid, load.results
    finally:
        load.close()


_COUNTS: dict[str, float] = {}


def _requests_total(dep) -> dict[str, float]:
    m = dep.metrics()
    return {s: metric_sum(m, "glmrt_requests_total", status=s) for s in ("success", "error")}


def _wait_engine_idle(dep, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while True:
        (eng,) = dep.actors("engine")
        if eng["state"] == "ready" and eng["running"] == 0 and eng["waiting"] == 0:
            return
        assert time.monotonic() < deadline, f"the engine still runs the failed requests: {eng}"
        time.sleep(0.3)


@pytest.mark.timeout(150)
def test_engine_kill_fails_inflight_fast_and_recovers(dep):
    _COUNTS["before"] = _requests_total(dep)
    old_pid, _ = _kill_and_check_inflight(dep, "engine", streams=3, plain=1)
    _COUNTS["after"] = _requests_total(dep)
    # while the engine restarts: a quick 503 (never a hang); afterwards healthy again
    status, headers, raw = dep.post("/v1/completions", {"prompt": "during restart", "max_tokens": 2},
                                    timeout=30)
    assert status in (200, 503), raw[:300]
    if status == 503:
        assert b"error" in raw and headers.get("Retry-After"), (headers, raw)
    a = _wait_healthy_again(dep, old_pid, "engine")
    assert a["pid"] != old_pid
    client = dep.client()
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "after restart"}],
                                       max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5
    s = client.completions.create(model="tiny", prompt="streamed after restart", max_tokens=4, stream=True,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert sum(1 for c in s if c.choices and c.choices[0].finish_reason == "length") == 1
    restarts = dep.get_json("/admin/status")["actors"]
    assert next(x for x in restarts if x["kind"] == "engine")["restarts"] == 1


@pytest.mark.timeout(30)
def test_failed_requests_are_counted_as_errors(dep):
    """The 4 requests the engine kill failed (3 streamed, 1 not) show in glmrt_requests_total
    with status="error"; none of them as a success."""
    before, after = _COUNTS["before"], _COUNTS["after"]
    assert after["success"] == before["success"], (before, after)
    assert after["error"] - before["error"] == 4, (before, after)


@pytest.mark.timeout(120)
def test_tokenizer_kill_recovers(dep):
    old_pid, _ = _kill_and_check_inflight(dep, "tokenizer", streams=2, plain=0)
    _wait_healthy_again(dep, old_pid, "tokenizer")
    _wait_engine_idle(dep)  # the failed requests were aborted in the engine too
    client = dep.client()
    for i in range(3):
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"tok {i}"}],
                                           max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 4 and r.usage.prompt_tokens > 0


@pytest.mark.timeout(120)
def test_detokenizer_kill_recovers(dep):
    old_pid, _ = _kill_and_check_inflight(dep, "detokenizer", streams=2, plain=1)
    _wait_healthy_again(dep, old_pid, "detokenizer")
    client = dep.client()
    r = client.completions.create(model="tiny", prompt="detok back", max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 4
    _wait_engine_idle(dep)  # the engine carried on: its long requests were aborted, not left running
