"""E2E: `glmrt up --log-level warning` on a default-topology deployment (one actor each): no
process prints an info line (no boot, ready, request or engine stats line) while it serves, and
a warning still comes through: a killed actor's."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from tests.e2e.conftest import http

pytestmark = pytest.mark.slow

LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR|CRITICAL) (\S+): ")


@pytest.fixture(scope="module")
def dep(start_deployment):
    d = start_deployment(["--log-level", "warning", "--log-interval", "0.5"], name="log-warning")
    yield d
    d.stop(term_wait=5)


def _levels(dep) -> list[str]:
    return [m.group(1) for m in map(LINE.match, dep.output().splitlines()) if m]


@pytest.mark.timeout(60)
def test_warning_level_hides_info_lines_while_serving(dep):
    client = dep.client()
    r = client.completions.create(model=dep.model_id(), prompt="quiet please", max_tokens=40, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 40
    time.sleep(1.5)   # past the stats interval, had the engine printed one
    out = dep.output()
    assert "INFO" not in _levels(dep), out[-3000:]
    assert "request " not in out and "running " not in out and "KV pool" not in out, out[-3000:]


@pytest.mark.timeout(120)
def test_warning_level_still_prints_warnings(dep):
    (tok,) = dep.actors("tokenizer")
    os.kill(tok["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        (a,) = dep.actors("tokenizer")
        if a["state"] == "ready" and a["pid"] != tok["pid"] and http("GET", dep.url + "/health")[0] == 200:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"tokenizer did not come back: {dep.actors()}\n{dep.output()[-3000:]}")
    warned = [line for line in dep.output().splitlines()
              if LINE.match(line) and f"WARNING supervisor/0: tokenizer/0 (pid {tok['pid']}) exited" in line]
    assert len(warned) == 1, dep.output()[-3000:]
    assert "INFO" not in _levels(dep), dep.output()[-3000:]   # not its "ready" line either
