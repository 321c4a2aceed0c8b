"""The cuda-h200 RMSNorm and mHC Triton kernels against ReferenceOps.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1 is set
before Triton is imported); with CUDA the same tests run compiled (the "cuda" parameter).
Fresh random inputs per check, outputs NaN-poisoned first and checked fully written; bounds
(tests/backends/conftest.py): fp32 ~1e-5 relative, bf16 ~1e-2 relative.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from backends.reference import ReferenceOps  # noqa: E402
from backends.kernels.mhc import _SPLIT_TILE, _block_m, mhc_pre  # noqa: E402
from backends.kernels.mhc_post import mhc_post  # noqa: E402
from backends.kernels.norms import add_rms_norm, gated_rms_norm, l2norm, rms_norm, rms_norm_pair  # noqa: E402

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
from tests.backends.conftest import gen as _gen, rel as _rel, tol as _tol  # noqa: E402

REF = ReferenceOps()



def _nan(shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


# ---- RMSNorm ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (7, 96), (2, 3, 80)])
@pytest.mark.parametrize("block_d", [None, 32])
def test_rms_norm(device, dtype, shape, block_d):
    g = _gen("rms", str(dtype), shape, block_d)
    x = (torch.randn(shape, generator=g) * 3).to(dtype).to(device)
    w = (1 + 0.5 * torch.randn(shape[-1], generator=g)).to(device)        # fp32 weight, cast inside
    ref = REF.rms_norm(x.cpu(), w.cpu(), 1e-6)
    out = _nan(shape, dtype, device)
    res = rms_norm(x, w, 1e-6, out=out, block_d=block_d)
    assert res is out and out.dtype == dtype
    assert _rel(out, ref) < _tol(dtype)
    out2 = rms_norm(x, w.to(dtype), 1e-6)                                  # weight in the model dtype
    assert _rel(out2, REF.rms_norm(x.cpu(), w.to(dtype).cpu(), 1e-6)) < _tol(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 6])
def test_the_draft_layers_fused_norms(device, dtype, rows):
    """add_rms_norm (a residual add with the next norm) and rms_norm_pair (two norms joined) give
    the reference's values: the sum rounded as torch rounds it, each half normed on its own."""
    g = _gen("fused-norms", str(dtype), rows)
    d = 96
    x, r, b = ((torch.randn(rows, d, generator=g) * 3).to(dtype) for _ in range(3))
    w, wb = ((1 + 0.5 * torch.randn(d, generator=g)).to(dtype) for _ in range(2))
    want_s, want_y = REF.add_rms_norm(x, r, w, 1e-6)
    s, y = add_rms_norm(x.to(device), r.to(device), w.to(device), 1e-6)
    assert torch.equal(s.cpu(), want_s)  # the add: one rounding of the fp32 sum, as torch's
    assert _rel(y, want_y) < _tol(dtype)
    wide = torch.randn(rows, 2 * d, generator=g).to(dtype)  # b as a column slice: strided rows
    want = REF.rms_norm_pair(x, w, wide[:, d:], wb, 1e-6)
    got = rms_norm_pair(x.to(device), w.to(device), wide.to(device)[:, d:], wb.to(device), 1e-6)
    assert got.shape == (rows, 2 * d) and _rel(got, want) < _tol(dtype)
    assert _rel(got[:, d:], REF.rms_norm(wide[:, d:], wb, 1e-6)) < _tol(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,m,d", [(1, 4, 96), (6, 4, 200), (3, 2, 64)])
def test_stream_mean_rms_norm(device, dtype, rows, m, d, monkeypatch):
    """The model's final norm of the mHC streams' mean in one launch: the reference's mean (fp32
    sum rounded to the model dtype) and RMSNorm; for bf16 bit for bit (a sum of a few bf16 values
    is exact in fp32, and the norm is the one-pass kernel's); through the ops too, also on a
    strided stream view."""
    from backends.cuda_h200 import CudaH200Ops
    from backends.kernels.norms import stream_mean_rms_norm
    from backends.kernels import norms
    g = _gen("stream-mean-norm", str(dtype), rows, m, d)
    wide = (torch.randn(rows, m + 1, d + 8, generator=g) * 3).to(dtype)
    streams = wide[:, 1:, :d]  # a view: rows M + 1 streams apart, streams D + 8 apart
    w = (1 + 0.5 * torch.randn(d, generator=g)).to(dtype)
    want = REF.stream_mean_rms_norm(streams, w, 1e-6)
    assert _rel(want, REF.rms_norm(streams.float().mean(dim=1).to(dtype), w, 1e-6)) == 0.0
    got = stream_mean_rms_norm(streams.to(device), w.to(device), 1e-6)
    assert got.shape == (rows, d) and got.dtype == dtype and not torch.isnan(got).any()
    if dtype == torch.bfloat16:
        assert torch.equal(got.cpu(), want)
    assert _rel(got, want) < _tol(dtype)
    calls = []
    monkeypatch.setattr(norms, "stream_mean_rms_norm", lambda *a: calls.append(1) or stream_mean_rms_norm(*a))
    via_ops = CudaH200Ops().stream_mean_rms_norm(streams.to(device), w.to(device), 1e-6)
    assert calls == [1] and _rel(via_ops, want) < _tol(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("limit", [None, 1.5])
def test_swiglu_matches_the_reference(device, dtype, limit):
    """The dense MLP's activation on the two column halves of the fused gate/up product (strided
    rows, a width past one block), equal to the reference's four launches up to silu's exp."""
    from backends.kernels.swiglu import swiglu
    g = _gen("swiglu", str(dtype), limit)
    gate_up = (torch.randn(5, 2 * 1100, generator=g) * 3).to(dtype)
    gate, up = gate_up[:, :1100], gate_up[:, 1100:]
    want = REF.swiglu(gate, up, limit)
    on = gate_up.to(device)
    got = swiglu(on[:, :1100], on[:, 1100:], limit)
    assert got.shape == want.shape and got.is_contiguous()
    assert _rel(got, want) < (1e-6 if dtype == torch.float32 else 4e-3)
    if limit is not None:
        assert float(got.float().abs().max()) <= limit * limit + 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 4, 128), (37, 3, 64), (5, 100)])
