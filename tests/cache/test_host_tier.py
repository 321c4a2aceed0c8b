"""The host and disk tiers on their own: a node moves between the device pools and the host
whole (pages, checkpoints, their rows' contents), host space is reclaimed LRU, the disk
store keeps files under its cap, least recently used first, and another rank replaying rank 0's
journal of copies and disk entries ends with its shard of the same rows and files."""

from __future__ import annotations

import pytest
import torch

from glmrt.cache.disk_tier import DiskTier
from glmrt.cache.host_pool import PAGE_TENSORS, SLOT_TENSORS, HostPool, host_rows
from glmrt.cache.host_tier import HostTier
from glmrt.cache.node_store import LocalDiskStore, prefix_keys
from glmrt.cache.page_manager import PageManager
from glmrt.cache.radix import RadixCache
from glmrt.cache.slot_manager import CHECKPOINT, SlotManager

PS = 4


def device_pools(pages=16, slots=6):
    """Small stand-ins for the pool tensors, [layers, rows, ...], each row filled with its id."""
    shapes = {"latent": (2, pages, PS, 3), "pooled": (1, pages, 1, 2), "conv": (2, slots, 3, 5),
              "recurrent": (2, slots, 2, 2, 2), "tail_k": (1, slots, 2, 2), "tail_g": (1, slots, 2, 2),
              "last_hidden": (1, slots, 4)}
    return {n: torch.zeros(s) for n, s in shapes.items()}


def stamp(pools, name_rows):
    for names, rows in name_rows:
        for n in names:
            for r in rows:
                pools[n][:, r] = 1000 + r


def make(host_pages=8, host_slots=3, policy="write_back", disk=None):
    pools = device_pools()
    tier = HostTier(HostPool(pools, host_pages, host_slots), policy, disk)
    tree = RadixCache(PS, PageManager(16), SlotManager(6), host=tier)
    return tree, tier, pools


def cache(tree, tokens):
    own = tree.pages.allocate(len(tokens) // PS)
    canon = tree.insert(tokens, own)
    tree.pages.release(own)
    return canon


def test_host_rows_split_like_the_device_pools():
    pools = device_pools(pages=16, slots=6)
    full = 16 * sum(pools[n][:, 0].numel() * 4 for n in PAGE_TENSORS) + 6 * sum(
        pools[n][:, 0].numel() * 4 for n in SLOT_TENSORS)
    assert host_rows(pools, 2 * full) == (32, 12)
    with pytest.raises(ValueError, match="at least one page and one slot"):
        HostPool(pools, 0, 4)


def test_a_node_moves_to_the_host_and_back_whole():
    tree, tier, pools = make()
    tokens = list(range(8))
    pages = cache(tree, tokens)
    slot = tree.slots.allocate(CHECKPOINT)
    part = tree.pages.allocate(1)[0]
    stamp(pools, [(PAGE_TENSORS, pages + [part]), (SLOT_TENSORS, [slot])])
    c = tree.add_checkpoint(tokens + [50, 51], 10, slot, part)
    tree.evict(need_pages=16, need_slots=6)            # everything off the device
    node = c.node
    assert node.pages == [] and len(node.host_pages) == 2 and c.slot is None and c.host_slot is not None
    assert tree.pages.num_free == 16 and tree.slots.num_free == 6
    h = tier.pool.tensors
    assert all(float(h["latent"][hp, 0, 0, 0]) == 1000 + p for hp, p in zip(node.host_pages, pages))
    assert float(h["recurrent"][c.host_slot].flatten()[0]) == 1000 + slot
    assert float(h["pooled"][c.host_partial].flatten()[0]) == 1000 + part
    for t in pools.values():
        t.zero_()
    m = tree.match(tokens + [50, 51, 52], 12)
    assert m.checkpoint is c and m.pages == []          # the path is on the host only
    got, waits = tree.load_path(m.nodes, lambda n: tree.pages.allocate(n))
    assert all(tier.ready(w) for w in waits) and node.pages == got
    assert [float(pools["latent"][0, p, 0, 0]) for p in got] == [1000 + p for p in pages]
    dst_slot, dst_page = tree.slots.allocate(), tree.pages.allocate(1)[0]
    assert tier.ready(tier.restore(c, dst_slot, dst_page))
    assert float(pools["conv"][0, dst_slot].flatten()[0]) == 1000 + slot
    assert float(pools["latent"][0, dst_page].flatten()[0]) == 1000 + part
    tree.slots.free(dst_slot)
    tree.pages.release([dst_page])
    tree.check()


def test_host_space_is_reclaimed_least_recently_used_first():
    tree, tier, _ = make(host_pages=4)
    a, b, c = ([i] * 8 for i in (1, 2, 3))      # three 2-page nodes, used in order a, b, c
    for t in (a, b, c):
        cache(tree, t)
    tree.match(a, 8)                            # a is now the most recent
    tree.evict(need_pages=16)                   # c and b leave first... but host holds 4 pages
    on_host = {n.tokens[0] for n in tree.root.children.values() if n.host_pages is not None}
    assert on_host == {1, 3} and tier.counters["host_dropped_nodes"] == 1   # b (LRU) was dropped
    assert 2 not in {n.tokens[0] for n in tree.root.children.values()}
    tree.check()


def test_write_through_copies_at_insert_and_evicts_without_a_copy():
    tree, tier, _ = make(policy="write_through")
    cache(tree, list(range(8)))
    assert tier.counters["host_stores"] == 1 and tier.pages.num_used == 2
    tree.evict(need_pages=16)
    assert tier.counters["host_stores"] == 1 and tree.num_cached_pages == 0
    tree.flush()
    tree.check()
    assert tier.pages.num_used == 0 and tree.pages.num_free == 16


def test_disk_store_keeps_its_cap_least_recently_used_first(tmp_path):
    row = {"x": torch.ones(256)}                # 1 KiB of data per entry, plus the header
    store = LocalDiskStore(str(tmp_path), 4 * 1100)
    for k in "abcd":
        assert store.put(k, row)
    store.get("a")                              # a is now the most recent
    assert store.put("e", row)                  # over the cap: b goes
    assert [store.contains(k) for k in "abcde"] == [True, False, True, True, True]
    assert store.used_bytes <= store.capacity_bytes
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{k}.safetensors" for k in "acde"]
    assert torch.equal(store.get("c")["x"], row["x"])
    assert not store.put("huge", {"x": torch.ones(10_000)})
    again = LocalDiskStore(str(tmp_path), 4 * 1100)   # a new store adopts the files it finds
    assert all(again.contains(k) for k in "acde") and again.used_bytes == store.used_bytes
    # cached prompts' KV is readable by this user only
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in tmp_path.iterdir())
    assert LocalDiskStore(str(tmp_path / "new"), 1100).dir and (tmp_path / "new").stat().st_mode & 0o777 == 0o700


