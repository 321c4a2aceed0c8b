"""The host tier behind the prefix cache, at the engine level (tiny model, CPU pools).

A device pool so small that every conversation's prefix is evicted between its turns: with
the tier on, later turns hit what moved to the host, and every greedy token equals a server
with the cache disabled; the same when every hit is forced through the host; aborts and
retractions while loads are planned leave no page or slot held on either tier.
"""

from __future__ import annotations

import random

import pytest
import torch

torch.set_num_threads(1)

from glmrt.config_bounds import ConfigValueError  # noqa: E402
from glmrt.engine.config import EngineConfig  # noqa: E402
from glmrt.sampling_params import SamplingParams  # noqa: E402
from tests.engine.test_engine import assert_same, greedy, make, toks  # noqa: E402


def tight(ckpt, model, slots=6, pages=14, **kw):
    lay = make(ckpt, model, disable_radix_cache=True).layout
    budget = slots * lay.state_bytes_per_slot + pages * lay.kv_bytes_per_page
    return make(ckpt, model, max_mamba_cache_size=slots, cache_memory_gb=budget / 2**30, **kw)


def conversations(n=4, turns=3, first=30, turn=9):
    return [[toks(2000 + 10 * c, first)] + [toks(2001 + 10 * c + k, turn) for k in range(turns - 1)]
            for c in range(n)]


def serve(engine, convs, out=6, between=None):
    """Turn k of every conversation, then turn k + 1: each turn's prompt is the previous prompt,
    its answer and the new message. Returns the completions in order."""
    prompts = [[] for _ in convs]
    done = []
    for k in range(len(convs[0])):
        for i, conv in enumerate(convs):
            prompts[i] = prompts[i] + conv[k]
            c = engine.generate([prompts[i]], greedy(out))[0][0]
            engine.check_invariants()
            prompts[i] = prompts[i] + c.output_ids
            done.append(c)
            if between is not None:
                between(engine)
    return done


def slow_copies(engine, polls: int) -> None:
    """Each host-tier copy reports ready only at its `polls`-th query, as a copy still on the
    GPU's copy stream would: the requests waiting for it sit out the steps until then."""
    pool = engine.tree.host.pool
    asked: dict[int, int] = {}
    real = pool.ready

    def ready(ticket: int) -> bool:
        asked[ticket] = asked.get(ticket, 0) + 1
        return asked[ticket] >= polls and real(ticket)
    pool.ready = ready


@pytest.fixture(scope="module")
def cold(ckpt, model):
    return serve(make(ckpt, model, disable_radix_cache=True), conversations())


def test_multi_turn_hits_the_host_tier_with_the_cold_tokens(ckpt, model, cold):
    off = tight(ckpt, model)
    serve(off, conversations())
    assert off.counters["cached_prompt_tokens"] == 0 or off.counters["cached_prompt_tokens"] < 50
    for policy in ("write_through", "write_back"):
        e = tight(ckpt, model, enable_hierarchical_cache=True, hicache_ratio=8.0, hicache_write_policy=policy)
        got = serve(e, conversations())
        assert_same(got, cold)
        info = e.info()
        assert info["host_hit_tokens"] > 0 and info["host_load_bytes"] > 0 and info["host_store_bytes"] > 0
        later = got[len(conversations()):]  # turns 2 and 3: their prefix went to the host and back
        assert all(c.cached_tokens > 0 for c in later)
        assert e.counters["cached_prompt_tokens"] > 3 * off.counters["cached_prompt_tokens"]


@pytest.mark.parametrize("polls", [1, 3])
def test_every_hit_forced_through_the_host(ckpt, model, cold, polls):
    def offload_all(engine):
        engine.tree.evict(need_pages=engine.pages.num_pages, need_slots=engine.slots.num_slots)
        assert engine.tree.num_cached_pages == 0 and engine.slots.num_checkpoint == 0

    e = make(ckpt, model, enable_hierarchical_cache=True, hicache_ratio=4.0, hicache_write_policy="write_back")
    slow_copies(e, polls)
    got = serve(e, conversations(), between=offload_all)
    assert_same(got, cold)
    n = len(conversations())
    for c in got[n:]:
        assert c.cached_tokens > 0
    # an exact repeat whose checkpoint is only on the host: still a full hit, the same tokens
    again = e.generate([got[0].prompt_ids], greedy(6))[0][0]
    assert again.cached_tokens == len(got[0].prompt_ids)
    assert_same([again], [cold[0]])
    assert e.info()["host_hit_tokens"] >= sum(c.cached_tokens for c in got[n:])


