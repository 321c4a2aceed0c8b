"""E2E: `glmrt up TOPOLOGY.toml`. Bad files are refused fast (status 2, a message naming the
offending key) before any actor starts; a file with [[actors]] entries and an [engine] table
starts and serves, with command-line flags overriding the file."""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
import time

import openai
import pytest

from tests.e2e.conftest import REPO, Deployment, free_port, glmrt_cmd, http

QUICK_S = 6.0  # a refused file answers in about a second (no actor is started)

GOOD_ACTORS = """
[[actors]]
kind = "tokenizer"
replicas = 2

[[actors]]
kind = "engine"

[[actors]]
kind = "detokenizer"
"""


def _up(tmp_path, toml: str, *extra: str, env=None, timeout: float = 60, ready_timeout: float = 8
        ) -> tuple[subprocess.CompletedProcess, float]:
    """Run `glmrt up FILE` to its end (in its own process group, killed afterwards).

    A short --ready-timeout: a refused topology exits at once, and one that slips through
    validation then ends after a few seconds instead of the default ten minutes."""
    path = tmp_path / "topology.toml"
    path.write_text(textwrap.dedent(toml))
    cmd = glmrt_cmd() + ["up", str(path), "--port", str(free_port()), "--ready-timeout", str(ready_timeout),
                         *extra]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=str(REPO), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"`glmrt up` with a bad topology was still running after {timeout} s:\n{out}\n{err}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # actors it may have started
        except (ProcessLookupError, PermissionError):
            pass
    took = time.monotonic() - t0
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), took


BAD = {
    "unknown-top-level-key": ("[modle]\npath = 'x'\n" + GOOD_ACTORS, ["modle"]),
    "unknown-model-key": ("[model]\npaht = 'x'\n" + GOOD_ACTORS, ["paht"]),
    "unknown-engine-flag": ("[engine]\npage_sise = 32\n" + GOOD_ACTORS, ["page_sise"]),
    "unknown-api-key": ("[api]\nprot = 1\n" + GOOD_ACTORS, ["prot"]),
    "unknown-actor-key": ("""
        [[actors]]
        kind = "tokenizer"
        replicaz = 2
        [[actors]]
        kind = "engine"
        [[actors]]
        kind = "detokenizer"
        """, ["replicaz"]),
    "unknown-actor-engine-flag": ("""
        [[actors]]
        kind = "tokenizer"
        [[actors]]
        kind = "engine"
        engine = { chunky = 1 }
        [[actors]]
        kind = "detokenizer"
        """, ["chunky"]),
    "unknown-kind": ("""
        [[actors]]
        kind = "tokenizer"
        [[actors]]
        kind = "sorcerer"
        [[actors]]
        kind = "engine"
        [[actors]]
        kind = "detokenizer"
        """, ["sorcerer"]),
    "prefill-without-decode": ("""
        [[actors]]
        kind = "tokenizer"
        [[actors]]
        kind = "prefill"
        [[actors]]
        kind = "detokenizer"
        """, ["decode"]),
    "engine-and-prefill": ("""
        [[actors]]
        kind = "tokenizer"
        [[actors]]
        kind = "engine"
        [[actors]]
        kind = "prefill"
        [[actors]]
        kind = "decode"
        [[actors]]
        kind = "detokenizer"
        """, ["prefill"]),
    "ep-3": ("""
        [[actors]]
        kind = "tokenizer"
        [[actors]]
        kind = "engine"
        tp = 2
        ep = 3
        [[actors]]
        kind = "detokenizer"
        """, ["ep = 3", "tp (2)"]),
    "tp-3-heads": ("""
        [[actors]]
        kind = "tokenizer"
        [[actors]]
        kind = "engine"
        tp = 3
        [[actors]]
        kind = "detokenizer"
        """, ["tp (--tp-size) = 3", "num_attention_heads (4)"]),
    "no-engine": ("""
        [[actors]]
        kind = "tokenizer"
        [[actors]]
        kind = "detokenizer"
        """, ["engine"]),
    "no-tokenizer": ("""
        [[actors]]
        kind = "engine"
        [[actors]]
        kind = "detokenizer"
        """, ["tokenizer"]),
    "duplicate-kind": (GOOD_ACTORS + "\n[[actors]]\nkind = \"engine\"\n", ["engine"]),
    "zero-tokenizers": (GOOD_ACTORS.replace("replicas = 2", "replicas = 0"), ["tokenizer", "replicas"]),
    "tokenizer-gpus": (GOOD_ACTORS.replace("replicas = 2", "replicas = 2\ngpus = [0]"), ["tokenizer", "gpus"]),
    "bad-engine-value": ("[engine]\npage_size = 0\n" + GOOD_ACTORS, ["page_size"]),
    "bad-engine-type": ("[engine]\npage_size = \"big\"\n" + GOOD_ACTORS, []),
    "actor-engine-bad-value": ("""
        [[actors]]
        kind = "tokenizer"
        [[actors]]
        kind = "engine"
        engine = { page_size = 0 }
        [[actors]]
        kind = "detokenizer"
        """, ["page_size"]),
    "not-toml": ("[[actors]\nkind = ", []),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(BAD))
