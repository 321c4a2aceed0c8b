"""The cuda-h200 sparse-MLA kernels against ReferenceOps: the decode kernel, the token lists,
the sparse_mla op in decode, prefill and mixed batches, fp8 latent caches.

Where they run (Triton's interpreter on CPU tensors, or compiled on a GPU: the "cuda" case) and
the bounds: tests/backends/conftest.py. Every check draws fresh random inputs, NaN-poisons the
kernel outputs and checks that every element was written.
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
from backends.kernels.indexer import indexer_select  # noqa: E402
from backends.kernels.sparse_mla import build_decode_token_idx, sparse_mla_decode  # noqa: E402
from tests.backends.conftest import rel as _rel, tol as _tol  # noqa: E402
from tests.backends.dsa_problems import (PAGE, PREFILL_CASES, decode_meta, generator, h200_ops,  # noqa: E402
                                         mla_inputs, prefill_mla_inputs, prefill_sel, random_sel,
                                         torch_decode)


# ---- sparse MLA decode kernel --------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("r", [32, 64])
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_sparse_mla_decode_kernel(device, dtype, r, num_splits):
    g = generator(100 + r + (num_splits or 0))
    b, h, k, num_pages = 5, 4, 45, 12
    cache = torch.randn(num_pages, PAGE, r, generator=g).to(dtype)
    q_abs = torch.randn(b, h, r, generator=g).to(dtype)
    token_idx = torch.randint(0, num_pages * PAGE, (b, k), generator=g, dtype=torch.int32)
    token_idx[torch.rand(b, k, generator=g) < 0.3] = -1      # padding anywhere
    token_idx[1, 7:] = -1                                      # a short request
    token_idx[2, 0] = 5
    token_idx[3] = -1                                          # nothing selected: zeros
    cache, q_abs, token_idx = cache.to(device), q_abs.to(device), token_idx.to(device)
    out = torch.full((b, h, r), float("nan"), dtype=dtype, device=device)
    res = sparse_mla_decode(q_abs, cache, token_idx, 0.3, out=out, num_splits=num_splits)
    assert res is out
    ref = torch_decode(q_abs, cache.view(-1, r), token_idx, 0.3)
    assert _rel(out, ref) < _tol(dtype)
    assert (out[3] == 0).all()


@pytest.mark.parametrize("splits,by_count", [(2, True), (3, True), (3, False)])
def test_sparse_mla_decode_num_tokens_bound(device, splits, by_count, monkeypatch):
    """num_tokens stops at the packed prefix: what lies beyond is never read; each request's own
    count is spread over the splits (SPLIT_BY_COUNT; a split past it is empty), or the list width."""
    from backends.kernels import sparse_mla as sm

    monkeypatch.setattr(sm, "SPLIT_BY_COUNT", by_count)
    g = generator(7)
    b, h, r, k = 3, 4, 32, 40
    cache = torch.randn(6, PAGE, r, generator=g)
    q_abs = torch.randn(b, h, r, generator=g)
    token_idx = torch.randint(0, 6 * PAGE, (b, k), generator=g, dtype=torch.int32)
    n = torch.tensor([40, 1, 17], dtype=torch.int32)
    ref = torch_decode(q_abs, cache.view(-1, r), torch.where(torch.arange(k) < n[:, None], token_idx, -1), 0.2)
    bad = token_idx.clone()
    bad[1, 1:] = 10 ** 6  # out of range: must not be touched
    bad[2, 17:] = 10 ** 6
    out = sparse_mla_decode(q_abs.to(device), cache.to(device), bad.to(device), 0.2, n.to(device), num_splits=splits)
    assert _rel(out, ref) < 1e-5


# ---- token lists and the sparse_mla op -----------------------------------------------------------
@pytest.mark.parametrize("with_tail", [True, False])
def test_token_idx_equals_reference_mask(device, with_tail):
    g = generator(11)
    lens, kpool = [1, 3, 16, 33, 70], 4
    meta, _ = decode_meta(lens, device, seed=1)
    sel = random_sel([n // kpool for n in lens], 6, g, odd=True).to(device)
    token_idx, num = build_decode_token_idx(sel, meta, kpool, with_tail)
    dense_idx, dense_num = build_decode_token_idx(None, meta, kpool, with_tail)
    for r, total in enumerate(lens):
        pages = meta.page_table[r, : -(-total // PAGE)].cpu()
        locs = (pages[:, None] * PAGE + torch.arange(PAGE)).flatten()[:total]
        pos = meta.positions[r:r + 1].cpu()
        for s, idx, cnt in ((sel[r:r + 1].cpu(), token_idx[r].cpu(), num[r]), (None, dense_idx[r].cpu(), dense_num[r])):
            mask = ReferenceOps._token_mask(s, pos, total, kpool, with_tail)[0]
            want = sorted(locs[mask].tolist())
            got = idx[: int(cnt)].tolist()
            assert sorted(got) == want and len(set(got)) == len(got)
            assert (idx[int(cnt):] == -1).all()


@pytest.mark.parametrize("with_tail", [True, False])
def test_decode_rows_kernel_equals_reference_mask(device, with_tail):
    """build_decode_rows (one launch) lists exactly the reference's token set per request (repeats
    once, -1 and incomplete pools dropped, the tail), each row once, and writes nothing past its count."""
    from backends.kernels.sparse_mla import build_decode_rows

    g = generator(23)
    lens, kpool = [1, 3, 16, 33, 70], 4
    meta, _ = decode_meta(lens, device, seed=3)
    sel = random_sel([n // kpool for n in lens], 6, g, odd=True).to(device)
    k = 6 * kpool + (kpool - 1 if with_tail else 0)
    idx, num = build_decode_rows(sel, meta.positions, meta.page_table, meta.page_size, kpool, with_tail)
    assert idx.shape == (len(lens), k) and idx.dtype == torch.int32 and num.dtype == torch.int32
    want_idx, want_num = build_decode_token_idx(sel, meta, kpool, with_tail)
    for r in range(len(lens)):
        got = idx[r, : int(num[r])].tolist()
        want = want_idx[r, : int(want_num[r])].tolist()
        assert sorted(got) == sorted(want) and len(set(got)) == len(got), r


@pytest.mark.parametrize("with_tail", [True, False])
def test_kernel_token_list_equals_built_list(device, with_tail):
    """The token set derived inside the kernel from sel (repeats, -1, incomplete pools, pages)
    gives the same attention as the explicit token list."""
    from backends.kernels.sparse_mla import sparse_mla_decode_sel

    g = generator(19)
    lens, kpool, r = [1, 3, 16, 33, 70], 4, 32
    dt = torch.float32 if device.type == "cpu" else torch.bfloat16  # fp32 + sel: not on sm90 (sparse_mla)
    meta, num_pages = decode_meta(lens, device, seed=2)
    sel = random_sel([n // kpool for n in lens], 6, g, odd=True).to(device)
    cache = torch.randn(num_pages, PAGE, r, generator=g).to(device, dt)
    q_abs = torch.randn(len(lens), 4, r, generator=g).to(device, dt)
    token_idx, num = build_decode_token_idx(sel, meta, kpool, with_tail)
    want = sparse_mla_decode(q_abs, cache, token_idx, 0.3, num)
    for splits in (1, 3):
        out = torch.full_like(q_abs, float("nan"))
        sparse_mla_decode_sel(q_abs, cache, sel, meta, kpool, 0.3, with_tail, out=out, num_splits=splits)
        assert _rel(out, want) < (1e-5 if dt == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("r", [32, 64])
@pytest.mark.parametrize("lens", [[37], [5, 64, 19, 100, 2]])
def test_sparse_mla_op_matches_reference(device, dtype, r, lens):
    kpool, topk = 4, 5
    meta, cache, q, w_kc, w_vc = mla_inputs(lens, r, dtype, device, seed=r + len(lens))
    sel = random_sel([n // kpool for n in lens], topk, generator(3), odd=len(lens) > 1).to(device)
    out = h200_ops().sparse_mla(q, cache, w_kc, w_vc, sel, meta, kpool, 0.25, True)
    assert out.shape == (len(lens), 4, 16) and out.dtype == dtype
    # truth: the reference on the same (rounded) values in float64
    d = torch.float64
    truth = ReferenceOps().sparse_mla(q.to(d), cache.to(d), w_kc.to(d), w_vc.to(d), sel, meta, kpool, 0.25, True)
    assert _rel(out, truth) < _tol(dtype)
    ref = ReferenceOps().sparse_mla(q, cache, w_kc, w_vc, sel, meta, kpool, 0.25, True)
    assert _rel(out, ref) < (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_mla_fp8_latent_cache(device, dtype):
    """An fp8 (e4m3 + group scales) latent pool: the kernel widens the rows exactly as the
    reference dequantises them, and both stay within fp8 rounding of the unquantised cache."""
    from backends import kv_fp8
    kpool, topk, r = 4, 5, 256  # two 128-value scale groups per row
    lens = [5, 64, 19, 100, 2]
    meta, cache, q, w_kc, w_vc = mla_inputs(lens, r, dtype, device, seed=31)
    cache = cache * torch.linspace(0.01, 4, r, device=device, dtype=dtype)  # groups of different ranges
    rows = kv_fp8.quantize_rows(cache)
    assert rows.dtype == torch.uint8 and rows.shape[-1] == kv_fp8.row_bytes(r) == r + 8
    back = kv_fp8.dequantize_rows(rows, r, torch.float32)
    group_max = cache.float().view(*cache.shape[:-1], 2, 128).abs().amax(-1).repeat_interleave(128, -1)
    assert ((back - cache.float()).abs() <= group_max * 2.0 ** -4 + 1e-6).all()  # e4m3: 3 mantissa bits
    sel = random_sel([n // kpool for n in lens], topk, generator(4), odd=True).to(device)
    got = h200_ops().sparse_mla(q, rows, w_kc, w_vc, sel, meta, kpool, 0.25, True)
    ref = ReferenceOps().sparse_mla(q, rows, w_kc, w_vc, sel, meta, kpool, 0.25, True)
    empty = torch.isnan(ref).flatten(1).any(1)  # a query that sees no token (kernel: zeros)
    assert (got[empty] == 0).all()
    assert _rel(got[~empty], ref[~empty]) < (1e-5 if dtype == torch.float32 else 2e-2)
    full = ReferenceOps().sparse_mla(q, cache, w_kc, w_vc, sel, meta, kpool, 0.25, True)
    assert _rel(got, full) < 0.08
    # write_latent quantises into the pool
    pool = torch.zeros_like(rows)
    lat = torch.randn(len(lens), r, generator=generator(5)).to(device, dtype)
    ReferenceOps().write_latent(lat, pool, meta)
    flat = pool.view(-1, pool.shape[-1])[meta.out_loc]
    assert torch.equal(flat, kv_fp8.quantize_rows(lat))


def test_sparse_mla_dense_and_prefill(device):
    """sel=None (dense causal) on the kernel; a small prefill batch with a selection runs the
    per-token kernel path (dense causal prefill still defers to the reference exactly)."""
    ops, ref = h200_ops(), ReferenceOps()
    meta, cache, q, w_kc, w_vc = mla_inputs([9, 40, 23], 32, torch.float32, device, seed=5)
    out = ops.sparse_mla(q, cache, w_kc, w_vc, None, meta, 4, 0.25, True)
    assert _rel(out, ref.sparse_mla(q, cache, w_kc, w_vc, None, meta, 4, 0.25, True)) < 1e-5
    g = generator(9)
    pre = BatchMeta.build([0, 8], [5, 3], [0, 1], [[0], [1]], PAGE, device)
    qp = torch.randn(8, 4, 16, generator=g).to(device)
    sel = torch.tensor([[0, -1]] * 8, device=device)
    assert _rel(ops.sparse_mla(qp, cache, w_kc, w_vc, sel, pre, 4, 0.25, True),
                ref.sparse_mla(qp, cache, w_kc, w_vc, sel, pre, 4, 0.25, True)) < 1e-5
    assert torch.equal(ops.sparse_mla(qp, cache, w_kc, w_vc, None, pre, 4, 0.25, True),
                       ref.sparse_mla(qp, cache, w_kc, w_vc, None, pre, 4, 0.25, True))


# ---- prefill / mixed batches: one kernel row per query token -------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["mixed", "prefix"])
@pytest.mark.parametrize("token_list", ["kernel", "precomputed"])
def test_sparse_mla_prefill_matches_reference(device, dtype, case, token_list, monkeypatch):
    from backends.kernels import sparse_mla_prefill as smp

    monkeypatch.setattr(smp, "PREFILL_TOKEN_LIST", token_list)
    if device.type == "cuda" and dtype == torch.float32 and token_list == "kernel":
        pytest.skip("fp32 prefill on the GPU with the in-kernel token list stays on the reference")
    kpool, topk, r = 4, 3, 32
    reqs = PREFILL_CASES[case]
    meta, cache, q, w_kc, w_vc = prefill_mla_inputs(reqs, r, dtype, device, seed=90 + len(case))
    sel = prefill_sel(meta, kpool, topk + 1, generator(91))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    ref = ReferenceOps().sparse_mla(q, cache, w_kc, w_vc, sel, meta, kpool, 0.25, True)
    out = h200_ops().sparse_mla(q, cache, w_kc, w_vc, sel, meta, kpool, 0.25, True)
    assert out.shape == ref.shape and out.dtype == dtype

    def check(out, ref):  # a query that sees no token: NaN in the reference, zeros from the kernel
        empty = torch.isnan(ref).flatten(1).any(1)
        assert (out[empty] == 0).all()
        assert _rel(out[~empty], ref[~empty]) < tol

    check(out, ref)
    if case == "mixed":  # several row chunks
        check(smp.sparse_mla_prefill(q, cache, w_kc, w_vc, sel, meta, kpool, 0.25, True, chunk_rows=16), ref)
    else:  # no tail (only pools complete at each token: the indexer's choices)
        vis = prefill_sel(meta, kpool, topk, generator(92), visible_only=True)
        ref = ReferenceOps().sparse_mla(q, cache, w_kc, w_vc, vis, meta, kpool, 0.25, False)
        check(h200_ops().sparse_mla(q, cache, w_kc, w_vc, vis, meta, kpool, 0.25, False), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_mla_prefill_fp8_latent_cache(device, dtype):
    from backends import kv_fp8
    kpool, topk, r = 4, 3, 256
    meta, cache, q, w_kc, w_vc = prefill_mla_inputs(PREFILL_CASES["mixed"], r, dtype, device, seed=95)
    cache = cache * torch.linspace(0.01, 4, r, device=device, dtype=dtype)
    rows = kv_fp8.quantize_rows(cache)
    sel = prefill_sel(meta, kpool, topk, generator(96), visible_only=True)
    got = h200_ops().sparse_mla(q, rows, w_kc, w_vc, sel, meta, kpool, 0.25, True)
    ref = ReferenceOps().sparse_mla(q, rows, w_kc, w_vc, sel, meta, kpool, 0.25, True)
    empty = torch.isnan(ref).flatten(1).any(1)  # a query that sees no token (kernel: zeros)
    assert (got[empty] == 0).all()
    assert _rel(got[~empty], ref[~empty]) < (1e-5 if dtype == torch.float32 else 2e-2)


# ---- full-size shapes, GPU only ------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("b", [1, 7])
def test_full_size_decode_gpu(b):
    """H 64, R 512, 2063 selected tokens (128 pools + 15 tail) in bf16, and the indexer at 32x128."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(b)
    h, r, k, num_pages = 64, 512, 2063, 512
    cache = torch.randn(num_pages, 64, r, device=dev, generator=g).bfloat16()
    q_abs = torch.randn(b, h, r, device=dev, generator=g).bfloat16()
    idx = torch.randint(0, num_pages * 64, (b, k), device=dev, generator=g, dtype=torch.int32)
    out = torch.full((b, h, r), float("nan"), device=dev, dtype=torch.bfloat16)
    sparse_mla_decode(q_abs, cache, idx, 1 / 16, out=out)
    assert _rel(out, torch_decode(q_abs, cache.view(-1, r), idx, 1 / 16)) < 1e-2
    kpool, topk = 16, 128
    lens = [4096 + 977 * i for i in range(b)]
    meta, num_pages = decode_meta(lens, dev, seed=b)
    pooled = torch.randn(num_pages, PAGE // kpool, 128, device=dev, generator=g).bfloat16()
    q = torch.randn(b, 32, 128, device=dev, generator=g).bfloat16()
    w = torch.randn(b, 32, device=dev, generator=g) * 32 ** -0.5
    assert torch.equal(indexer_select(q, w, pooled, meta, kpool, topk),
                       ReferenceOps().indexer_select(q, w, pooled, meta, kpool, topk))


@pytest.mark.parametrize("with_tail", [True, False])
def test_prefill_rows_kernel_reads_each_rows_request_pages(device, with_tail):
    """build_prefill_token_idx (the rows kernel with a request per query row) lists, for every
    query token, exactly the token set of the torch-op list at its position and its request's
    pages (that list equals the reference mask: test_token_idx_equals_reference_mask)."""
    from backends.kernels.sparse_mla_rows import _token_rows, build_prefill_token_idx

    g = generator(29)
    lens, kpool = [1, 3, 16, 33, 70], 4
    meta, _ = decode_meta(lens, device, seed=5)
    rows = [(r, p) for r, n in enumerate(lens) for p in range(max(0, n - 3), n)]  # each request's last 3 positions
    req = torch.tensor([r for r, _ in rows], device=device)
    pos = torch.tensor([p for _, p in rows], device=device)
    sel = random_sel([(p + 1) // kpool for _, p in rows], 6, g, odd=True).to(device)
    idx, num = build_prefill_token_idx(sel, pos, req, meta.page_table, meta.page_size, kpool, with_tail)
    k = 6 * kpool + (kpool - 1 if with_tail else 0)
    assert idx.shape == (len(rows), k) and num.dtype == torch.int32
    want_idx, want_num = _token_rows(sel, pos, meta.page_table[req], meta.page_size, kpool, with_tail, 0)
    for b in range(len(rows)):
        got = idx[b, : int(num[b])].tolist()
        want = want_idx[b, : int(want_num[b])].tolist()
        assert sorted(got) == sorted(want) and len(set(got)) == len(got), rows[b]
