"""The cuda-h200 DSA indexer kernels against ReferenceOps: scores, top-k pool selection in decode
and prefill batches (exact ties, fallbacks), the pooled-key update, lower-index tie breaking.

Selections are compared exactly (ties go to the lower pool), scores to the conftest bounds, on
fresh random inputs per check. The CPU cases run in Triton's interpreter, the "cuda" ones
compiled (tests/backends/conftest.py).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from backends.meta import BatchMeta  # noqa: E402
from backends.reference import ReferenceOps  # noqa: E402
from backends.kernels.indexer import indexer_scores, topk_keys, topk_lower_index_ties  # noqa: E402
from tests.backends.dsa_problems import (PAGE, PREFILL_CASES, decode_meta, generator, h200_ops,  # noqa: E402
                                         indexer_inputs, prefill_meta)


# ---- decode --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_indexer_scores_kernel(device, dtype):
    kpool = 4
    lens = [3, 50, 130, 77]
    meta, pooled, q, w = indexer_inputs(lens, dtype, device, seed=21)
    n_pools = torch.tensor([n // kpool for n in lens], device=device)
    width = max(n_pools.tolist()) + 5  # wider than any request: the rest must be -inf
    out = torch.full((len(lens), width), float("nan"), device=device)
    indexer_scores(q, w, pooled, meta.page_table, n_pools, PAGE // kpool, width, out=out, config={"BLOCK_P": 16})
    assert not torch.isnan(out).any()
    di = q.shape[-1]
    for r, n in enumerate(n_pools.tolist()):
        ids = torch.arange(n)
        keys = pooled.cpu()[meta.page_table[r].cpu()[ids // (PAGE // kpool)], ids % (PAGE // kpool)].double()
        hw = w[r].cpu().double() * q.shape[1] ** -0.5  # the kernel scales the head weights
        want = (torch.relu(q[r].cpu().double() @ keys.T * di ** -0.5) * hw[:, None]).sum(0)
        got = out[r].cpu()
        assert torch.isinf(got[n:]).all() and (got[n:] < 0).all()
        if n:
            assert torch.allclose(got[:n].double(), want, rtol=1e-5, atol=1e-5)
    # keys=True: the same scores as topk_lower_index_ties's keys (one torch.topk selects); a -0.0
    # row and exact ties (one key pool everywhere) rank as on the scores. Both on the same tiles:
    # in the interpreter numpy's matmul may round a row by its position in the tile, so equal
    # pools score equal only within one tiling.
    for keys_of in (pooled, pooled[:1, :1].expand_as(pooled).contiguous()):
        scores = indexer_scores(q, w, keys_of, meta.page_table, n_pools, PAGE // kpool, width,
                                config={"BLOCK_P": 16})
        keys = indexer_scores(q, w, keys_of, meta.page_table, n_pools, PAGE // kpool, width, keys=True,
                              config={"BLOCK_P": 16})
        assert keys.dtype == torch.int64
        assert torch.equal(topk_keys(keys, width).cpu(), topk_lower_index_ties(scores, width).cpu())
    # the rows' positions instead of their pool counts: the kernel divides them out
    positions = torch.tensor([n - 1 for n in lens], device=device)
    from_positions = torch.full_like(out, float("nan"))
    indexer_scores(q, w, pooled, meta.page_table, positions, PAGE // kpool, width, out=from_positions,
                   config={"BLOCK_P": 16}, positions_kpool=kpool)
    assert torch.equal(from_positions.cpu(), out.cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1])
def test_indexer_select_matches_reference(device, dtype, seed):
    kpool, topk = 4, 6
    lens = [150, 33, 7] if seed else [2, 24, 25, 61, 150]
    meta, pooled, q, w = indexer_inputs(lens, dtype, device, seed=40 + seed)
    got = h200_ops().indexer_select(q, w, pooled, meta, kpool, topk)
    want = ReferenceOps().indexer_select(q, w, pooled, meta, kpool, topk)
    assert got.dtype == want.dtype == torch.long
    assert torch.equal(got.cpu(), want.cpu())


def test_decode_select_short_requests_take_every_pool(device):
    """A decode batch whose requests all have <= topk pools: one launch lists every complete
    pool in order (-1 after), like the reference; 16-bit head weights go in unscaled."""
    from backends.kernels.indexer import decode_select

    kpool, topk = 4, 8
    lens = [1, 3, 4, 17, 32]
    meta, pooled, q, w = indexer_inputs(lens, torch.bfloat16, device, seed=7)
    got = h200_ops().indexer_select(q, w, pooled, meta, kpool, topk)
    assert torch.equal(got.cpu(), ReferenceOps().indexer_select(q, w, pooled, meta, kpool, topk).cpu())
    assert got.cpu().tolist()[3] == [0, 1, 2, 3, -1, -1, -1, -1]
    top = torch.arange(len(lens) * topk, device=device).view(len(lens), topk)
    mixed = decode_select(meta.positions, kpool, 6, top[:, :6])  # requests past 6 pools take `top`
    assert mixed.cpu().tolist()[4] == top[4, :6].cpu().tolist()
    assert mixed.cpu().tolist()[2] == [0, -1, -1, -1, -1, -1]


def test_indexer_select_exact_ties_and_fallback(device):
    """Small-integer inputs make every score exact, so ties are real: the lower pool must win
    (identical keys -> pools 0, 1, 2). A prefill batch (per-token rows) matches too."""
    kpool, topk, hi, di = 4, 3, 16, 16  # scale 16^-0.5 = 0.25: exact
    lens = [40, 64, 97]
    meta, pooled, q, w = indexer_inputs(lens, torch.float32, device, seed=2, hi=hi, di=di)
    g = generator(4)
    pooled = torch.randint(-1, 2, pooled.shape, generator=g).float().to(device)
    q = torch.randint(-2, 3, q.shape, generator=g).float().to(device)
    w = (torch.randint(-2, 3, w.shape, generator=g).float() * 0.5).to(device)
    for keys in (pooled, pooled[:, :1].expand_as(pooled).contiguous()):
        got = h200_ops().indexer_select(q, w, keys, meta, kpool, topk)
        assert torch.equal(got, ReferenceOps().indexer_select(q, w, keys, meta, kpool, topk))
    got = h200_ops().indexer_select(q, w, pooled[:1, :1].expand_as(pooled).contiguous(), meta, kpool, topk)
    assert got.cpu().tolist() == [[0, 1, 2]] * 3
    pre = BatchMeta.build([0], [40], [0], [meta.page_table[0].tolist()], PAGE, device)
    qp = torch.randn(40, hi, di, generator=generator(5)).to(device)
    wp = torch.randn(40, hi, generator=generator(6)).to(device)
    assert torch.equal(h200_ops().indexer_select(qp, wp, pooled, pre, kpool, topk),
                       ReferenceOps().indexer_select(qp, wp, pooled, pre, kpool, topk))


# ---- prefill / mixed batches: one kernel row per query token -------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_indexer_select_prefill_matches_reference(device, dtype, case):
    from backends.kernels import indexer as ik

    kpool, topk, hi, di = 4, 3, 16, 32
    reqs = PREFILL_CASES[case]
    meta, num_pages = prefill_meta(reqs, device, seed=len(case))
    g = generator(60 + len(case))
    n = meta.num_tokens
    pooled = torch.randn(num_pages, PAGE // kpool, di, generator=g).to(device, dtype)
    q = torch.randn(n, hi, di, generator=g).to(device, dtype)
    w = (torch.randn(n, hi, generator=g) * hi ** -0.5).to(device)
    want = ReferenceOps().indexer_select(q, w, pooled, meta, kpool, topk)
    got = h200_ops().indexer_select(q, w, pooled, meta, kpool, topk)
    assert got.dtype == torch.long and torch.equal(got.cpu(), want.cpu())
    # rows in several chunks (a tiny scores budget): the same selection
    max_pools = max(t // kpool for t in meta.total_lens)
    got = ik.indexer_select(q, w, pooled, meta, kpool, topk, max_score_bytes=4 * max_pools * 16)
    assert torch.equal(got.cpu(), want.cpu())
    if case == "mixed":  # every request <= topk pools: all visible pools in index order, no scoring
        got = h200_ops().indexer_select(q, w, pooled, meta, kpool, 32)
        assert torch.equal(got.cpu(), ReferenceOps().indexer_select(q, w, pooled, meta, kpool, 32).cpu())


def test_indexer_select_prefill_exact_ties(device):
    """Small-integer inputs (exact scores, real ties) on prefill rows: the lower pool wins."""
    kpool, topk, hi, di = 4, 3, 16, 16
    meta, num_pages = prefill_meta(PREFILL_CASES["mixed"], device, seed=8)
    g = generator(81)
    n = meta.num_tokens
    pooled = torch.randint(-1, 2, (num_pages, PAGE // kpool, di), generator=g).float().to(device)
    q = torch.randint(-2, 3, (n, hi, di), generator=g).float().to(device)
    w = (torch.randint(-2, 3, (n, hi), generator=g).float() * 0.5).to(device)
    for keys in (pooled, pooled[:1, :1].expand_as(pooled).contiguous()):
        got = h200_ops().indexer_select(q, w, keys, meta, kpool, topk)
        assert torch.equal(got.cpu(), ReferenceOps().indexer_select(q, w, keys, meta, kpool, topk).cpu())


# ---- the pooled-key update and top-k ties --------------------------------------------------------
# decode tokens that join a tail, that complete a pool (pooled key written once), and a one-token
# prompt: positions 0, 2, 3 (completes), 7 (completes), 12, 15 (completes); then short rows (a
# verify or rollback of speculative decoding): runs of 1..8 tokens over history or new, that
# complete none, one or two pools, and end inside or on a pool's last token; then prefill chunks
# beside decodes (a serving step): long runs from a pool boundary, from inside a pool, with and
# without a tail left, an empty row (a full hit), and one-token rows
UPDATE_CASES = {"decode": [(n - 1, 1) for n in (1, 3, 4, 8, 13, 16)],
                "short": [(0, 3), (2, 6), (5, 1), (7, 8), (12, 4), (0, 8)],
                "mixed": [(0, 37), (63, 1), (6, 70), (16, 0), (130, 38), (2, 1), (9, 2), (40, 9)]}


@pytest.mark.parametrize("case", sorted(UPDATE_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_indexer_update_matches_reference(device, dtype, case):
    """The kernel's tails and pooled keys against the reference's; slots are poisoned where the
    reference never reads them."""
    kpool, di = 4, 16
    reqs = UPDATE_CASES[case]
    meta, num_pages = prefill_meta(reqs, device, seed=77, spare_pages=3)
    lens = [p + n for p, n in reqs]
    g = generator(78)
    k = torch.randn(meta.num_tokens, di, generator=g).to(device, dtype)
    gate = torch.randn(meta.num_tokens, di, generator=g).to(device, dtype)
    ape = torch.randn(kpool, di, generator=g).to(device, dtype)
    pooled = torch.randn(num_pages, PAGE // kpool, di, generator=g).to(device, dtype)
    tail_k = torch.randn(len(lens), kpool, di, generator=g).to(device, dtype)
    tail_g = torch.randn(len(lens), kpool, di, generator=g).to(device, dtype)
    ref = [t.clone() for t in (pooled, tail_k, tail_g)]
    h200_ops().indexer_update(k, gate, ape, pooled, tail_k, tail_g, meta, kpool)
    ReferenceOps().indexer_update(k, gate, ape, *ref, meta, kpool)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert torch.allclose(pooled.float().cpu(), ref[0].float().cpu(), rtol=tol, atol=tol)
    for r, n in enumerate(lens):  # the tail rows the reference keeps (the rest is never read)
        rest = n % kpool
        assert torch.equal(tail_k[r, :rest].cpu(), ref[1][r, :rest].cpu())
        assert torch.equal(tail_g[r, :rest].cpu(), ref[2][r, :rest].cpu())


def test_topk_lower_index_ties(device):
    g = generator(8)
    s = torch.randint(-3, 4, (6, 50), generator=g).float() * 0.5
    s[0] = 0.0
    s[0, ::3] = -0.0
    s[0, 7] = 1.0
    s[1, 10:] = float("-inf")
    s = s.to(device)
    want = torch.sort(s.cpu(), dim=1, descending=True, stable=True).indices[:, :12]
    assert torch.equal(topk_lower_index_ties(s, 12).cpu(), want)
