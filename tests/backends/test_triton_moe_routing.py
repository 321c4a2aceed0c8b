"""The fused MoE's routing side against the reference: the expert alignment (moe_align and its
launch modes), the block bound, the config tables, the tile fitting, and the router kernel
(backends/kernels/moe_route.py).

Without CUDA the kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1 is set
before Triton is imported); with CUDA the same tests run compiled (the "cuda" parameter).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from backends.cuda_h200 import CudaH200Ops  # noqa: E402
from backends.kernels import fused_moe as fm  # noqa: E402
from backends.kernels import moe_align as ma  # noqa: E402
from tests.backends.conftest import gen as _gen, rel as _rel  # noqa: E402
from tests.backends.moe_problems import FP8, REF  # noqa: E402


# ---- alignment --------------------------------------------------------------------------------
@pytest.mark.parametrize("n,k,e,bm,mode", [
    (1, 8, 288, 16, None), (33, 4, 16, 16, None), (33, 4, 16, 16, "three-launch"),
    (300, 3, 8, 32, "one-program"), (300, 3, 8, 32, "three-launch"), (70, 2, 5, 64, None),
    (64, 8, 288, 16, None),            # batch 64 at the real shape: 36 programs, tail blocks grid-stride
    (128, 8, 288, 16, "one-program"),  # the largest one-launch size, both one-launch forms
    (128, 8, 288, 16, "parallel"), (40, 3, 21, 16, "parallel"),  # E not a multiple of the experts per program
    (1500, 3, 8, 16, None),            # 36 chunks: the scan's loops take several tiles
])
def test_align(device, n, k, e, bm, mode):
    g = _gen("align", n, k, e, bm, mode)
    ids = torch.randint(0, e, (n, k), generator=g)           # repeats within a token too
    ids[torch.rand(n, k, generator=g) < 0.1] = -1             # dropped pairs
    if n > 50:
        ids[: n // 2] = 1                                     # one hot expert across chunks
    sorted_ids, be, br = (t.cpu() for t in ma.moe_align(ids.to(device), e, bm, mode=mode))
    nb = ma.max_blocks(n * k, e, bm)
    assert be.shape == (nb,) and br.shape == (nb,) and sorted_ids.shape == (nb * bm,)
    flat = ids.flatten()
    counts = torch.bincount(flat[flat >= 0], minlength=e)
    used = int((-(-counts // bm)).sum())
    assert (be[used:] == -1).all() and (br[used:] == 0).all()
    seen = []
    for ex in range(e):
        blocks = (be[:used] == ex).nonzero().flatten()
        assert len(blocks) == -(-int(counts[ex]) // bm)
        if len(blocks):
            assert (blocks == torch.arange(int(blocks[0]), int(blocks[0]) + len(blocks))).all()  # contiguous
            rows = torch.cat([sorted_ids[b * bm: b * bm + int(br[b])] for b in blocks.tolist()])
            assert len(rows) == counts[ex] and (flat[rows.long()] == ex).all()
            assert (rows[1:] > rows[:-1]).all()               # token order within an expert
            seen.append(rows)
    assert sorted(torch.cat(seen).tolist()) == (flat >= 0).nonzero().flatten().tolist()


def test_align_modes_agree_and_refuse(device):
    """The one-launch forms give the three-launch layout exactly (real rows and block table);
    a one-launch mode past its size is refused, not silently wrong."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 288, (96, 8), generator=g).to(device)
    outs = {mode: ma.moe_align(ids, 288, 16, mode=mode) for mode in ma.ALIGN_MODES}
    base_sorted, base_be, base_br = (t.cpu() for t in outs["three-launch"])
    real = torch.cat([torch.arange(b * 16, b * 16 + int(r)) for b, r in enumerate(base_br.tolist()) if r > 0])
    for mode, (srt, be, br) in outs.items():
        assert torch.equal(be.cpu(), base_be) and torch.equal(br.cpu(), base_br), mode
        assert torch.equal(srt.cpu()[real], base_sorted[real]), mode
    with pytest.raises(ValueError, match="one launch up to"):
        ma.moe_align(torch.zeros(ma.ONE_LAUNCH_MAX_PAIRS + 1, 1, dtype=torch.int64, device=device), 8, 16,
                     mode="parallel")