def test_l2norm_matches_fla_formula(device, dtype, shape):
    """KDA's q/k l2norm before chunk_kda: x / sqrt(Σx² + eps) in fp32, as fla's l2norm_fwd
    (which chunk_kda would otherwise run itself, autotuning per 1024 batch tokens); a strided
    view (q out of the fused projection) reads right."""
    g = _gen("l2", dtype, shape)
    base = torch.randn(*shape[:-1], 2 * shape[-1], generator=g).to(dtype)
    x = base[..., : shape[-1]]  # rows with a gap: not contiguous
    xf = x.float()
    ref = (xf / torch.sqrt((xf * xf).sum(-1, keepdim=True) + 1e-6)).to(dtype)
    out = l2norm(x.to(device))
    assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous()
    assert _rel(out, ref) < (1e-6 if dtype == torch.float32 else 4e-3)


# ---- gated RMSNorm (KDA output norm) ---------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64, 128), (5, 3, 128), (37, 96), (2, 1000)])
def test_gated_rms_norm(device, dtype, shape):
    g = _gen("gated", str(dtype), shape)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    gate = (torch.randn(shape, generator=g) * 2).to(dtype)
    w = (1 + 0.5 * torch.randn(shape[-1], generator=g)).to(dtype)
    ref = REF.gated_rms_norm(x, gate, w, 1e-5)
    out = _nan(shape, dtype, device)
    res = gated_rms_norm(x.to(device), gate.to(device), w.to(device), 1e-5, out=out)
    assert res is out and out.dtype == dtype
    assert _rel(out, ref) < (1e-6 if dtype == torch.float32 else _tol(dtype))
    # non-contiguous gate (a view), fp32 weight: same values
    wide = torch.cat([gate, gate], dim=-1).to(device)
    res2 = gated_rms_norm(x.to(device), wide[..., :shape[-1]], w.float().to(device), 1e-5)
    assert _rel(res2, REF.gated_rms_norm(x, gate, w.float(), 1e-5)) < (1e-6 if dtype == torch.float32 else _tol(dtype))


