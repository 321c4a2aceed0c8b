"""`glmrt bench serving` against a real `glmrt up` on the tiny checkpoint (page size 16).

The benchmark runs as a subprocess, as a user runs it; its JSON is checked for consistency:
every request completed, tokens counted = tokens served (usage = streamed token ids =
requests x output_len; prompt tokens = requests x input_len on the token-id endpoint),
percentiles ordered, TTFT <= e2e, TPOT = (e2e - TTFT) / (output - 1), throughputs > 0; the
shared-prefix and multi-turn workloads report cached tokens; a concurrency sweep writes a PNG
and one run per concurrency value.
"""

from __future__ import annotations

import json
import math
import subprocess

import pytest

from tests.e2e.conftest import REPO, Deployment, glmrt_cmd

pytestmark = pytest.mark.slow

LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


@pytest.fixture(scope="module")
def server(e2e_tmp, e2e_env, tiny_checkpoint):
    """One `glmrt up` for the module, in its own process group (SIGTERM, then SIGKILL, at teardown)."""
    d = Deployment(["--model", tiny_checkpoint, "--page-size", "16"], log_path=e2e_tmp / "bench-serving-up.log",
                   env=e2e_env)
    d.start()
    try:
        d.wait_healthy(timeout=120)
    except BaseException:
        d.stop(term_wait=1)
        raise
    yield d
    d.stop(term_wait=5)


