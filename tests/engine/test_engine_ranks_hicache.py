"""The host tier on an engine of two ranks (two processes, gloo, on the CPU): rank 0's tier
decides every copy and rank 1 performs the same ones from the step inputs, on its own shard.

A device pool so small that each conversation's prefix goes to the host between its turns:
later turns hit the host and every greedy token equals a one-rank engine without a prefix
cache; an exact repeat whose state is only on the host is a full hit; the two ranks' own
copies of the replicated MLA latent pages and indexer keys are equal row for row on the host;
aborts and retractions while loads are in flight leave nothing held on either tier; with the
disk tier behind it each rank keeps its shard of every entry in a directory of its own, under
the same keys; a tier that fits in host memory once but not once per rank is refused."""

from __future__ import annotations

import json
import multiprocessing
import re

import pytest
import torch

torch.set_num_threads(1)

from tests.engine.test_engine import PS, assert_same, greedy, make  # noqa: E402
from tests.engine.test_engine_ranks import run_two_ranks  # noqa: E402
from tests.engine.test_engine_hicache import churn, conversations, serve  # noqa: E402


class Out:
    """A completion's tokens as they came back from rank 0 (what assert_same compares)."""

    def __init__(self, ids: list[int]):
        self.output_ids = ids


def _pool_gb(ckpt: str, slots: int, pages: int) -> float:
    """A state pool of `slots` and a KV pool of `pages` on each of two ranks."""
    from glmrt.cache.layout import CacheLayout
    from glmrt.config import load_model_config
    lay = CacheLayout.from_config(load_model_config(ckpt).text, page_size=PS, kv_dtype="float32",
                                  state_dtype="float32", model_dtype="float32", tp_size=2)
    return (slots * lay.state_bytes_per_slot + pages * lay.kv_bytes_per_page) / 2**30


def _configs(ckpt: str, l3: str) -> dict:
    from glmrt.engine.config import EngineConfig
    common = dict(model=ckpt, page_size=PS, enable_hierarchical_cache=True)
    disk = EngineConfig(**common, cache_memory_gb=_pool_gb(ckpt, 8, 48), hicache_ratio=1.0,
                        hicache_write_policy="write_back", hicache_storage_dir=l3, hicache_storage_size=0.05)
    return {"turns": EngineConfig(**common, max_mamba_cache_size=6, cache_memory_gb=_pool_gb(ckpt, 6, 14),
                                  hicache_ratio=8.0),
            "churn": EngineConfig(**common, max_mamba_cache_size=8, cache_memory_gb=_pool_gb(ckpt, 8, 12),
                                  hicache_ratio=6.0, hicache_write_policy="write_back", chunked_prefill_size=16,
                                  max_prefill_tokens=40),
            "disk": disk, "disk_again": disk, "disk_rank1_lost": disk}


def _offload_all(engine) -> None:
    engine.tree.evict(need_pages=engine.pages.num_pages, need_slots=engine.slots.num_slots)


def _turns(e) -> dict:
    got = serve(e, conversations())
    _offload_all(e)  # the first prompt's state now only on the host
    again = e.generate([got[0].prompt_ids], greedy(6))[0][0]
    e.check_invariants()
    info = e.info()
    return {"tokens": [c.output_ids for c in got], "cached": [c.cached_tokens for c in got],
            "again": again.output_ids, "again_cached": again.cached_tokens,
            "host_hit_tokens": info["host_hit_tokens"], "host_load_bytes": info["host_load_bytes"]}


def _to_disk(engine) -> None:
    _offload_all(engine)
    host = engine.tree.host
    host.make_room(host.pages.num_pages, host.slots.num_slots)  # everything on to the disk


def _disk(e) -> dict:
    """Each conversation's prefix goes device -> host -> disk between its turns, and back."""
    got = serve(e, conversations(), between=_to_disk)
    info = e.info()
    return {"tokens": [c.output_ids for c in got], "cached": [c.cached_tokens for c in got],
            "last_prompt": got[-1].prompt_ids, "disk_hits": info["disk_hits"],
            "disk_spilled_pages": info["disk_spilled_pages"]}


def _repeat(prompt):
    def work(e) -> dict:
        again = e.generate([prompt], greedy(6))[0][0]
        e.check_invariants()
        return {"again": again.output_ids, "again_cached": again.cached_tokens, "disk_hits": e.info()["disk_hits"]}
    return work


def _replicated_rows_differ(link, pool) -> dict:
    """Collective: how far rank 1's host copy of the replicated tensors is from rank 0's (and
    how much rank 0's holds, so an all-zero pair does not pass for equal); each rank's host bytes."""
    import torch.distributed as dist
    pool.synchronize()  # no copy into the host rows still in flight
    out = {}
    for name in ("latent", "pooled"):
        mine = pool.tensors[name].float().contiguous()
        both = [torch.empty_like(mine) for _ in range(2)]
        dist.all_gather(both, mine, group=link.group)
        out[name] = [float((both[0] - both[1]).abs().max()), float(both[0].abs().max())]
    return out, [n for (n,) in link.gather([pool.nbytes])]


