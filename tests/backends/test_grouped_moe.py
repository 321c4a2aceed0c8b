"""The routed experts on grouped GEMMs (backends/kernels/grouped_moe.py) against the float64 truth,
ReferenceOps.moe_experts and the fused MoE; dropped ids; the ops dispatch by token count.

torch._grouped_mm runs on the CPU too, so without CUDA only the sum kernel is interpreted.
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
from backends.kernels import grouped_moe as gm  # noqa: E402
from tests.backends.conftest import gen as _gen, rel as _rel, tol as _tol  # noqa: E402
from tests.backends.moe_problems import REF, problem as _problem, to as _to, truth as _truth  # noqa: E402

pytestmark = pytest.mark.skipif(not gm.available(), reason="torch without _grouped_mm")


@pytest.mark.parametrize("n,d,i,e,k,used,limit", [
    (1, 64, 32, 4, 2, None, None),
    (37, 128, 96, 12, 3, 7, 0.5),     # experts with no token; a tight clamp that bites
    (64, 256, 128, 16, 4, 16, 7.0),
])
def test_grouped_moe(device, n, d, i, e, k, used, limit):
    g = _gen("grouped-moe", n, d, i, e, k)
    x, ids, weights, ws, _ = _to(device, *_problem(g, n, d, i, e, k, torch.bfloat16, False, used))
    if not gm.supported(x, ids, weights, *ws):
        pytest.skip("this device has no grouped GEMM")
    out = torch.full(x.shape, float("nan"), dtype=x.dtype, device=device)
    assert gm.grouped_moe(x, ids, weights, *ws, limit, out=out) is out
    want = _truth(x, ids, weights, ws, None, limit)
    tol = _tol(x.dtype)
    assert _rel(out, want) < tol
    assert _rel(out, REF.moe_experts(x, ids, weights, *ws, limit)) < tol
    # the fused MoE rounds where this path rounds: they differ only by the GEMMs' fp32 sums
    assert _rel(out, fm.fused_moe(x, ids, weights, *ws, limit)) < 2e-3


def test_grouped_moe_drops_other_ranks_experts(device):
    """Picks outside [0, E) (expert parallelism's -1, or past the last expert) add nothing; a
    token whose every pick is dropped gets zeros."""
    g = _gen("grouped-moe-drop")
    n, d, i, e, k = 9, 64, 32, 6, 3
    x, ids, weights, ws, _ = _problem(g, n, d, i, e, k, torch.bfloat16, False)
    ids[0, 1] = -1
    ids[3, 0] = e
    ids[5] = -1
    x, ids, weights, ws = _to(device, x, ids, weights, ws)
    if not gm.supported(x, ids, weights, *ws):
        pytest.skip("this device has no grouped GEMM")
    out = gm.grouped_moe(x, ids, weights, *ws, 7.0)
    drop = (ids < 0) | (ids >= e)
    want = REF.moe_experts(x, ids.masked_fill(drop, 0), weights.masked_fill(drop, 0.0), *ws, 7.0)
    assert _rel(out, want) < _tol(x.dtype)
    assert torch.all(out[5] == 0)


def test_sort_pairs_groups():
    ids = torch.tensor([[2, 0], [-1, 2], [1, 5], [0, 2]])
    order, ends = gm.sort_pairs(ids, 3)
    flat = ids.reshape(-1)
    assert ends.dtype == torch.int32 and ends.tolist() == [2, 3, 6]
    assert flat[order].tolist()[:6] == [0, 0, 1, 2, 2, 2]
    assert order.tolist()[:6] == [1, 6, 4, 0, 3, 7]  # stable: pair order kept inside a group


def test_ops_take_the_grouped_path_from_its_token_count(device, monkeypatch):
    """CudaH200Ops.moe_experts: 16-bit weights from GROUPED_MIN_TOKENS tokens go to the grouped
    GEMMs, below to the fused MoE; a deferred sum still returns the summed rows there."""
    g = _gen("grouped-moe-ops")
    n, d, i, e, k = 24, 128, 64, 8, 2
    x, ids, weights, ws, _ = _to(device, *_problem(g, n, d, i, e, k, torch.bfloat16, False))
    if not gm.supported(x, ids, weights, *ws):
        pytest.skip("this device has no grouped GEMM")
    ops = CudaH200Ops()
    calls = []
    real = gm.grouped_moe
    monkeypatch.setattr(gm, "grouped_moe", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(CudaH200Ops, "GROUPED_MIN_TOKENS", n + 1)
    below = ops.moe_experts(x, ids, weights, *ws, 7.0)
    assert calls == []
    monkeypatch.setattr(CudaH200Ops, "GROUPED_MIN_TOKENS", n)
    at = ops.moe_experts(x, ids, weights, *ws, 7.0, defer_sum=True)
    assert calls == [1] and isinstance(at, torch.Tensor) and at.shape == x.shape
    assert _rel(at, below) < 2e-3