def bench(server: Deployment, tmp_path, *args: str, timeout: float = 100) -> tuple[dict, str]:
    out = tmp_path / "results.json"
    cmd = glmrt_cmd() + ["bench", "serving", "--url", server.url, "--out", str(out), "--seed", "7", *args]
    r = subprocess.run(cmd, cwd=str(REPO), env=server.env, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        server.fail(f"glmrt bench serving exited with {r.returncode}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}")
    return json.loads(out.read_text()), r.stdout


def check_run(run: dict, *, requests: int, output_len: int, input_len: int | None = None) -> None:
    s, reqs = run["summary"], run["requests"]
    assert s["errors"] == 0, s["error_messages"]
    assert s["completed"] == requests == len(reqs)
    assert all(r["ok"] and r["error"] is None for r in reqs)
    # tokens counted = tokens served: usage, the streamed token ids and the workload agree
    assert s["total_output_tokens"] == sum(r["output_tokens"] for r in reqs) == requests * output_len
    for r in reqs:
        assert r["usage_reported"]
        assert r["output_tokens"] == r["streamed_token_ids"] == output_len, r
        assert r["finish_reason"] == "length"
        assert 0 <= r["cached_tokens"] <= r["prompt_tokens"]
        assert 0 < r["ttft"] <= r["e2e"]
        assert len(r["itls"]) <= r["output_tokens"] - 1
        assert r["ttft"] + sum(r["itls"]) <= r["e2e"] + 1e-6
        assert r["tpot"] == pytest.approx((r["e2e"] - r["ttft"]) / (r["output_tokens"] - 1))
    if input_len is not None:
        assert s["total_input_tokens"] == sum(r["prompt_tokens"] for r in reqs) == requests * input_len
    assert s["total_cached_tokens"] == sum(r["cached_tokens"] for r in reqs)
    # percentiles ordered, and the stats cover every request (ITL: every gap)
    for key in LATENCIES:
        st = s[key]
        assert st["min"] <= st["p50"] <= st["p90"] <= st["p99"] <= st["max"], (key, st)
        assert st["min"] <= st["mean"] <= st["max"], (key, st)
    assert s["ttft_ms"]["count"] == s["e2e_ms"]["count"] == requests
    assert s["itl_ms"]["count"] == sum(len(r["itls"]) for r in reqs)
    assert s["ttft_ms"]["max"] <= s["e2e_ms"]["max"]
    # throughputs
    assert s["duration_s"] > 0 and s["request_throughput"] > 0 and s["output_throughput"] > 0
    assert s["output_throughput"] * s["duration_s"] == pytest.approx(s["total_output_tokens"])
    assert s["request_throughput"] * s["duration_s"] == pytest.approx(requests)
    assert s["total_token_throughput"] > s["output_throughput"]
    assert 0 <= s["good_requests"] <= requests
    assert s["slo"] == {"ttft_ms": 6000.0, "tpot_ms": 25.0}
    # no request starts before the run or ends after it
    assert all(0 <= r["start"] and r["start"] + r["e2e"] <= s["duration_s"] + 1e-6 for r in reqs)


@pytest.mark.timeout(120)
def test_random(server, tmp_path):
    doc, stdout = bench(server, tmp_path, "--dataset", "random", "--num-prompts", "8", "--input-len", "40",
                        "--output-len", "8", "--max-concurrency", "4")
    assert len(doc["runs"]) == 1
    run = doc["runs"][0]
    check_run(run, requests=8, output_len=8, input_len=40)
    assert run["summary"]["max_concurrency"] == 4
    assert 1 <= run["summary"]["peak_inflight"] <= 4
    assert doc["config"]["endpoint"] == "completions" and doc["config"]["ignore_eos"] is True
    assert doc["server"]["model"] == server.model_id()
    # the summary table is printed last
    lines = stdout.strip().splitlines()
    assert lines[-1].startswith("goodput") and any(line.startswith("TTFT ms") for line in lines)


@pytest.mark.timeout(120)
def test_shared_prefix_reports_cached_tokens(server, tmp_path):
    doc, _ = bench(server, tmp_path, "--dataset", "shared-prefix", "--shared-prefix-ratio", "0.9375",
                   "--num-prompts", "8", "--input-len", "64", "--output-len", "4", "--max-concurrency", "4")
    run = doc["runs"][0]
    check_run(run, requests=8, output_len=4, input_len=64)
    s = run["summary"]
    assert s["total_cached_tokens"] > 0 and 0 < s["cached_token_ratio"] <= 0.9375
    # only the 60-token shared prefix can hit: every prompt's last 4 tokens are its own
    assert all(r["cached_tokens"] <= 60 for r in run["requests"])


@pytest.mark.timeout(120)
def test_multi_turn_later_turns_hit_the_cache(server, tmp_path):
    doc, _ = bench(server, tmp_path, "--dataset", "multi-turn", "--endpoint", "chat", "--num-prompts", "2",
                   "--num-turns", "3", "--input-len", "16", "--output-len", "6")
    run = doc["runs"][0]
    check_run(run, requests=6, output_len=6)
    reqs = run["requests"]
    assert sorted((r["conversation"], r["turn"]) for r in reqs) == [(c, t) for c in range(2) for t in range(3)]
    by = {(r["conversation"], r["turn"]): r for r in reqs}
    for c in range(2):
        for t in (1, 2):
            prev, cur = by[(c, t - 1)], by[(c, t)]
            assert cur["prompt_tokens"] > prev["prompt_tokens"]      # append-only: the prompt grows
            assert cur["cached_tokens"] > 0, cur                        # ... and its prefix is cached
            assert cur["cached_tokens"] <= prev["prompt_tokens"] + prev["output_tokens"]
            assert cur["start"] >= prev["start"] + prev["e2e"] - 1e-6   # turns go one after the other
    assert run["summary"]["cached_token_ratio"] > 0


@pytest.mark.timeout(120)
def test_chats_send_the_held_out_corpus_chats_and_stop_by_themselves(server, tmp_path, tiny_checkpoint):
    from tokenizers import Tokenizer

    from glmrt.serving.chat_template import render_chat
    from glmrt.train.corpus import held_out_chats

    doc, _ = bench(server, tmp_path, "--dataset", "chats", "--num-prompts", "6", "--output-len", "8",
                   "--max-concurrency", "3")
    assert doc["config"]["endpoint"] == "chat" and doc["config"]["ignore_eos"] is False
    run = doc["runs"][0]
    s, reqs = run["summary"], run["requests"]
    assert s["errors"] == 0 and s["completed"] == 6, s["error_messages"]
    for r in reqs:  # ignore_eos not sent: a request ends at a stop token or at the cap
        assert r["ok"] and 1 <= r["output_tokens"] == r["streamed_token_ids"] <= 8, r
        assert r["finish_reason"] in ("stop", "length", "tool_calls"), r
    # the prompts are the chats' requests (--seed 7), rendered by the chat template, thinking on
    tok = Tokenizer.from_file(f"{tiny_checkpoint}/tokenizer.json")
    want = [len(tok.encode(render_chat(c.messages[:-1], c.tools, thinking=True), add_special_tokens=False).ids)
            for c in held_out_chats(7, 6)]
    assert [r["prompt_tokens"] for r in sorted(reqs, key=lambda r: r["conversation"])] == want


@pytest.mark.timeout(150)
def test_concurrency_sweep_plots(server, tmp_path):
    png = tmp_path / "sweep.png"
    doc, stdout = bench(server, tmp_path, "--dataset", "random", "--num-prompts", "4", "--input-len", "24",
                        "--output-len", "4", "--max-concurrency", "1,2", "--plot", str(png))
    assert [r["summary"]["max_concurrency"] for r in doc["runs"]] == [1, 2]
    for run in doc["runs"]:
        check_run(run, requests=4, output_len=4, input_len=24)
    assert doc["runs"][0]["summary"]["peak_inflight"] == 1
    assert doc["runs"][1]["summary"]["peak_inflight"] <= 2
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    assert all(math.isfinite(r["summary"]["output_throughput"]) for r in doc["runs"])
