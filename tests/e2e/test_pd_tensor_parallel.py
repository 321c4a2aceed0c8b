"""E2E: prefill tp 2 -> decode tp 2 (four engine processes on the CPU, gloo, one torch thread
each, the tiny checkpoint in fp32): each prefill rank hands its KDA shard to the decode rank of
its number and rank 0 the replicated pages once to every decode rank. The same greedy tokens as
one unified engine of one rank and as one of two ranks, on NIXL and on the zmq fallback, for prompts of several pages, a prefix
the decode holds already (only the missing pages move) and n = 2; afterwards no page or slot
is held by a request on any side. A prefill and a decode of different tp sizes are refused at
start, naming both."""

from __future__ import annotations

import random
import subprocess
import time

import pytest

from tests.e2e.conftest import REPO, free_port, glmrt_cmd

pytestmark = pytest.mark.slow

PS = 16
MAX_TOKENS = 6
PD = f"""
[engine]
page_size = {PS}
[[actors]]
kind = "tokenizer"
[[actors]]
kind = "prefill"
tp = {{prefill_tp}}
[[actors]]
kind = "decode"
tp = {{decode_tp}}
[[actors]]
kind = "detokenizer"
"""


def topology(tmp_path, prefill_tp: int, decode_tp: int) -> str:
    path = tmp_path / f"pd-tp{prefill_tp}-{decode_tp}.toml"
    path.write_text(PD.format(prefill_tp=prefill_tp, decode_tp=decode_tp))
    return str(path)


def prompts() -> list[list[int]]:
    """Five pages and more, sharing a three-page prefix (the decode's cache holds it once the
    first has run), and one shorter than a page."""
    rng = random.Random(23)
    system = [rng.randrange(10, 900) for _ in range(3 * PS + 5)]
    return [system + [rng.randrange(10, 900) for _ in range(30)], system + [rng.randrange(10, 900) for _ in range(9)],
            [rng.randrange(10, 900) for _ in range(7)]]


def serve(d, n: int = 1) -> list[list[list[int]]]:
    """Every prompt's choices' greedy tokens, in order."""
    client = d.client(timeout=120.0)
    out = []
    for p in prompts():
        r = client.completions.create(model=d.model_id(), prompt=p, max_tokens=MAX_TOKENS, temperature=0, n=n,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
        out.append([c.model_extra["token_ids"] for c in sorted(r.choices, key=lambda c: c.index)])
    return out


@pytest.fixture(scope="module")
def one_rank(tiny_checkpoint):
    import torch
    torch.set_num_threads(1)
    from glmrt.engine.config import EngineConfig
    from glmrt.engine.engine import Engine
    from glmrt.sampling_params import SamplingParams
    e = Engine(EngineConfig(model=tiny_checkpoint, dtype="float32", page_size=PS, disable_radix_cache=True),
               log=lambda *a: None)
    outs = e.generate(prompts(), SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return [c[0].output_ids for c in outs]


@pytest.fixture(scope="module", params=["nixl", "zmq"])
def pd(request, start_deployment, tmp_path_factory, e2e_env):
    """The pair on either transfer backend (NIXL where it starts here, else skipped)."""
    if request.param == "nixl":
        pytest.importorskip("nixl_cu13")
    e2e_env["GLMRT_KV_TRANSFER"] = request.param
    try:
        d = start_deployment([topology(tmp_path_factory.mktemp("pdtp"), 2, 2), "--dtype", "float32"],
                             name=f"pd-tp2-{request.param}")
    finally:
        del e2e_env["GLMRT_KV_TRANSFER"]
    d.transport = request.param
    yield d
    d.stop(term_wait=10)


@pytest.mark.timeout(300)
def test_tp2_prefill_to_tp2_decode_gives_unified_tokens(pd, one_rank):
    rows = {a["kind"]: a for a in pd.actors()}
    assert rows["prefill"]["tp"] == rows["decode"]["tp"] == 2
    assert all(len(rows[k]["ranks"]) == 2 for k in ("prefill", "decode"))
    got = serve(pd)
    assert [c[0] for c in got] == one_rank
    twice = serve(pd, n=2)
    assert twice == [[t, t] for t in one_rank]
    time.sleep(1.5)  # engine stats are periodic
    engines = pd.get_json("/server_info")["engines"]
    prefill, decode = engines["prefill/0"], engines["decode/0"]
    assert prefill["kv_transfer"] == decode["kv_transfer"] == pd.transport
    assert prefill["handoff_transfers"] == 3 + 3 * 2  # one per choice, once every rank has written its part
    assert decode["handoff_reused_tokens"] > 0  # the shared prefix's pages were not sent again
    assert prefill["handoff_bytes_sent"] == decode["handoff_bytes_received"] > 0  # every rank's, counted alike
    for e in (prefill, decode):
        # nothing is held by a request: every page is free or the prefix cache's, every slot
        # free or a checkpoint
        assert e["running"] == e["waiting"] == 0 and e["slots_live"] == 0, e
        assert e["pages_free"] + e["cached_pages"] + e["checkpoint_pages"] == e["kv_pool_pages"], e
        assert e["slots_free"] + e["slots_checkpoint"] == e["state_pool_slots"], e


@pytest.mark.timeout(300)
def test_unified_tp2_gives_the_same_tokens(start_deployment, one_rank):
    d = start_deployment(["--tp-size", "2", "--dtype", "float32", "--page-size", str(PS), "--disable-radix-cache"],
                         name="unified-tp2")
    try:
        assert [c[0] for c in serve(d)] == one_rank
    finally:
        d.stop(term_wait=10)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2)])
def test_prefill_and_decode_of_different_tp_are_refused_naming_both(tmp_path, tiny_checkpoint, e2e_env,
                                                                      prefill_tp, decode_tp):
    r = subprocess.run(glmrt_cmd() + ["up", topology(tmp_path, prefill_tp, decode_tp), "--model", tiny_checkpoint,
                                      "--port", str(free_port())],
                       cwd=str(REPO), env=e2e_env, capture_output=True, text=True, timeout=50, stdin=subprocess.DEVNULL)
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert f"prefill tp = {prefill_tp} and decode tp = {decode_tp} differ" in line, line