def test_bad_topology_exits_2_naming_the_key(tmp_path, e2e_env, tiny_checkpoint, case):
    toml, names = BAD[case]
    r, took = _up(tmp_path, toml, "--model", tiny_checkpoint, env=e2e_env)
    out = r.stdout + r.stderr
    assert r.returncode == 2, f"{case}: status {r.returncode} after {took:.1f} s\n{out[-3000:]}"
    assert took < QUICK_S, f"{case}: took {took:.1f} s"
    assert "error:" in r.stderr, out
    assert "Traceback" not in out, out
    for name in names:
        assert name in r.stderr, f"{case}: the message does not name {name!r}: {r.stderr}"
    assert "ready" not in r.stdout, f"{case}: actors were started: {r.stdout}"


@pytest.mark.timeout(60)
def test_missing_topology_file(tmp_path, e2e_env):
    cmd = glmrt_cmd() + ["up", str(tmp_path / "nope.toml"), "--port", str(free_port())]
    r = subprocess.run(cmd, cwd=str(REPO), env=e2e_env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "nope.toml" in r.stderr, r.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flags", [["--tokenizer-replicas", "-1"], ["--engine-replicas", "-1"],
                                   ["--page-size", "0"], ["--cache-memory-gb", "0"]],
                         ids=["tokenizers-1", "engines-1", "page-size-0", "cache-0"])
def test_bad_flags_exit_2(tmp_path, e2e_env, tiny_checkpoint, flags):
    r, took = _up(tmp_path, GOOD_ACTORS, "--model", tiny_checkpoint, *flags, env=e2e_env)
    assert r.returncode == 2, f"{flags}: status {r.returncode} after {took:.1f} s\n{(r.stdout + r.stderr)[-3000:]}"
    assert took < QUICK_S
    assert "error:" in r.stderr and "Traceback" not in r.stderr, r.stderr


# ---- a file that serves ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def topo_dep(tmp_path_factory, e2e_env, tiny_checkpoint):
    d = tmp_path_factory.mktemp("topology")
    toml = d / "serve.toml"
    toml.write_text(textwrap.dedent(f"""
        [model]
        path = "{tiny_checkpoint}"
        served_model_name = "glm-topo"

        [engine]
        context_length = 512
        max_running_requests = 8
        cache_memory_gb = 0.0625

        [api]
        host = "127.0.0.1"
        port = 1

        [[actors]]
        kind = "tokenizer"
        replicas = 2

        [[actors]]
        kind = "unified"
        engine = {{ page_size = 32 }}

        [[actors]]
        kind = "detokenizer"
    """))
    # --port (added by Deployment) overrides [api] port; --max-running-requests overrides [engine]
    dep = Deployment([str(toml), "--max-running-requests", "6"], log_path=d / "serve.log", env=e2e_env)
    dep.start()
    try:
        dep.wait_healthy()
        yield dep
    finally:
        dep.stop(term_wait=5)


@pytest.mark.timeout(150)
def test_topology_file_starts_and_serves(topo_dep):
    dep = topo_dep
    kinds = [a["kind"] for a in dep.actors()]
    assert sorted(kinds) == ["detokenizer", "engine", "tokenizer", "tokenizer"], kinds
    assert all(a["state"] == "ready" for a in dep.actors())
    models = dep.get_json("/v1/models")
    assert [m["id"] for m in models["data"]] == ["glm-topo"]
    info = dep.get_json("/server_info")
    assert info["context_length"] == 512
    (eng,) = info["engines"].values()
    assert eng["page_size"] == 32                      # the [[actors]] entry's engine table
    assert eng["max_running_requests"] == 6            # the flag beats [engine]
    assert eng["budget_bytes"] == int(0.0625 * 2**30)  # [engine]
    client = dep.client()
    for i in range(4):  # round robin over both tokenizers
        r = client.chat.completions.create(model="glm-topo", messages=[{"role": "user", "content": f"topo {i}"}],
                                           max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 4
    with pytest.raises(openai.BadRequestError):  # beyond the file's 512-token context
        client.completions.create(model="glm-topo", prompt=list(range(1, 600)), max_tokens=2)
    status, _, _ = http("GET", dep.url + "/health")
    assert status == 200