def test_gated_rms_norm_through_the_ops():
    """CudaH200Ops takes the kernel for the KDA shapes and the reference for rows it does not take."""
    from backends.cuda_h200 import CudaH200Ops
    from backends.kernels import norms

    ops = CudaH200Ops()
    ops.fused_small_ops = True
    g = _gen("gated-ops")
    x, gate = torch.randn(3, 4, 128, generator=g), torch.randn(3, 4, 128, generator=g)
    w = torch.rand(128, generator=g) + 0.5
    assert norms.gated_supported(x, gate, w) and not norms.gated_supported(torch.randn(2, 2048), torch.randn(2, 2048),
                                                                          torch.ones(2048))
    assert _rel(ops.gated_rms_norm(x, gate, w, 1e-5), REF.gated_rms_norm(x, gate, w, 1e-5)) < 1e-6
    y = torch.randn(2, 2048, generator=g)
    assert torch.equal(ops.gated_rms_norm(y, y, torch.ones(2048), 1e-5), REF.gated_rms_norm(y, y, torch.ones(2048), 1e-5))


# ---- mHC pre ------------------------------------------------------------------------------------
def _hc_params(m, d, g, dtype=torch.float32):
    fn = torch.randn((2 + m) * m, m * d, generator=g) * (m * d) ** -0.5
    base = torch.randn((2 + m) * m, generator=g) * 0.5
    scale = 0.5 + torch.rand(3, generator=g)
    return fn.to(dtype), base.to(dtype), scale.to(dtype)


def _check_pre(device, dtype, m, d, n, iters, split, param_dtype=torch.float32, hc_eps=1e-6):
    g = _gen("pre", str(dtype), m, d, n, iters, split, str(param_dtype))
    streams = torch.randn(n, m, d, generator=g).to(dtype)
    fn, base, scale = _hc_params(m, d, g, param_dtype)
    ref = REF.mhc_pre(streams, fn, base, scale, iters, hc_eps, 1e-6)
    out = (_nan((n, m), torch.float32, device), _nan((n, m, m), torch.float32, device), _nan((n, d), dtype, device))
    res = mhc_pre(streams.to(device), fn.to(device), base.to(device), scale.to(device), iters, hc_eps, 1e-6,
                  split=split, out=out)
    assert all(a is b for a, b in zip(res, out))
    post, comb, u = out
    # post and comb are fp32 functions of the streams in either dtype: fp32 bounds
    assert _rel(post, ref[0]) < 1e-5
    assert _rel(comb, ref[1]) < 1e-5
    assert u.dtype == dtype and _rel(u, ref[2]) < _tol(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [3, 4])