def test_max_blocks_bound():
    g = _gen("bound")
    for _ in range(200):
        e = int(torch.randint(1, 300, (1,), generator=g))
        m = int(torch.randint(1, 2000, (1,), generator=g))
        bm = [16, 32, 64, 128][int(torch.randint(0, 4, (1,), generator=g))]
        counts = torch.bincount(torch.randint(0, e, (m,), generator=g), minlength=e)
        assert int((-(-counts // bm)).sum()) <= ma.max_blocks(m, e, bm)
    assert ma.max_blocks(8, 288, 16) == 8  # decode, top-8: one block per routed expert


def test_config_table():
    prev = 0
    for lim, cfg in fm.CONFIGS:
        assert lim > prev
        prev = lim
        for part in ("gate_up", "down"):
            c = cfg[part]
            # tiles inside a 128x128 block, or whole blocks (one scale per column, were they fp8)
            assert (128 % c["BLOCK_N"] == 0 or c["BLOCK_N"] % 128 == 0) and 128 % c["BLOCK_K"] == 0
    assert fm.get_config(1)["BLOCK_M"] == 16 and fm.get_config(16384)["BLOCK_M"] >= 64
    prev = 0
    for lim, cfg in fm.FP8_CONFIGS:  # its own table; same row limits as CONFIGS' decode rows
        assert lim > prev
        prev = lim
        for part in ("gate_up", "down"):
            c = cfg[part]
            assert {"BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages"} <= set(c)
    for n in (1, 16, 64, 128, 4096, 16384):
        want = next(c for lim, c in fm.FP8_CONFIGS if n <= lim)
        assert fm.get_config(n, torch.bfloat16, FP8) == want
        assert fm.get_config(n, torch.bfloat16, FP8) is not want                  # a copy
        assert fm.get_config(n) == fm.get_config(n, torch.bfloat16, torch.bfloat16)  # bf16: CONFIGS
        assert fm.get_config(n) == next(c for lim, c in fm.CONFIGS if n <= lim)


def test_tiles_shrink_until_they_fit():
    """A tile whose shared memory the device lacks is retried with fewer stages, then a narrower K
    tile (per-element dequant stays per element), and the fitted tile is remembered."""
    from triton.runtime.errors import OutOfResources

    launches = []

    class Kernel:  # stands in for a compiled kernel: "fits" at BLOCK_K <= 64 and one stage
        def __getitem__(self, grid):
            def launch(*args, BLOCK_K, num_stages, SCALE_ACC, **meta):
                launches.append((BLOCK_K, num_stages, SCALE_ACC, grid))
                if BLOCK_K > 64 or num_stages > 1:
                    raise OutOfResources(300000, 232448, "shared memory")
            return launch

    k = Kernel()
    c = dict(BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=3)
    meta = dict(FP8=True, SWAP_AB=False, SCALE_BK=128)
    fm._launch_fitting(k, lambda c: (c["BLOCK_N"],), (), meta, c, 320, False)
    assert launches[-1] == (64, 1, False, (32,))
    assert [x[:2] for x in launches] == [(256, 3), (256, 2), (256, 1), (128, 3), (128, 2), (128, 1), (64, 3),
                                         (64, 2), (64, 1)]
    launches.clear()
    fm._launch_fitting(k, lambda c: (c["BLOCK_N"],), (), meta, c, 320, False)
    assert launches == [(64, 1, False, (32,))]  # remembered

    class Never:  # fits nowhere: the error surfaces once the smallest tile fails
        def __getitem__(self, grid):
            def launch(**meta):
                raise OutOfResources(300000, 232448, "shared memory")
            return lambda *a, **m: launch(**m)

    with pytest.raises(OutOfResources):
        fm._launch_fitting(Never(), lambda c: (1,), (), meta, dict(c, BLOCK_K=32), 320, False)


# ---- the router -------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,d,e,k,norm,dtype", [
    (1, 256, 288, 8, True, torch.bfloat16),      # decode, the real expert count and top-k
    (37, 192, 288, 8, True, torch.bfloat16),     # several token blocks, D not a multiple of the K tile
    (20, 128, 64, 6, False, torch.float32),      # fp32 model, no renormalisation
    (3, 64, 16, 16, True, torch.bfloat16),       # k == E: every expert, in choice order
    (1, 4096, 288, 8, True, torch.bfloat16),     # the real width: 8 K splits summed by the selection
    (70, 1000, 288, 8, True, torch.bfloat16),    # 2 token blocks, 8 splits, the last one short
])
def test_moe_route_matches_reference(device, n, d, e, k, norm, dtype):
    from backends.kernels.moe_route import moe_route, supported

    g = _gen("route", n, d, e, k, norm, str(dtype))
    x = torch.randn(n, d, generator=g).to(dtype)
    w = (torch.randn(e, d, generator=g) * d ** -0.5).to(dtype)
    bias = torch.randn(e, generator=g) * 0.05
    ref_w, ref_ids = REF.moe_route(x, w, bias, k, 1, 1, norm, 2.5)
    x, w, bias = x.to(device), w.to(device), bias.to(device)
    assert supported(x, w, bias, k, 1)
    got_w, got_ids = moe_route(x, w, bias, k, norm, 2.5)
    assert got_ids.dtype == torch.long and got_w.dtype == torch.float32
    # same experts in the same (descending choice) order; weights to fp32 rounding
    assert torch.equal(got_ids.cpu(), ref_ids)
    assert _rel(got_w, ref_w) < 1e-5


@pytest.mark.parametrize("n,e,k,n_group,topk_group,dtype", [
    (1, 8, 2, 2, 1, torch.float32),      # the shipped tiny model's router
    (5, 8, 2, 2, 1, torch.bfloat16),
    (3, 256, 8, 8, 4, torch.bfloat16),   # DeepSeek-V3's grouping
    (4, 96, 6, 3, 2, torch.float32),     # a group count that is not a power of two
])
def test_moe_route_groups_match_reference(device, n, e, k, n_group, topk_group, dtype):
    """Group-limited routing in the selection launch: the experts of the reference's kept groups,
    in its order (groups scored by their two best choices)."""
    from backends.kernels.moe_route import moe_route, supported

    d = 64
    g = _gen("groups", n, e, k, n_group, topk_group, str(dtype))
    x = torch.randn(n, d, generator=g).to(dtype)
    w = (torch.randn(e, d, generator=g) * d ** -0.5).to(dtype)
    bias = torch.randn(e, generator=g) * 0.05
    ref_w, ref_ids = REF.moe_route(x, w, bias, k, n_group, topk_group, True, 2.5)
    x, w, bias = x.to(device), w.to(device), bias.to(device)
    assert supported(x, w, bias, k, n_group, topk_group)
    got_w, got_ids = moe_route(x, w, bias, k, True, 2.5, n_group=n_group, topk_group=topk_group)
    assert torch.equal(got_ids.cpu(), ref_ids)
    assert _rel(got_w, ref_w) < 1e-5
    ops_w, ops_ids = CudaH200Ops().moe_route(x, w, bias, k, n_group, topk_group, True, 2.5)
    assert torch.equal(ops_ids.cpu(), ref_ids)


def test_moe_route_ties_and_fallbacks(device):
    """Equal choices go to the lower id; mixed dtypes and groups of one expert take the reference."""
    from backends.kernels.moe_route import moe_route, supported

    x = torch.ones(2, 32, dtype=torch.bfloat16, device=device)
    w = torch.zeros(8, 32, dtype=torch.bfloat16, device=device)   # every logit 0: a full tie
    bias = torch.zeros(8, device=device)
    wts, ids = moe_route(x, w, bias, 3, True, 1.0)
    assert ids.tolist() == [[0, 1, 2], [0, 1, 2]]
    assert torch.allclose(wts.cpu(), torch.full((2, 3), 1 / 3))
    assert supported(x, w, bias, 3, 2, 1)                         # two groups of four
    assert not supported(x, w, bias, 3, 8, 2)                     # groups of one expert
    assert not supported(x, w.float(), bias, 3, 1)                # bf16 tokens with an fp32 router
    ops = CudaH200Ops()
    gw, gids = ops.moe_route(x, w, bias, 3, 2, 1, True, 1.0)     # full tie: group 0, its lowest ids
    rw, rids = REF.moe_route(x.cpu(), w.cpu(), bias.cpu(), 3, 2, 1, True, 1.0)
    assert _rel(gw, rw) < 1e-6 and gids.tolist() == [[0, 1, 2], [0, 1, 2]] and gids.shape == rids.shape