def churn(e, steps: int, offload) -> dict:
    """Random traffic on a host-tier engine whose loads stay in flight for steps: admissions,
    aborts (half of them of a request whose load is in flight), `offload(e)` now and then so
    admissions load. -> the counters, and what is still held on either tier once it drains."""
    slow_copies(e, 3)  # loads stay in flight for steps: aborts and retractions land on waiting requests
    rng = random.Random(1)
    waited = aborted_waiting = 0
    shared = [toks(3000 + i, 28) for i in range(4)]
    live: list[str] = []
    for i in range(steps):
        for _ in range(rng.randrange(0, 4)):
            prompt = rng.choice(shared)[: rng.randrange(8, 29)] + toks(3100 + i, rng.randrange(0, 6))
            live += e.add_request(prompt, SamplingParams(temperature=0, max_tokens=rng.randrange(1, 10),
                                                         ignore_eos=True, n=rng.choice([1, 1, 2])))
        loading = [r for r in live if e.requests[r].waits]
        if live and rng.random() < 0.3:
            rid = rng.choice(loading) if loading and rng.random() < 0.5 else rng.choice(live)
            live.remove(rid)
            aborted_waiting += bool(e.requests[rid].waits)
            e.abort(rid)
        if rng.random() < 0.2:
            offload(e)
        waited += sum(1 for r in e.scheduler.running if r.waits)
        e.step()
        e.check_invariants()
        live = [r for r in live if not e.requests[r].finished]
        for rid in [r for r, q in e.requests.items() if q.finished]:
            del e.requests[rid]
    while e.has_work():
        e.step()
    counts = {"host_loads": e.info()["host_loads"], "retractions": e.counters["retractions"],
              "aborted": e.counters["aborted"], "aborted_waiting": aborted_waiting, "waited": waited}
    e.flush_cache()
    e.check_invariants()
    host = e.tree.host
    counts["leaked"] = [e.pages.num_used, e.slots.num_slots - e.slots.num_free,
                        host.pages.num_used, host.slots.num_slots - host.slots.num_free]
    return counts


def test_aborts_and_retractions_during_loads_leave_nothing(ckpt, model):
    e = tight(ckpt, model, slots=8, pages=12, enable_hierarchical_cache=True, hicache_ratio=6.0,
              chunked_prefill_size=16, max_prefill_tokens=40)
    c = churn(e, 100, lambda e: e.tree.evict(need_pages=e.pages.num_pages, need_slots=e.slots.num_slots))
    assert c["host_loads"] > 0 and c["retractions"] > 0 and c["aborted"] > 0 and c["waited"] > 0, c
    assert c["aborted_waiting"] > 0, "no abort hit a request whose load was in flight"
    assert c["leaked"] == [0, 0, 0, 0], c


def test_host_tier_flags_are_checked():
    with pytest.raises(ConfigValueError, match="hicache_size is set only with the host tier on"):
        EngineConfig(hicache_size=4)
    with pytest.raises(ConfigValueError, match="enable_hierarchical_cache needs the prefix cache"):
        EngineConfig(enable_hierarchical_cache=True, disable_radix_cache=True)
    with pytest.raises(ConfigValueError, match="hicache_write_policy"):
        EngineConfig(enable_hierarchical_cache=True, hicache_write_policy="write_sometimes")


def test_a_host_tier_larger_than_free_host_memory_is_refused(ckpt, model):
    from glmrt.devices import mem_available_bytes
    too_big = 4 * mem_available_bytes() / 1e9
    with pytest.raises(ValueError, match=r"the host tier needs .* GiB of host memory and .* GiB is available"):
        make(ckpt, model, enable_hierarchical_cache=True, hicache_size=too_big)