@pytest.mark.parametrize("d", [64, 96])
@pytest.mark.parametrize("n", [1, 7])
@pytest.mark.parametrize("iters", [1, 3, 20])
def test_mhc_pre(device, dtype, m, d, n, iters):
    # alternate the fused single launch and the split-K launch over the grid of cases
    split = 1 if (m + d // 32 + n + iters) % 2 else 3
    _check_pre(device, dtype, m, d, n, iters, split)


@pytest.mark.parametrize("split", [1, 2, None])
def test_mhc_pre_splits(device, split):
    _check_pre(device, torch.bfloat16, 4, 96, 7, 20, split)


@pytest.mark.parametrize("n,split", [(1, None), (3, 12)])
def test_mhc_pre_many_splits(device, n, split):
    """Decode shapes: tens of K splits (32 by the heuristic; 12 asked gives 11, not a power of
    two), all summed by the epilogue in one masked load."""
    _check_pre(device, torch.bfloat16, 4, 1024, n, 20, split)


@pytest.mark.parametrize("m,d,n", [(4, 2048, 1), (4, 4096, 3), (3, 1100, 1), (8, 1100, 2)])
def test_mhc_pre_split_d_tiles(device, m, d, n):
    """The split epilogue's 2-D grid (tokens x D tiles): several D tiles per token (the last one
    partial where D is no multiple of the tile), post/comb from the D-tile-0 programs only; the
    heuristic's tens of K splits."""
    assert triton.cdiv(d, max(32, _SPLIT_TILE // _block_m(m))) >= 2
    _check_pre(device, torch.bfloat16, m, d, n, 20, None)


@pytest.mark.parametrize("n", [1, 20])
def test_mhc_pre_decode_tf32x3(device, monkeypatch, n):
    """The decode (split) mix on tensor cores (mhc.DECODE_PRECISION = "tf32x3", as the prefill
    path already runs) holds the same bound as the fp32 FMAs."""
    from backends.kernels import mhc
    monkeypatch.setattr(mhc, "DECODE_PRECISION", "tf32x3")
    _check_pre(device, torch.bfloat16, 4, 1024, n, 20, None)


def test_mhc_pre_prefill_size(device, monkeypatch):
    """From 1024 tokens with PREFILL_MIX_K 0: one launch of 64-token blocks with tf32x3 products,
    still fp32-accurate."""
    from backends.kernels import mhc
    monkeypatch.setattr(mhc, "PREFILL_MIX_K", 0)
    _check_pre(device, torch.bfloat16, 4, 32, 1100, 20, None)


def test_mhc_pre_prefill_mix_k(device, monkeypatch):
    """Prefill sizes split K into pieces of at most PREFILL_MIX_K even where the 128-token blocks
    alone would fill the chip (here 2 "SMs"): the mixing grid is (blocks, M·D / PREFILL_MIX_K)."""
    from backends.kernels import mhc
    grids = []
    mix = mhc._mhc_mix_kernel

    class Recording:
        def __getitem__(self, grid):
            grids.append(grid)
            return mix[grid]

    monkeypatch.setattr(mhc, "_mhc_mix_kernel", Recording())
    monkeypatch.setattr(mhc, "_NUM_SMS_GUESS", 2)
    monkeypatch.setattr(mhc, "PREFILL_MIX_K", 1024)
    n = 1100
    if device.type == "cpu":
        monkeypatch.setattr(mhc, "_LARGE_N", 64)
        n = 70
    _check_pre(device, torch.bfloat16, 4, 1024, n, 20, None)
    assert grids == [(-(-n // 128), 4)]


def test_mhc_pre_prefill_split_k(device, monkeypatch):
    """Prefill sizes with too few 128-token blocks to fill the chip (here 9) split K: 128-token
    mixing blocks, the per-token epilogue, PREFILL_PRECISION products. The interpreter runs its
    programs one by one: there prefill sizes start at 64 tokens, and 70 take the same path (one
    partly filled 128-token block)."""
    n = 1100
    if device.type == "cpu":
        from backends.kernels import mhc
        monkeypatch.setattr(mhc, "_LARGE_N", 64)
        n = 70
    _check_pre(device, torch.bfloat16, 4, 1024, n, 20, None)


@pytest.mark.parametrize("n", [1, 20, 1100])
def test_mhc_pre_bf16x3(device, monkeypatch, n):
    """bf16x3 products (fn split in three bf16 parts, the bf16 streams as they are) hold the fp32
    bound, in the split (decode) and the one-launch (prefill) paths; fp32 streams fall back to
    tf32x3."""
    from backends.kernels import mhc
    monkeypatch.setattr(mhc, "DECODE_PRECISION", "bf16x3")
    monkeypatch.setattr(mhc, "PREFILL_PRECISION", "bf16x3")
    _check_pre(device, torch.bfloat16, 4, 32 if n > 1000 else 1024, n, 20, None)
    if n == 20:
        _check_pre(device, torch.float32, 4, 64, n, 20, None)


@pytest.mark.parametrize("m", [1, 2, 8])
def test_mhc_pre_other_m(device, m):
    _check_pre(device, torch.float32, m, 32, 5, 20, None)


def test_mhc_pre_bf16_params_zero_eps(device):
    """HF keeps fn/base/scale in the model dtype (rounded): used in fp32 all the same; hc_eps 0."""
    _check_pre(device, torch.bfloat16, 4, 64, 7, 20, 1, param_dtype=torch.bfloat16, hc_eps=0.0)


def test_mhc_pre_many_tokens(device):
    """More than one 16-token block (both launch shapes)."""
    for split in (1, 2):
        _check_pre(device, torch.bfloat16, 4, 64, 37, 20, split)


# ---- mHC post -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [3, 4])
@pytest.mark.parametrize("d", [64, 96])
@pytest.mark.parametrize("n", [1, 7])
def test_mhc_post(device, dtype, m, d, n):
    g = _gen("post", str(dtype), m, d, n)
    streams = torch.randn(n, m, d, generator=g).to(dtype)
    y = torch.randn(n, d, generator=g).to(dtype)
    post = 2 * torch.rand(n, m, generator=g)
    comb = torch.rand(n, m, m, generator=g)
    comb = comb / comb.sum(-2, keepdim=True)
    ref = REF.mhc_post(y, streams, post, comb)
    out = _nan((n, m, d), dtype, device)
    res = mhc_post(y.to(device), streams.to(device), post.to(device), comb.to(device), out=out,
                   block_d=32 if d == 96 else None)
    assert res is out and out.dtype == dtype
    assert _rel(out, ref) < _tol(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mhc_post_sums_moe_partials(device, dtype):
    """mhc_post taking an MoE's unsummed rows (MoEPartials: the fused MoE's reduce=False) sums
    them as the MoE's own sum launch does (fp32, one rounding; pairs with ids outside [0, E)
    count as zero even where their rows hold garbage): the same bits as summing first, and
    CudaH200Ops.mhc_post takes the partials on both the kernel and the reference path."""
    from backends.cuda_h200 import CudaH200Ops
    from backends.reference import MoEPartials

    g = _gen("post-partials", str(dtype))
    n, m, d, k, e = 5, 4, 96, 3, 6
    streams = torch.randn(n, m, d, generator=g).to(dtype)
    y = torch.randn(n, k, d, generator=g).to(dtype)
    ids = torch.randint(0, e, (n, k), generator=g)
    ids[1, 2], ids[3, 0] = -1, e                        # dropped pairs
    y[1, 2], y[3, 0] = float("nan"), float("inf")       # their rows are never written: anything
    post = 2 * torch.rand(n, m, generator=g)
    comb = torch.rand(n, m, m, generator=g)
    comb = comb / comb.sum(-2, keepdim=True)
    parts = MoEPartials(y.to(device), ids.to(device), e)
    summed = parts.reduce()
    assert not torch.isnan(summed).any() and not torch.isinf(summed).any()
    dev = [t.to(device) for t in (streams, post, comb)]
    fused = mhc_post(parts.y, dev[0], dev[1], dev[2], ids=parts.ids, num_experts=e, block_d=32)
    first = mhc_post(summed, dev[0], dev[1], dev[2], block_d=32)
    if dtype == torch.bfloat16 or _INTERPRET:
        assert torch.equal(fused.cpu(), first.cpu())
    else:  # compiled fp32: the compiler may contract the two kernels' products differently (H200: 1 ulp)
        assert _rel(fused, first) < 1e-6
    ops = CudaH200Ops()
    assert torch.equal(ops.mhc_post(parts, *dev).cpu(), fused.cpu())
    ref = REF.mhc_post(MoEPartials(y, ids, e), streams, post, comb)
    assert _rel(fused, ref) < _tol(dtype)

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,d,n,split,chunk", [(4, 1100, 1, None, None), (3, 96, 3, None, 0), (3, 96, 3, None, 32),
                                               (4, 96, 2, 1, None), (8, 2100, 1, None, 0)])
def test_mhc_pre_with_the_input_norm(device, dtype, m, d, n, split, chunk, monkeypatch):
    """mhc_pre(norm=(w, eps)) returns the collapse through that RMSNorm: fused into the split
    epilogue, one program per token with its whole row in one tile (decode sizes; at prefill
    sizes with NORM_CHUNK 0) or at prefill sizes in chunks of mhc.NORM_CHUNK columns (D 96 in
    three of 32, the last one partly masked; prefill sizes start at one token here); after the
    one-launch path (split 1), or after a row too wide for one tile (M 8 x 4096 columns)."""
    from backends.kernels import mhc
    if chunk is not None:
        monkeypatch.setattr(mhc, "NORM_CHUNK", chunk)
        monkeypatch.setattr(mhc, "_LARGE_N", 1)
    g = _gen("pre-norm", str(dtype), m, d, n, str(split))
    streams = torch.randn(n, m, d, generator=g).to(dtype)
    fn, base, scale = _hc_params(m, d, g)
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype)
    ref = REF.mhc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6, norm=(w, 1e-5))
    got = mhc_pre(*(t.to(device) for t in (streams, fn, base, scale)), 20, 1e-6, 1e-6, split=split,
                  norm=(w.to(device), 1e-5))
    unfused = mhc_pre(*(t.to(device) for t in (streams, fn, base, scale)), 20, 1e-6, 1e-6, split=split)
    assert _rel(got[0], ref[0]) < 1e-5 and _rel(got[1], ref[1]) < 1e-5
    assert got[2].dtype == dtype and _rel(got[2], ref[2]) < _tol(dtype)
    # the norm really applied: the un-normed collapse is far from it
    assert _rel(unfused[2], ref[2]) > 0.05
    assert _rel(got[2], rms_norm(unfused[2], w.to(device), 1e-5)) < _tol(dtype)


# ---- the ops ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_h200_ops_chain(device, dtype):
    """CudaH200Ops.{mhc_pre, rms_norm, mhc_post} chained as in a decoder layer, vs the reference."""
    from backends.cuda_h200 import CudaH200Ops

    ops = CudaH200Ops()
    g = _gen("ops", str(dtype))
    n, m, d = 6, 4, 64
    streams = torch.randn(n, m, d, generator=g).to(dtype)
    fn, base, scale = _hc_params(m, d, g)
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype)

    def layer(o, s, f, b, sc, ww):
        post, comb, u = o.mhc_pre(s, f, b, sc, 20, 1e-6, 1e-6)
        y = o.rms_norm(u, ww, 1e-6)
        normed = o.mhc_pre(s, f, b, sc, 20, 1e-6, 1e-6, norm=(ww, 1e-6))[2]
        return post, comb, u, y, normed, o.mhc_post(y, s, post, comb)

    ref = layer(REF, streams, fn, base, scale, w)
    out = layer(ops, *(t.to(device) for t in (streams, fn, base, scale, w)))
    for a, b in zip(out, ref):
        assert a.device.type == device.type and a.dtype == b.dtype and a.shape == b.shape
        assert _rel(a, b) < (1e-5 if a.dtype == torch.float32 else 1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_full_size_mhc_gpu():
    """Full size (M 4, D 4096, 20 iterations): decode and prefill token counts, bf16 streams."""
    g = _gen("full")
    m, d = 4, 4096
    fn, base, scale = (t.cuda() for t in _hc_params(m, d, g))
    for n in (1, 64, 3000):
        streams = torch.randn(n, m, d, generator=g).to(torch.bfloat16).cuda()
        ref = REF.mhc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6)
        out = mhc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6)
        assert _rel(out[0], ref[0]) < 1e-5 and _rel(out[1], ref[1]) < 1e-5 and _rel(out[2], ref[2]) < 1e-2
        y = torch.randn(n, d, generator=g).to(torch.bfloat16).cuda()
        assert _rel(mhc_post(y, streams, out[0], out[1]), REF.mhc_post(y, streams, out[0], out[1])) < 1e-2
        w = torch.randn(d, generator=g).to(torch.bfloat16).cuda()
        assert _rel(rms_norm(y, w, 1e-6), REF.rms_norm(y, w, 1e-6)) < 1e-2
        normed = mhc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6, norm=(w, 1e-5))[2]
        assert _rel(normed, REF.mhc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6, norm=(w, 1e-5))[2]) < 1e-2
