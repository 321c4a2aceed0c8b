"""E2E: speculative decoding under prefill/decode disaggregation (one deployment for the module):
the prefill runs the MTP draft layer over the prompt, its rows and the kept hidden state travel
with the handoff, the decode drafts and verifies — the greedy tokens of a unified engine without
speculation."""

from __future__ import annotations

import random

import pytest

from tests.e2e.conftest import has_metric, parse_metrics

pytestmark = pytest.mark.slow

PD = """
[engine]
page_size = 16
speculative_algorithm = "MTP"
speculative_num_steps = 3
[[actors]]
kind = "tokenizer"
[[actors]]
kind = "prefill"
[[actors]]
kind = "decode"
[[actors]]
kind = "detokenizer"
"""


@pytest.fixture(scope="module")
def dep(start_deployment, tmp_path_factory):
    path = tmp_path_factory.mktemp("pd-spec") / "pd.toml"
    path.write_text(PD)
    d = start_deployment([str(path)], name="pd-spec")
    yield d
    d.stop(term_wait=5)


def prompts():
    rng = random.Random(9)
    system = [rng.randrange(10, 900) for _ in range(40)]
    return [system + [rng.randrange(10, 900) for _ in range(3 + 5 * i)] for i in range(3)]


@pytest.mark.timeout(180)
def test_pd_speculation_serves_the_unified_greedy_tokens(dep, tiny_checkpoint):
    import torch
    torch.set_num_threads(1)
    from glmrt.engine.config import EngineConfig
    from glmrt.engine.engine import Engine
    from glmrt.sampling_params import SamplingParams
    e = Engine(EngineConfig(model=tiny_checkpoint, page_size=16, disable_radix_cache=True), log=lambda *a: None)
    want = [c[0].output_ids for c in e.generate(prompts(), SamplingParams(temperature=0, max_tokens=12,
                                                                          ignore_eos=True))]
    client = dep.client()
    got = []
    for p in prompts():
        r = client.completions.create(model=dep.model_id(), prompt=p, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
        got.append(r.choices[0].model_extra["token_ids"])
    assert got == want
    assert "speculative decoding EAGLE" in dep.output()
    m = parse_metrics(dep.get("/metrics")[2].decode())
    assert has_metric(m, "glmrt_spec_mean_accepted_length")