def test_disk_store_clears_only_the_temporary_files_nobody_will_finish(tmp_path):
    """A write a crash cut off leaves a temporary file: the next store removes it when the process
    named in it is gone (or, for a name without one, once it is an hour old), and leaves the
    files of a live writer (another engine replica on the same directory) alone. No cap counts
    them."""
    import os
    import subprocess
    import sys
    import time

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)
    names = {f"a.safetensors.{dead_pid}.0.tmp": False, f"b.safetensors.{os.getppid()}.3.tmp": True,
             "c.safetensors.tmp": False, ".tmpQ1w2E3": False, ".tmpfresh": True}
    for name in names:
        (tmp_path / name).write_bytes(b"x" * 5000)
    old = time.time() - 7200
    for name in ("c.safetensors.tmp", ".tmpQ1w2E3"):
        os.utime(tmp_path / name, (old, old))
    store = LocalDiskStore(str(tmp_path), 4 * 1100)
    assert {n: (tmp_path / n).exists() for n in names} == names
    assert store.used_bytes == 0 and store.keys() == []


def test_disk_store_files_are_this_users_only_whatever_the_umask(tmp_path):
    import os

    old = os.umask(0)
    try:
        store = LocalDiskStore(str(tmp_path / "kv"), 4 * 1100)
        assert store.put("k", {"x": torch.ones(256)})
    finally:
        os.umask(old)
    assert sorted(p.name for p in (tmp_path / "kv").iterdir()) == ["k.safetensors"]
    assert (tmp_path / "kv" / "k.safetensors").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "kv").stat().st_mode & 0o777 == 0o700