def _files(directory: str, prefix: str) -> list[str]:
    import os
    return sorted(n for n in os.listdir(directory) if n.startswith(prefix) and n.endswith(".safetensors"))


def _rank_main(rank: int, rendezvous: str, ckpt: str, result: str, l3: str) -> None:
    import os
    torch.set_num_threads(1)
    from glmrt.engine.engine import Engine
    from glmrt.engine.model_rank import ModelRank
    from glmrt.engine.ranks import join_group, leave_group
    parallel, link = join_group(rank, 2, 1, rendezvous, "cpu")
    out = {}
    for name, cfg in _configs(ckpt, l3).items():
        if name == "disk_rank1_lost":  # rank 1 lost its checkpoint files: rank 0 must not use its own
            link.gather([0])  # both ranks' files as the last engine left them
            if rank:
                for f in _files(os.path.join(l3, "rank1"), "c"):
                    os.remove(os.path.join(l3, "rank1", f))
            link.gather([0])
        if rank:
            r = ModelRank(cfg, log=lambda *a: None, parallel=parallel, link=link)
            r.follow()
            _replicated_rows_differ(link, r.host_pool)
            continue
        e = Engine(cfg, log=lambda *a: None, parallel=parallel, link=link)
        if name == "disk_rank1_lost":
            out["rank0_checkpoint_files"] = len(_files(os.path.join(l3, "rank0"), "c"))
        work = {"turns": _turns, "churn": lambda e: churn(e, 60, _offload_all), "disk": _disk}.get(name) or _repeat(out["disk"]["last_prompt"])
        out[name] = work(e)
        e.runner.stop_followers()
        out[name]["replicated"], out[name]["rank_bytes"] = _replicated_rows_differ(link, e.host_pool)
        out[name]["pool_bytes"] = e.info()["host_pool_bytes"]
    link.gather([0])
    out["files"] = [_files(os.path.join(l3, f"rank{r}"), "") for r in range(2)]
    # a tier that fits once on this host but not once per rank: every rank refuses, before any allocates
    from glmrt.devices import mem_available_bytes
    from glmrt.engine.config import EngineConfig
    big = EngineConfig(model=ckpt, page_size=PS, enable_hierarchical_cache=True,
                       hicache_size=0.7 * mem_available_bytes() / 1e9)
    try:
        (ModelRank if rank else Engine)(big, log=lambda *a: None, parallel=parallel, link=link)
        out["refused"] = None
    except ValueError as e:
        out["refused"] = str(e)
    if not rank:
        with open(result, "w") as f:
            json.dump(out, f)
    leave_group()


@pytest.fixture(scope="module")
def two_ranks(ckpt, tmp_path_factory):
    d = tmp_path_factory.mktemp("hicache-ranks")
    return run_two_ranks(_rank_main, d, ckpt, str(d / "l3"))


@pytest.mark.timeout(300)
def test_two_ranks_hit_the_host_tier_with_the_cold_tokens(ckpt, model, two_ranks):
    cold = serve(make(ckpt, model, disable_radix_cache=True), conversations())
    got = two_ranks["turns"]

    assert_same([Out(t) for t in got["tokens"]], cold)
    n = len(conversations())
    assert all(c > 0 for c in got["cached"][n:])  # later turns: prefixes back from the host
    assert got["host_hit_tokens"] >= sum(got["cached"][n:]) and got["host_load_bytes"] > 0
    assert got["again_cached"] == len(cold[0].prompt_ids)  # a full hit from the host
    assert_same([Out(got["again"])], [cold[0]])
    for case in ("turns", "churn"):
        for name, (diff, size) in two_ranks[case]["replicated"].items():
            assert size > 0 and diff <= 1e-5 * size, (case, name, diff, size)
        assert two_ranks[case]["pool_bytes"] == sum(two_ranks[case]["rank_bytes"])  # the engine's, every rank


def test_two_ranks_keep_their_shards_on_disk_under_the_same_keys(ckpt, model, two_ranks):
    """Each rank's directory holds the same entries (its shard of each); what left the host
    comes back from the disk with the cold tokens, also for an engine started later on the same
    directories; files one rank lost are not used by the others (they remove theirs)."""
    cold = serve(make(ckpt, model, disable_radix_cache=True), conversations())
    got = two_ranks["disk"]
    assert_same([Out(t) for t in got["tokens"]], cold)
    assert got["disk_hits"] > 0 and got["disk_spilled_pages"] > 0
    assert all(c > 0 for c in got["cached"][len(conversations()):])
    again = two_ranks["disk_again"]
    assert again["again_cached"] == len(got["last_prompt"]) and again["disk_hits"] > 0
    assert_same([Out(again["again"])], [cold[-1]])
    lost = two_ranks["disk_rank1_lost"]
    assert two_ranks["rank0_checkpoint_files"] == 0  # removed on rank 0 too, at its start
    assert lost["again_cached"] == 0 and lost["again"] == again["again"]
    rank0, rank1 = two_ranks["files"]
    assert rank0 == rank1 and any(f.startswith("p") for f in rank0)


