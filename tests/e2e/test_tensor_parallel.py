"""E2E: one engine on two ranks (`glmrt up --tp-size 2`, and `--tp-size 2 --ep-size 2`) on the
CPU (gloo, one torch thread per rank), on the tiny checkpoint in fp32: the same greedy tokens as
one rank, logprobs within 1e-5 relative, /server_info and `glmrt status` naming both ranks with
their pids and devices; a dead rank takes its engine down and the supervisor restarts the whole
group; stopping leaves no rank behind."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from tests.e2e.conftest import process_alive

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
TOP = 5
REL_TOL = 1e-5


def prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(10, 900) for _ in range(12 + 9 * i)] for i in range(3)]


@pytest.fixture(scope="module")
def one_rank(tiny_checkpoint):
    """Tokens and logprobs of the same prompts on one rank, in this process."""
    import torch
    torch.set_num_threads(1)
    from glmrt.engine.config import EngineConfig
    from glmrt.engine.engine import Engine
    from glmrt.sampling_params import SamplingParams
    e = Engine(EngineConfig(model=tiny_checkpoint, dtype="float32", disable_radix_cache=True), log=lambda *a: None)
    outs = e.generate(prompts(), SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=True,
                                                top_logprobs=TOP))
    return [c[0] for c in outs]


@pytest.fixture(scope="module", params=[["--tp-size", "2"], ["--tp-size", "2", "--ep-size", "2"]],
                ids=["tp2", "tp2-ep2"])
def dep(request, start_deployment):
    d = start_deployment([*request.param, "--dtype", "float32"], name="tp-" + "-".join(request.param[1::2]))
    d.flags = request.param
    yield d
    d.stop(term_wait=10)


def _engine_row(dep) -> dict:
    (row,) = dep.actors("engine")
    return row


@pytest.mark.timeout(240)
def test_two_ranks_give_one_ranks_greedy_tokens_and_logprobs(dep, one_rank):
    client = dep.client()
    for prompt, ref in zip(prompts(), one_rank):
        r = client.completions.create(model=dep.model_id(), prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                      logprobs=TOP, extra_body={"ignore_eos": True, "return_token_ids": True})
        choice = r.choices[0]
        assert choice.model_extra["token_ids"] == ref.output_ids
        scale = max(abs(v) for top in ref.top_logprobs for _, v in top)
        assert max(abs(a - b) for a, b in zip(choice.logprobs.token_logprobs, ref.logprobs)) <= REL_TOL * scale
        for got, want in zip(choice.logprobs.top_logprobs, ref.top_logprobs):
            # the api keys top logprobs by token text (two ids can share one): each value it shows
            # is one of the rank's own
            for value in got.values():
                assert min(abs(value - v) for _, v in want) <= REL_TOL * scale, (got, want)


@pytest.mark.timeout(120)
def test_server_info_and_status_name_every_rank(dep):
    ep = 2 if "--ep-size" in dep.flags else 1
    info = dep.get_json("/server_info")
    engine = info["engines"]["engine/0"]
    assert (engine["tp_size"], engine["ep_size"]) == (2, ep)
    row = next(a for a in info["actors"] if a["kind"] == "engine")
    assert (row["tp"], row["ep"]) == (2, ep)
    ranks = row["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and [r["device"] for r in ranks] == ["cpu", "cpu"]
    assert ranks[0]["pid"] == row["pid"] and ranks[1]["pid"] != row["pid"]
    assert all(process_alive(r["pid"]) for r in ranks)
    out = dep.cli("status")
    assert out.returncode == 0, out.stderr
    assert f"tp 2, ep {ep}" in out.stdout, out.stdout
    for r in ranks:
        assert f"rank {r['rank']}: pid {r['pid']} on cpu" in out.stdout, out.stdout


@pytest.mark.timeout(180)
def test_a_dead_rank_restarts_its_whole_engine(dep, one_rank):
    old = _engine_row(dep)["ranks"]
    # rank 1 dies (rank 0 ends the engine) on one deployment, rank 0 (rank 1 dies with it) on the other
    victim = old[0] if "--ep-size" in dep.flags else old[1]
    os.kill(victim["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        row = _engine_row(dep)
        if row["state"] == "ready" and row["ranks"] and row["ranks"][0]["pid"] != old[0]["pid"]:
            break
        time.sleep(0.25)
    else:
        dep.fail(f"the engine did not come back with new ranks: {_engine_row(dep)}")
    assert not process_alive(old[0]["pid"]) and not process_alive(old[1]["pid"])
    assert row["restarts"] == 1 and all(process_alive(r["pid"]) for r in row["ranks"])
    r = dep.client().completions.create(model=dep.model_id(), prompt=prompts()[0], max_tokens=MAX_TOKENS,
                                        temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == one_rank[0].output_ids


@pytest.mark.timeout(120)
def test_stopping_leaves_no_rank_behind(dep):
    ranks = _engine_row(dep)["ranks"]
    dep.stop(term_wait=20)
    deadline = time.monotonic() + 10
    while any(process_alive(r["pid"]) for r in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(process_alive(r["pid"]) for r in ranks), ranks
    assert dep.proc.returncode == 0, dep.output()[-3000:]