def test_a_full_disk_refuses_the_entry_and_leaves_no_file(tmp_path):
    """A write that fails for real (here the process's file size limit, as a full disk would) is
    an entry not kept, like one over the cap: the eviction that spilled it goes on, and no
    half-written file stays."""
    import subprocess
    import sys

    script = f"""
import resource, signal, torch
from glmrt.cache.node_store import LocalDiskStore
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
store = LocalDiskStore({str(tmp_path)!r}, 1 << 30)
assert store.put("small", {{"x": torch.ones(256)}})
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
assert not store.put("big", {{"x": torch.ones(1 << 16)}})
assert store.keys() == ["small"]
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "could not write big" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small.safetensors"]


def test_a_damaged_file_is_forgotten(tmp_path):
    store = LocalDiskStore(str(tmp_path), 4 * 1100)
    assert store.put("k", {"x": torch.ones(256)})
    path = tmp_path / "k.safetensors"
    path.write_bytes(path.read_bytes()[:40])  # cut short under the store
    assert store.get("k") is None and not store.contains("k") and not path.exists()


def test_dropped_host_nodes_come_back_from_disk(tmp_path):
    disk = DiskTier(LocalDiskStore(str(tmp_path), 10**6), "salt", PS)
    tree, tier, pools = make(host_pages=4, host_slots=2, disk=disk)
    tokens = list(range(8))
    pages = cache(tree, tokens)
    slot = tree.slots.allocate(CHECKPOINT)
    stamp(pools, [(PAGE_TENSORS, pages), (SLOT_TENSORS, [slot])])
    tree.add_checkpoint(tokens, 8, slot, None, has_output=True)
    tree.evict(need_pages=16, need_slots=6)
    tier.make_room(4, 2)                        # off the host too: onto the disk
    assert tree.root.children == {} and disk.counters["disk_spilled_pages"] == 2
    assert all(disk.store.contains("p" + k) for k in prefix_keys("salt", tokens, PS))
    assert tier.prefetch(tokens + [9], 8, False, 0)
    m = tree.match(tokens + [9], 8)
    assert m.resume == 8 and m.checkpoint.host_slot is not None
    assert tree.match(tokens, 7, full=True).resume == 8     # the kept output came back too
    got, _ = tree.load_path(m.nodes, lambda n: tree.pages.allocate(n))
    assert [float(pools["latent"][0, p, 0, 0]) for p in got] == [1000 + p for p in pages]
    tree.check()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host memory and copy streams need CUDA")
def test_cuda_copies_run_on_their_own_stream_into_pinned_memory():
    pools = {n: (t + torch.arange(t.shape[1]).view(1, -1, *([1] * (t.dim() - 2)))).cuda()
             for n, t in device_pools().items()}
    pool = HostPool(pools, 8, 4)
    assert pool.stream is not None and all(t.is_pinned() for t in pool.tensors.values())
    ticket = pool.store([(3, 5), (4, 6), (9, 0)], [(2, 3), (5, 1)])   # runs and single rows
    pool.synchronize()
    assert pool.ready(ticket)
    assert float(pool.tensors["latent"][6, 0, 0, 0]) == 4 and float(pool.tensors["latent"][0, 0, 0, 0]) == 9
    assert float(pool.tensors["recurrent"][1].flatten()[0]) == 5
    for t in pools.values():
        t.zero_()
    ticket = pool.load([(5, 10), (6, 11), (0, 2)], [(3, 0)])
    pool.fence()                                 # the compute stream now waits for the load
    got = pools["latent"][0, [10, 11, 2], 0, 0].tolist()
    assert got == [3, 4, 9] and float(pools["conv"][1, 0].flatten()[0]) == 2
    pool.synchronize()
    assert pool.ready(ticket)


def test_another_rank_replaying_the_journal_holds_its_shard_of_the_same_rows(tmp_path):
    """Rank 0's tier with a journal, and a second pool (another rank's shard: every device row
    twice rank 0's) that only replays it: host rows, device rows and disk files end alike."""
    from glmrt.cache.disk_tier import DiskMirror
    disk = DiskTier(LocalDiskStore(str(tmp_path / "rank0"), 10**6), "salt", PS)
    tree, tier, pools = make(host_pages=4, host_slots=2, disk=disk)
    tier.pool.journal = []
    shard = {n: torch.zeros_like(t) for n, t in pools.items()}
    other = HostPool(shard, 4, 2)
    other.disk_mirror = DiskMirror(LocalDiskStore(str(tmp_path / "rank1"), 2**62), other)

    def replay():
        other.replay(*tier.pool.take_journal())

    tokens = list(range(8))
    pages = cache(tree, tokens)
    slot = tree.slots.allocate(CHECKPOINT)
    part = tree.pages.allocate(1)[0]
    stamp(pools, [(PAGE_TENSORS, pages + [part]), (SLOT_TENSORS, [slot])])
    for n in pools:
        shard[n].copy_(2 * pools[n])
    tree.add_checkpoint(tokens + [50], 9, slot, part)
    tree.evict(need_pages=16, need_slots=6)      # stores to the host
    replay()
    assert all(torch.equal(other.tensors[n], 2 * tier.pool.tensors[n]) for n in pools)
    tier.make_room(4, 2)                         # onto the disk (the host rows are reused later)
    assert disk.counters["disk_spilled_pages"] == 2 and disk.counters["disk_spilled_checkpoints"] == 1
    replay()
    for t in (*pools.values(), *shard.values(), *tier.pool.tensors.values(), *other.tensors.values()):
        t.zero_()                                # what comes back now comes from each rank's files
    assert tier.prefetch(tokens + [50, 51], 10, False, 0)   # back from the disk
    m = tree.match(tokens + [50, 51], 10)
    got, _ = tree.load_path(m.nodes, lambda n: tree.pages.allocate(n))
    dst_slot, dst_page = tree.slots.allocate(), tree.pages.allocate(1)[0]
    tier.restore(m.checkpoint, dst_slot, dst_page)
    ops, done = tier.pool.take_journal()
    assert {op.op for op in ops} == {"disk_get", "load"}
    other.replay(ops, done)
    assert [float(shard["latent"][0, p, 0, 0]) for p in got] == [2 * (1000 + p) for p in pages]
    assert float(shard["conv"][0, dst_slot].flatten()[0]) == 2 * (1000 + slot)
    assert all(torch.equal(other.tensors[n], 2 * tier.pool.tensors[n]) for n in pools)
    assert all(torch.equal(shard[n], 2 * pools[n]) for n in pools)
    assert sorted(p.name for p in (tmp_path / "rank1").iterdir()) == \
        sorted(p.name for p in (tmp_path / "rank0").iterdir())
