"""E2E: prefill/decode disaggregation by placement alone — a topology with `prefill` and
`decode` actors instead of `engine`. The prefill computes the prompt and the first token,
hands the typed state to the decode, which continues: the same greedy tokens as one unified
engine. A pair with incompatible layouts refuses requests by name, never hangs."""

from __future__ import annotations

import random

import openai
import pytest

pytestmark = pytest.mark.slow

PD = """
[engine]
page_size = 16
[[actors]]
kind = "tokenizer"
[[actors]]
kind = "prefill"
[[actors]]
kind = "decode"
{decode_engine}
[[actors]]
kind = "detokenizer"
"""


def topology(tmp_path, name: str, decode_engine: str = "") -> str:
    path = tmp_path / f"{name}.toml"
    path.write_text(PD.format(decode_engine=decode_engine))
    return str(path)


@pytest.fixture(scope="module")
def dep(start_deployment, tmp_path_factory):
    d = start_deployment([topology(tmp_path_factory.mktemp("pd"), "pd")], name="pd")
    yield d
    d.stop(term_wait=5)


def prompts():
    rng = random.Random(7)
    system = [rng.randrange(10, 900) for _ in range(40)]
    return [system + [rng.randrange(10, 900) for _ in range(5 + i)] for i in range(3)]


@pytest.fixture(scope="module")
def unified_tokens(tiny_checkpoint):
    import torch
    torch.set_num_threads(1)
    from glmrt.engine.config import EngineConfig
    from glmrt.engine.engine import Engine
    from glmrt.sampling_params import SamplingParams
    e = Engine(EngineConfig(model=tiny_checkpoint, page_size=16, disable_radix_cache=True), log=lambda *a: None)
    outs = e.generate(prompts(), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    return [c[0].output_ids for c in outs]


@pytest.mark.timeout(180)
def test_pd_serves_the_same_greedy_tokens_as_unified(dep, unified_tokens):
    client = dep.client()
    got = []
    for p in prompts():
        r = client.completions.create(model=dep.model_id(), prompt=p, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
        got.append(r.choices[0].model_extra["token_ids"])
    assert got == unified_tokens
    streamed = [c.choices[0].model_extra["token_ids"] for c in client.completions.create(
        model=dep.model_id(), prompt=prompts()[0], max_tokens=8, temperature=0, stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True}) if c.choices]
    assert sum(streamed, []) == unified_tokens[0]
    assert {a["kind"] for a in dep.actors()} == {"tokenizer", "prefill", "decode", "detokenizer"}


@pytest.mark.timeout(180)
def test_pd_prefix_cache_and_scaling_decode(dep, unified_tokens):
    client = dep.client()
    p = prompts()[2]
    r = client.completions.create(model=dep.model_id(), prompt=p, max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.usage.prompt_tokens_details.cached_tokens > 0
    assert r.choices[0].model_extra["token_ids"] == unified_tokens[2]
    assert dep.cli("scale", "decode=2").returncode == 0
    for _ in range(60):
        if len([a for a in dep.actors("decode") if a["state"] == "ready"]) == 2:
            break
        import time
        time.sleep(1)
    for q in prompts():
        r = client.completions.create(model=dep.model_id(), prompt=q, max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 4
    assert dep.cli("scale", "decode=1").returncode == 0


@pytest.mark.timeout(180)
def test_incompatible_pair_is_refused_by_name(start_deployment, tmp_path_factory):
    path = topology(tmp_path_factory.mktemp("pd-bad"), "bad", decode_engine="engine = { page_size = 32 }")
    d = start_deployment([path], name="pd-bad")
    try:
        with pytest.raises(openai.APIStatusError) as e:
            d.client(max_retries=0).completions.create(model=d.model_id(), prompt=[11, 12, 13], max_tokens=4)
        assert e.value.status_code == 503 and "page_size" in str(e.value)
    finally:
        d.stop(term_wait=5)
