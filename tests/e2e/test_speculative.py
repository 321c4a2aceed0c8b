"""E2E: `glmrt up` with SGLang's MTP flags on the tiny checkpoint (one deployment for the module):
the boot log names the draft layer's KV and the rollback reserve, requests stream exactly
max_tokens tokens through drafted steps, and `/metrics` and `glmrt bench serving` report the
accepted length, the acceptance rate per draft position and the draft / verify time per step."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.e2e.conftest import REPO, Deployment, glmrt_cmd, has_metric, metric_sum, parse_metrics

STEPS = 3


@pytest.fixture(scope="module")
def dep(e2e_tmp, e2e_env, tiny_checkpoint):
    d = Deployment(["--model", tiny_checkpoint, "--page-size", "16", "--speculative-algorithm", "NEXTN",
                    "--speculative-num-steps", str(STEPS), "--speculative-eagle-topk", "1",
                    "--speculative-num-draft-tokens", str(STEPS + 1)],
                   log_path=e2e_tmp / "speculative-up.log", env=e2e_env)
    d.start()
    try:
        d.wait_healthy(timeout=120)
    except BaseException:
        d.stop(term_wait=1)
        raise
    yield d
    d.stop(term_wait=5)


@pytest.mark.timeout(60)
def test_boot_log_names_the_draft_kv_and_the_rollback_reserve(dep):
    out = dep.output()
    assert f"speculative decoding EAGLE (the checkpoint's MTP layer), {STEPS} draft steps" in out
    assert "no overlap schedule; eager" in out  # the CPU: no CUDA graphs
    assert "draft KV (the MTP layer's latent and pooled keys, in the KV pool)" in out
    assert "rollback reserve" in out and "one snapshot per running request" in out


@pytest.mark.timeout(180)
def test_bench_and_metrics_report_speculation(dep, tmp_path):
    out = tmp_path / "results.json"
    cmd = glmrt_cmd() + ["bench", "serving", "--url", dep.url, "--out", str(out), "--seed", "3", "--dataset",
                         "random", "--num-prompts", "8", "--input-len", "24", "--output-len", "9",
                         "--max-concurrency", "4"]
    r = subprocess.run(cmd, cwd=str(REPO), env=dep.env, capture_output=True, text=True, timeout=150)
    if r.returncode != 0:
        dep.fail(f"glmrt bench serving exited with {r.returncode}\n{r.stdout}\n{r.stderr}")
    run = json.loads(out.read_text())["runs"][0]
    s = run["summary"]
    # max_tokens lands inside accepted runs: never a token past it
    assert s["completed"] == 8 and s["total_output_tokens"] == 8 * 9
    assert all(q["output_tokens"] == q["streamed_token_ids"] == 9 for q in run["requests"])
    sp = s["speculative"]
    assert sp["cycles"] > 0 and 1.0 <= sp["mean_accepted_length"] <= STEPS + 1
    assert len(sp["acceptance_rate"]) == STEPS and all(0 <= x <= 1 for x in sp["acceptance_rate"])
    assert sp["draft_ms_per_step"] > 0 and sp["verify_ms_per_step"] > 0
    assert 0 <= sp["accepted_tokens"] <= sp["draft_tokens"]
    assert "spec: mean accepted length" in r.stdout and "spec: acceptance % per position" in r.stdout
    m = parse_metrics(dep.get("/metrics")[2].decode())
    assert metric_sum(m, "glmrt_spec_mean_accepted_length") >= 1.0
    for i in range(STEPS):
        assert has_metric(m, "glmrt_spec_acceptance_rate", position=i)
    assert metric_sum(m, "glmrt_spec_seconds_per_step", phase="verify") > 0
    assert metric_sum(m, "glmrt_spec_tokens", kind="emitted") >= sp["cycles"] > 0


@pytest.mark.timeout(60)
def test_greedy_chat_streams_through_drafted_steps(dep):
    client = dep.client()
    msgs = [{"role": "user", "content": "speculate: say something"}]
    whole = client.chat.completions.create(model=dep.model_id(), messages=msgs, max_tokens=11, temperature=0)
    parts = list(client.chat.completions.create(model=dep.model_id(), messages=msgs, max_tokens=11, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
    def joined(x):
        return (getattr(x, "reasoning_content", None) or "") + "|" + (x.content or "")
    deltas = [c.choices[0].delta for c in parts if c.choices]
    streamed = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) + "|" + \
        "".join(d.content or "" for d in deltas)
    usage = [c.usage for c in parts if c.usage is not None][-1]
    assert usage.completion_tokens == whole.usage.completion_tokens <= 11
    # SGLang's usage field: the decode steps (glmrt eval reads the accepted length from it)
    assert 1 <= whole.usage.model_extra["spec_verify_ct"] <= whole.usage.completion_tokens - 1
    assert streamed == joined(whole.choices[0].message)
