"""The fused-MoE test problems: random routings and expert weights, their float64 truth, and
the check every fused-MoE test applies (tests/backends/test_triton_moe*.py).

Fresh random inputs per check (routing with repeats and experts that get no token), outputs
NaN-poisoned first and checked fully written; bounds against a float64 evaluation of the same
rounded inputs: fp32 ~1e-5 relative, bf16 ~1e-2 relative (tests/backends/conftest.py).
"""

from __future__ import annotations

import torch

from backends.kernels import fused_moe as fm
from backends.reference import ReferenceOps
from backends.fp8_numerics import dequantize_block_fp8
from tests.backends.conftest import INTERPRET, rel as _rel, tol as _tol

REF = ReferenceOps()
FP8 = torch.float8_e4m3fn


def route(g, n, e, k, used=None):
    """ids [N, k] (distinct per token) over the first `used` experts: the rest get no token."""
    used = used or e
    ids = torch.stack([torch.randperm(used, generator=g)[:k] for _ in range(n)])
    perm = torch.randperm(e, generator=g)[:used]  # spread the used experts over [0, E)
    weights = torch.rand(n, k, generator=g) * 2.5 / k
    return perm[ids], weights


def problem(g, n, d, i, e, k, dtype, fp8, used=None):
    ids, weights = route(g, n, e, k, used)
    x = torch.randn(n, d, generator=g).to(dtype)
    if fp8:
        ws = [(torch.randn(s, generator=g) * 2).to(FP8) for s in ((e, i, d), (e, i, d), (e, d, i))]
        scales = tuple(torch.rand(e, -(-o // 128), -(-c // 128), generator=g) * c ** -0.5 + 0.2 * c ** -0.5
                       for o, c in ((i, d), (i, d), (d, i)))
    else:
        ws = [(torch.randn(e, i, d, generator=g) * d ** -0.5).to(dtype),
              (torch.randn(e, i, d, generator=g) * d ** -0.5).to(dtype),
              (torch.randn(e, d, i, generator=g) * i ** -0.5 * 4).to(dtype)]
        scales = None
    return x, ids, weights, ws, scales


def truth(x, ids, weights, ws, scales, limit):
    if scales is None:
        w64 = [w.double().cpu() for w in ws]
    else:
        w64 = [dequantize_block_fp8(w.cpu(), s.cpu(), (128, 128), torch.float64) for w, s in zip(ws, scales)]
    return REF.moe_experts(x.double().cpu(), ids.cpu(), weights.double().cpu(), *w64, limit)


def to(device, *ts):
    return [None if t is None else (tuple(u.to(device) for u in t) if isinstance(t, (tuple, list)) else t.to(device))
            for t in ts]


def same(a, b):
    """Pair blocks and aligned blocks compute each row with the same math: bit for bit when
    compiled. In the interpreter numpy's matmul (BLAS) may round a row differently by its position
    in the tile (ulps of the fp32 accumulation), so there: equal to about that."""
    if INTERPRET:
        assert _rel(a, b) < (1e-6 if a.dtype == torch.float32 else 1e-3)
    else:
        assert torch.equal(a, b)


def check(device, x, ids, weights, ws, scales, limit, config=None, pair_blocks=None):
    """The kernel against the float64 truth (the conftest bound), and against the reference loosely:
    with fp8 weights the kernel scales each K tile's fp32 partial product instead of rounding
    every dequantised weight to bf16 as the reference does, so the two differ by about the
    reference's own error (the kernel is the closer of the two to the truth). When the kernel took
    pair blocks (tiny batches), the aligned blocks must give the same result (same): rows are
    independent. Ids outside [0, E) are dropped: the reference sees them with weight 0."""
    x, ids, weights, ws, scales = to(device, x, ids, weights, ws, scales)
    out = torch.full(x.shape, float("nan"), dtype=x.dtype, device=device)
    res = fm.fused_moe(x, ids, weights, *ws, limit, scales, out=out, config=config, pair_blocks=pair_blocks)
    assert res is out
    if pair_blocks if pair_blocks is not None else ids.numel() <= fm.PAIR_BLOCKS_MAX_PAIRS:
        same(fm.fused_moe(x, ids, weights, *ws, limit, scales, config=config, pair_blocks=False), out)
    drop = (ids < 0) | (ids >= ws[0].shape[0])
    ids, weights = ids.masked_fill(drop, 0), weights.masked_fill(drop, 0.0)
    want = truth(x, ids, weights, ws, scales, limit)
    ref = REF.moe_experts(x, ids, weights, *ws, limit, scales)
    tol = _tol(x.dtype)
    assert _rel(out, want) < tol
    assert _rel(ref, want) < tol  # the oracle itself, for scale
    assert _rel(out, ref) < (2 * tol if scales is not None else tol)
    return out
