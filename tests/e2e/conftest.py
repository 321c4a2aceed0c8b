"""End-to-end fixtures: the real `glmrt up` (supervisor + api + actor processes) on a free
port of 127.0.0.1, driven through the official `openai` client and plain HTTP.

- `tiny_checkpoint` (session): `glmrt make-checkpoint --preset tiny` once, into a tmp dir.
- `Deployment`: one `glmrt up` subprocess in its own session (process group); `stop()`
  sends SIGTERM to `glmrt up`, waits a little, then SIGKILLs the whole group so no actor
  process outlives the test module. Its output goes to a log file, dumped on failures.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 120.0


def glmrt_cmd() -> list[str]:
    """The `glmrt` console script of this venv (falls back to `python -m cli.main`)."""
    exe = Path(sys.executable).parent / "glmrt"
    if exe.exists():
        return [str(exe)]
    found = shutil.which("glmrt")
    return [found] if found else [sys.executable, "-m", "cli.main"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("GLMRT_API_KEY", "GLMRT_URL")}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def http(method: str, url: str, body: bytes | dict | None = None, headers: dict | None = None,
         timeout: float = 30.0) -> tuple[int, dict, bytes]:
    """(status, headers, raw body) of one plain HTTP call; HTTP errors are returned, not raised."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    h = {"Content-Type": "application/json"} if data is not None else {}
    h.update(headers or {})
    req = urllib.request.Request(url, data=data, method=method, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def parse_metrics(text: str) -> dict[tuple[str, tuple], float]:
    """Prometheus text -> {(sample name, sorted label items): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric_sum(metrics: dict, name: str, **labels) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    tot = 0.0
    for (n, lab), v in metrics.items():
        if n == name and all(dict(lab).get(k) == str(val) for k, val in labels.items()):
            tot += v
    return tot


def has_metric(metrics: dict, name: str, **labels) -> bool:
    return any(n == name and all(dict(lab).get(k) == str(v) for k, v in labels.items())
               for (n, lab) in metrics)


def process_alive(pid: int) -> bool:
    """`pid` exists and is not a zombie (an exited child its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def libs_mapped(pid: int, needle: str = "libtorch") -> bool:
    with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
        return needle in f.read()


class Deployment:
    """One `glmrt up` process group."""

    def __init__(self, args: list[str], *, log_path: Path, env: dict[str, str], api_key: str | None = None,
                 port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.args = args
        self.log_path = log_path
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.pgid: int | None = None
        self._log = None

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> "Deployment":
        cmd = glmrt_cmd() + ["up", *self.args, "--port", str(self.port)]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=str(REPO), env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.pgid = os.getpgid(self.proc.pid)
        return self

    def output(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def fail(self, why: str) -> None:
        pytest.fail(f"{why}\n---- glmrt up output ({self.log_path}) ----\n{self.output()[-20000:]}", pytrace=False)

    def wait_healthy(self, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.fail(f"glmrt up exited with status {self.proc.returncode} before becoming healthy")
            try:
                status, _, _ = http("GET", self.url + "/health", timeout=2)
                last = status
                if status == 200:
                    return
            except OSError as e:
                last = repr(e)
            time.sleep(0.25)
        self.fail(f"/health was not 200 within {timeout:.0f} s (last: {last})")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, term_wait: float = 10.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(term_wait)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self.pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        if self._log:
            self._log.close()

    # ---- helpers -------------------------------------------------------------------------
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def get(self, route: str, headers: dict | None = None, timeout: float = 30.0):
        return http("GET", self.url + route, headers={**self.auth(), **(headers or {})}, timeout=timeout)

    def post(self, route: str, body=None, headers: dict | None = None, timeout: float = 60.0):
        return http("POST", self.url + route, body, headers={**self.auth(), **(headers or {})}, timeout=timeout)

    def get_json(self, route: str) -> dict:
        status, _, raw = self.get(route)
        assert status == 200, (route, status, raw[:500])
        return json.loads(raw)

    def metrics(self) -> dict:
        status, _, raw = self.get("/metrics")
        assert status == 200, raw[:500]
        return parse_metrics(raw.decode())

    def actors(self, kind: str | None = None) -> list[dict]:
        acts = self.get_json("/admin/status")["actors"]
        return [a for a in acts if kind is None or a["kind"] == kind]

    def client(self, **kw):
        import openai
        kw.setdefault("timeout", 60.0)
        kw.setdefault("max_retries", 0)
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "unused", **kw)

    def async_client(self, **kw):
        import openai
        kw.setdefault("timeout", 60.0)
        kw.setdefault("max_retries", 0)
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=self.api_key or "unused", **kw)

    def cli(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
        """`glmrt <args> --url <this deployment>` (and its api key)."""
        cmd = glmrt_cmd() + list(args) + ["--url", self.url]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        return subprocess.run(cmd, cwd=str(REPO), env=self.env, capture_output=True, text=True, timeout=timeout)

    def model_id(self) -> str:
        return self.get_json("/v1/models")["data"][0]["id"]


@pytest.fixture(scope="session")
def e2e_tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("glmrt-e2e")


@pytest.fixture(scope="session")
def e2e_env(e2e_tmp) -> dict[str, str]:
    """The environment of every glmrt process here (glmrt/env.py's variables unset)."""
    return clean_env({})


@pytest.fixture(scope="session")
def tiny_checkpoint(e2e_tmp, e2e_env) -> str:
    out = e2e_tmp / "tiny"
    r = subprocess.run(glmrt_cmd() + ["make-checkpoint", "--preset", "tiny", "--out", str(out), "--dtype", "float32"],
                       cwd=str(REPO), env=e2e_env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, f"make-checkpoint failed:\n{r.stdout}\n{r.stderr}"
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
    return str(out)


@pytest.fixture(scope="session")
def start_deployment(e2e_tmp, e2e_env, tiny_checkpoint):
    """A factory: start_deployment(args, api_key=None) -> a healthy Deployment (stopped at
    session end at the latest; module fixtures stop theirs in their own teardown)."""
    started: list[Deployment] = []

    def start(args: list[str] | None = None, *, api_key: str | None = None, with_model: bool = True,
              name: str = "deploy") -> Deployment:
        args = list(args or [])
        if with_model and "--model" not in args:
            args += ["--model", tiny_checkpoint]
        log = e2e_tmp / f"{name}-{len(started)}.log"
        d = Deployment(args, log_path=log, env=e2e_env, api_key=api_key)
        started.append(d)
        d.start()
        try:
            d.wait_healthy()
        except BaseException:
            d.stop(term_wait=1)
            raise
        return d

    yield start
    for d in started:
        d.stop(term_wait=1)
