"""A PD engine's rank > 0 (actors/rank_handoff.py: RankTransfers) on real zmq transfer engines
and real pools of one rank of tp 2: it writes its own KDA shard (and nothing replicated) into the
rows rank 0 reserved on the decode rank of its number and reports it done; a write that cannot be
posted, or that the decode never acknowledges, is reported failed at a poll and never waited
for past the timeout."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from actors.rank_handoff import RankTransfers, rank_xfer_name
from glmrt.cache.pools import ModelCache
from glmrt.checkpoint.presets import preset_config
from glmrt.engine.handoff import pool_tensors, split_by_rank, state_components
from glmrt.engine.ranks import RankWrite

PS = 16


def _rank(seed: int | None):
    """One rank's pools of a tp 2 engine (random contents, or zeros)."""
    cache = ModelCache.allocate(preset_config("tiny").text, 8, 4, "cpu", page_size=PS, model_dtype="float32",
                                tp_size=2)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        for t in pool_tensors(SimpleNamespace(cache=cache)).values():
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    return SimpleNamespace(cache=cache)


def _poll(xfer: RankTransfers, deadline_s: float) -> list:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        reports = xfer.poll()
        if reports:
            return reports
        time.sleep(0.01)
    return []


@pytest.fixture
def pair(monkeypatch):
    monkeypatch.setenv("GLMRT_KV_TRANSFER", "zmq")
    src_rank, dst_rank = _rank(1), _rank(None)
    src = RankTransfers("prefill/0", 1, src_rank, timeout=0.5)
    dst = RankTransfers("decode/0", 1, dst_rank, timeout=0.5)
    yield src, src_rank, dst, dst_rank
    src.close()
    dst.close()


def _write(rid: str, src_rank, dst_rank, dst: RankTransfers, src_pages, dst_pages, src_slot: int, dst_slot: int):
    _, mine = split_by_rank(state_components(pool_tensors(src_rank), src_pages, src_slot))
    _, theirs = split_by_rank(state_components(pool_tensors(dst_rank), dst_pages, dst_slot))
    return RankWrite(rid, [rank_xfer_name("decode/0", 0), rank_xfer_name("decode/0", 1)], [b"", dst.info()],
                     mine, theirs)


def test_a_rank_writes_its_own_shard_and_reports_it(pair):
    src, src_rank, dst, dst_rank = pair
    w = _write("a", src_rank, dst_rank, dst, [2, 3], [5, 6], src_slot=1, dst_slot=2)
    assert [c.kind for c in w.local] == ["kda_conv", "kda_recurrent"]
    src.write([w], rank=1)
    (report,) = _poll(src, 10)
    assert report.ok and report.rid == "a", report
    s, d = src_rank.cache.state, dst_rank.cache.state
    assert torch.equal(d.conv[:, 2], s.conv[:, 1]) and torch.equal(d.recurrent[:, 2], s.recurrent[:, 1])
    # the replicated rows are rank 0's to send: nothing of them moved from this rank
    assert not d.tail_k.any() and not dst_rank.cache.kv.latent.any() and not dst_rank.cache.kv.pooled.any()
    assert not d.conv[:, [0, 1, 3]].any()
    assert src.poll() == []  # reported once


def test_a_write_that_cannot_be_posted_is_reported_failed_at_once(pair):
    src, src_rank, dst, dst_rank = pair
    w = _write("b", src_rank, dst_rank, dst, [], [], src_slot=0, dst_slot=0)
    bad = RankWrite(w.rid, w.peers, w.infos, w.local, w.remote[:1])  # fewer components than it sends
    src.write([bad], rank=1)
    (report,) = src.poll()
    assert not report.ok and report.error.startswith("rank 1: "), report


def test_a_write_never_acknowledged_is_abandoned_past_the_timeout(pair):
    src, src_rank, dst, dst_rank = pair
    w = _write("c", src_rank, dst_rank, dst, [], [], src_slot=0, dst_slot=3)
    dst.close()  # the decode rank is gone: nothing acknowledges the write
    t0 = time.monotonic()
    src.write([w], rank=1)
    (report,) = _poll(src, 5)
    assert not report.ok and "timed out after 0.5 s" in report.error, report
    assert time.monotonic() - t0 < 3
