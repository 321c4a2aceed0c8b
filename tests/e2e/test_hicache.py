"""E2E: the host tier through `glmrt up`: unified, prefill/decode, and one engine of two ranks.
KV and state pools so small that each conversation's prefix is evicted between its turns: later
turns report cached tokens that came back from the host, `/metrics` shows the host pool and its
copies, and every greedy token equals an engine without a prefix cache. An exact repeat is a
full hit."""

from __future__ import annotations

import random
import time

import pytest

from tests.e2e.conftest import metric_sum

pytestmark = pytest.mark.slow

PAGE = 16
SLOTS, PAGES = 6, 14


def tiny_pool_gb(tp: int = 1) -> float:
    """SLOTS state slots and PAGES KV pages on each rank of an engine of `tp`."""
    from glmrt.cache.layout import CacheLayout
    from glmrt.checkpoint.presets import preset_config
    lay = CacheLayout.from_config(preset_config("tiny").text, page_size=PAGE, kv_dtype="float32",
                                  state_dtype="float32", model_dtype="float32", tp_size=tp)
    return (SLOTS * lay.state_bytes_per_slot + PAGES * lay.kv_bytes_per_page) / 2**30


def topology(tmp_path, name: str, engines: str, tp: int = 1) -> str:
    path = tmp_path / f"{name}.toml"
    path.write_text(f"""
[engine]
page_size = {PAGE}
cache_memory_gb = {tiny_pool_gb(tp)!r}
max_mamba_cache_size = {SLOTS}
enable_hierarchical_cache = true
hicache_ratio = 8.0
[[actors]]
kind = "tokenizer"
{engines}
[[actors]]
kind = "detokenizer"
""")
    return str(path)


UNIFIED = '[[actors]]\nkind = "engine"'
PD = '[[actors]]\nkind = "prefill"\n[[actors]]\nkind = "decode"'
TP2 = '[[actors]]\nkind = "engine"\ntp = 2'  # every rank its own host rows; rank 0's tier drives them
ENGINES = {"unified": (UNIFIED, 1), "pd": (PD, 1), "tp2": (TP2, 2)}


def conversations():
    rng = random.Random(11)
    return [[[rng.randrange(10, 900) for _ in range(30 if k == 0 else 9)] for k in range(3)] for _ in range(4)]


def turns(send):
    """Turn k of every conversation, then turn k + 1 -> [(prompt, tokens, cached_tokens)]."""
    convs = conversations()
    prompts = [[] for _ in convs]
    out = []
    for k in range(3):
        for i, conv in enumerate(convs):
            prompts[i] = prompts[i] + conv[k]
            tokens, cached = send(prompts[i])
            out.append((list(prompts[i]), tokens, cached))
            prompts[i] = prompts[i] + tokens
    return out


@pytest.fixture(scope="module")
def cold(tiny_checkpoint):
    import torch
    torch.set_num_threads(1)
    from glmrt.engine.config import EngineConfig
    from glmrt.engine.engine import Engine
    from glmrt.sampling_params import SamplingParams
    e = Engine(EngineConfig(model=tiny_checkpoint, page_size=PAGE, disable_radix_cache=True), log=lambda *a: None)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    return turns(lambda p: (e.generate([p], params)[0][0].output_ids, 0))


def settled_metrics(dep, name: str, timeout: float = 10.0) -> dict:
    """/metrics once the engines' periodic stats show `name` > 0 (or at the timeout): the gauges
    are the last stats tick's, which may predate the last request."""
    deadline = time.monotonic() + timeout
    while True:
        m = dep.metrics()
        if metric_sum(m, name) > 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def sender(dep):
    client = dep.client()

    def send(prompt):
        r = client.completions.create(model=dep.model_id(), prompt=prompt, max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
        return r.choices[0].model_extra["token_ids"], r.usage.prompt_tokens_details.cached_tokens
    return send


@pytest.mark.timeout(240)
@pytest.mark.parametrize("placement", list(ENGINES))
def test_turns_hit_the_host_tier_with_the_cold_tokens(start_deployment, tmp_path, cold, placement):
    engines, tp = ENGINES[placement]
    dep = start_deployment([topology(tmp_path, placement, engines, tp)], name=f"hicache-{placement}")
    try:
        send = sender(dep)
        got = turns(send)
        assert [t for _, t, _ in got] == [t for _, t, _ in cold]
        assert all(c > 0 for _, _, c in got[4:])             # later turns: prefixes from the host
        m = settled_metrics(dep, "glmrt_host_cache_hit_tokens")
        assert metric_sum(m, "glmrt_host_cache_hit_tokens") > 0
        assert metric_sum(m, "glmrt_host_cache_bytes", direction="load") > 0
        assert metric_sum(m, "glmrt_host_cache_bytes", direction="store") > 0
        assert metric_sum(m, "glmrt_host_cache_pages", state="free") > 0
        prompt, tokens, _ = got[-1]
        again, cached = send(prompt)                        # an exact repeat: a full hit
        assert cached == len(prompt) and again == tokens
    finally:
        dep.stop(term_wait=5)