def test_what_leaves_the_host_is_found_on_disk(ckpt, model, cold, tmp_path):
    """A host tier of a few rows: each conversation's prefix goes device -> host -> disk between
    its turns, and comes back from the disk, with the cold tokens; a new engine on the same
    directory finds the files of the first one."""
    def offload_all(engine):
        engine.tree.evict(need_pages=engine.pages.num_pages, need_slots=engine.slots.num_slots)
        host = engine.tree.host
        host.make_room(host.pages.num_pages, host.slots.num_slots)  # everything on to the disk
        assert host.pages.num_used == 0 and host.slots.num_checkpoint == 0

    kw = dict(enable_hierarchical_cache=True, hicache_ratio=2.0, hicache_write_policy="write_back",
              hicache_storage_dir=str(tmp_path / "l3"), hicache_storage_size=0.05)
    e = make(ckpt, model, **kw)
    got = serve(e, conversations(), between=offload_all)
    assert_same(got, cold)
    info = e.info()
    assert info["disk_hits"] > 0 and info["disk_spilled_pages"] > 0 and info["disk_used_bytes"] > 0
    n = len(conversations())
    assert all(c.cached_tokens > 0 for c in got[n:])
    fresh = make(ckpt, model, **kw)  # an empty tree over the files left behind
    again = fresh.generate([got[-1].prompt_ids], greedy(6))[0][0]
    assert again.cached_tokens == len(got[-1].prompt_ids)
    assert_same([again], [cold[-1]])
    fresh.check_invariants()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the host tier's copy stream needs CUDA")
def test_on_cuda_every_hit_through_pinned_host_memory(ckpt):
    from glmrt.engine.engine import Engine

    def on_gpu(**kw):
        return Engine(EngineConfig(model=ckpt, page_size=8, device="cuda", backend="reference", dtype="float32",
                                   disable_cuda_graph=True, skip_server_warmup=True, cache_memory_gb=0.05, **kw),
                      log=lambda *a: None)  # small pools: the tier is 4x them, in pinned host memory

    def offload_all(engine):
        engine.tree.evict(need_pages=engine.pages.num_pages, need_slots=engine.slots.num_slots)

    want = serve(on_gpu(disable_radix_cache=True), conversations())
    e = on_gpu(enable_hierarchical_cache=True, hicache_ratio=4.0, hicache_write_policy="write_back")
    pool = e.tree.host.pool
    assert pool.stream is not None and pool.tensors["latent"].is_pinned()
    got = serve(e, conversations(), between=offload_all)
    assert_same(got, want)
    assert all(c.cached_tokens > 0 for c in got[len(conversations()):])
    assert e.info()["host_hit_tokens"] > 0


def test_pd_with_the_tier_on_both_sides(ckpt, model, cold):
    """Prefill and decode engines with host tiers, both pushed to the host between requests:
    the prefill resumes from host checkpoints, the decode side reuses KV pages loaded from its
    host tier (receiving only the rest), and the tokens are the cold ones."""
    from tests.engine.test_engine_handoff import pd_generate

    kw = dict(enable_hierarchical_cache=True, hicache_ratio=4.0, hicache_write_policy="write_back")
    prefill, decode = make(ckpt, model, role="prefill", **kw), make(ckpt, model, role="decode", **kw)
    convs = conversations()
    prompts = [[] for _ in convs]
    got = []
    for k in range(len(convs[0])):
        for i, conv in enumerate(convs):
            prompts[i] = prompts[i] + conv[k]
            done, res, _ = pd_generate(prefill, decode, prompts[i], greedy(6), f"c{i}t{k}")
            got.append((done, res.reused_tokens))
            prompts[i] = prompts[i] + done.output_ids
            for e in (prefill, decode):
                e.tree.evict(need_pages=e.pages.num_pages, need_slots=e.slots.num_slots)
    assert_same([d for d, _ in got], cold)
    n = len(convs)
    assert all(reused > 0 for _, reused in got[n:])
    assert prefill.info()["host_hit_tokens"] > 0 and decode.info()["host_hit_tokens"] > 0
    for e in (prefill, decode):
        e.flush_cache()
        e.check_invariants()
        assert e.tree.host.pages.num_used == 0 and e.pages.num_free == e.pages.num_pages