def test_a_tier_that_fits_once_but_not_per_rank_is_refused(two_ranks):
    assert two_ranks["refused"] is not None
    assert re.fullmatch(r"the host tier needs [0-9.]+ GiB of host memory \(2 ranks x [0-9.]+ GiB\) and [0-9.]+ GiB "
                        r"is available: lower --hicache-size or --hicache-ratio", two_ranks["refused"])


def test_two_ranks_leave_nothing_on_either_tier_after_aborts(two_ranks):
    got = two_ranks["churn"]
    assert got["host_loads"] > 0 and got["retractions"] > 0 and got["aborted"] > 0
    assert got["aborted_waiting"] > 0, "no abort hit a request whose load was in flight"
    assert got["leaked"] == [0, 0, 0, 0]


def _gpu_rank_main(rank: int, rendezvous: str, ckpt: str, result: str) -> None:
    """One GPU per rank (the only one it sees, as a rank of `glmrt up`); every hit forced
    through pinned host memory and the copy streams."""
    from glmrt.engine.config import EngineConfig
    from glmrt.engine.engine import Engine
    from glmrt.engine.model_rank import ModelRank
    from glmrt.engine.ranks import join_group, leave_group
    parallel, link = join_group(rank, 2, 1, rendezvous, "cuda")
    # pools of ~1% of the GPU, a host tier twice theirs per rank (pinned, in host memory)
    cfg = EngineConfig(model=ckpt, page_size=PS, device="cuda", backend="reference", dtype="float32",
                       disable_cuda_graph=True, skip_server_warmup=True, mem_fraction_static=0.01,
                       enable_hierarchical_cache=True, hicache_write_policy="write_back")
    if rank:
        r = ModelRank(cfg, log=lambda *a: None, parallel=parallel, link=link)
        r.follow()
        _replicated_rows_differ(link, r.host_pool)
    else:
        e = Engine(cfg, log=lambda *a: None, parallel=parallel, link=link)
        assert e.host_pool.stream is not None and e.host_pool.tensors["latent"].is_pinned()
        got = serve(e, conversations(), between=_offload_all)
        again = e.generate([got[0].prompt_ids], greedy(6))[0][0]  # after the last offload: a full hit
        out = {"tokens": [c.output_ids for c in got], "cached": [c.cached_tokens for c in got],
               "again": again.output_ids, "again_cached": again.cached_tokens,
               "host_hit_tokens": e.info()["host_hit_tokens"]}
        e.runner.stop_followers()
        out["replicated"], _ = _replicated_rows_differ(link, e.host_pool)
        with open(result, "w") as f:
            json.dump(out, f)
    leave_group()


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two ranks on two GPUs")
def test_on_two_gpus_every_hit_through_pinned_host_memory(ckpt, tmp_path):
    from glmrt.engine.config import EngineConfig
    from glmrt.engine.engine import Engine
    cold_engine = Engine(EngineConfig(model=ckpt, page_size=PS, device="cuda", backend="reference", dtype="float32",
                                      disable_cuda_graph=True, skip_server_warmup=True, mem_fraction_static=0.01,
                                      disable_radix_cache=True), log=lambda *a: None)
    cold = serve(cold_engine, conversations())
    del cold_engine
    torch.cuda.empty_cache()
    result = str(tmp_path / "result.json")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_gpu_rank_main, args=(r, str(tmp_path / "rendezvous"), ckpt, result))
             for r in range(2)]
    import os
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    try:  # a child reads the variable at its start (this process's CUDA is initialised already)
        for p, gpu in zip(procs, gpus):
            os.environ["CUDA_VISIBLE_DEVICES"] = gpu
            p.start()
    finally:
        if visible is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible
    for p in procs:
        p.join(500)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    with open(result) as f:
        got = json.load(f)

    assert_same([Out(t) for t in got["tokens"]], cold)
    assert all(c > 0 for c in got["cached"][len(conversations()):]) and got["host_hit_tokens"] > 0
    assert got["again_cached"] == len(cold[0].prompt_ids)
    assert_same([Out(got["again"])], [cold[0]])
    for name, (diff, size) in got["replicated"].items():
        assert size > 0 and diff <= 1e-5 * size, (name, diff, size)
