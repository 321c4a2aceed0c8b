"""The fused MoE's sorted-row TMA GEMMs (backends/kernels/fused_moe_tma.py: 16-bit weights at
prefill sizes) against the truth and the pointer GEMMs, their dispatch and their fallback.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1 is set
before Triton is imported); with CUDA (SM90+) the same tests run compiled (the "cuda" parameter).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from backends.kernels import fused_moe as fm  # noqa: E402
from tests.backends.conftest import gen as _gen, rel as _rel, tol as _tol  # noqa: E402
from tests.backends.moe_problems import problem as _problem, to as _to, truth as _truth  # noqa: E402


# ---- the sorted-row TMA GEMMs (fused_moe_tma: 16-bit weights at prefill sizes) ------------------
def _tma_cfg(bm=32, gn=32, gk=32, dn=32, dk=32, a_tma=True):
    return dict(BLOCK_M=bm, A_TMA=a_tma,
                gate_up=dict(BLOCK_N=gn, BLOCK_K=gk, GROUP_M=2, num_warps=4, num_stages=2),
                down=dict(BLOCK_N=dn, BLOCK_K=dk, GROUP_M=2, num_warps=4, num_stages=2))


@pytest.mark.parametrize("n,d,i,e,k,used,limit,cfg", [
    (40, 64, 64, 8, 3, 6, 7.0, _tma_cfg()),
    (40, 64, 64, 8, 3, 6, 7.0, _tma_cfg(a_tma=False)),                   # x gathered by pointers
    (37, 96, 48, 6, 2, None, 0.5, _tma_cfg(gn=32, gk=64, dn=64, dk=32)),  # tiles past I, D and K; a tight clamp
    (21, 64, 32, 12, 4, 5, None, _tma_cfg(bm=16, gn=16, gk=16, dn=16, dk=16)),
])
def test_fused_moe_tma(device, n, d, i, e, k, used, limit, cfg):
    """The TMA path against the truth (the bounds of moe_problems.check) and against the pointer GEMMs: the same
    products in the same K order, so equal to about the accumulation's rounding."""
    if device.type == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs SM90+")
    g = _gen("tma", n, d, i, e, k)
    x, ids, weights, ws, _ = _to(device, *_problem(g, n, d, i, e, k, torch.bfloat16, False, used))
    assert fm.fused_moe_tma.available(x, *ws)
    ids[3, 1] = -1                                                     # a dropped pair
    out = fm.fused_moe(x, ids, weights, *ws, limit, tma=True, config=cfg)
    ptr = fm.fused_moe(x, ids, weights, *ws, limit, tma=False, pair_blocks=False)
    assert _rel(out, ptr) < 1e-2
    drop = ids < 0
    truth = _truth(x, ids.masked_fill(drop, 0), weights.masked_fill(drop, 0.0), ws, None, limit)
    assert _rel(out, truth) < _tol(torch.bfloat16)
    parts = fm.fused_moe(x, ids, weights, *ws, limit, tma=True, config=cfg, reduce=False)
    assert torch.equal(parts.reduce().cpu(), out.cpu())


def test_fused_moe_tma_dispatch(device, monkeypatch):
    """From TMA_MIN_TOKENS tokens (None: off, the default until timed on an H200) 16-bit weights take
    the TMA GEMMs unless a config or tma=False asks for the pointer GEMMs; fp8 weights and fp32
    activations never do."""
    from backends.kernels import fused_moe_tma

    if device.type == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs SM90+")
    assert fm.TMA_MIN_TOKENS is None
    calls = []
    real = fused_moe_tma.grouped_gemms
    monkeypatch.setattr(fused_moe_tma, "grouped_gemms", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    g = _gen("tma-dispatch")
    x, ids, weights, ws, _ = _to(device, *_problem(g, 8, 64, 32, 4, 2, torch.bfloat16, False))
    fm.fused_moe(x, ids, weights, *ws, 7.0)
    assert calls == []
    monkeypatch.setattr(fm, "TMA_MIN_TOKENS", 8)
    monkeypatch.setattr(fused_moe_tma, "CONFIG", _tma_cfg())
    fm.fused_moe(x, ids, weights, *ws, 7.0)
    assert calls == [1]
    fm.fused_moe(x, ids, weights, *ws, 7.0, tma=False)
    fm.fused_moe(x, ids, weights, *ws, 7.0, config=fm.get_config(8))
    fm.fused_moe(x.float(), ids, weights, *[w.float() for w in ws], 7.0)
    fm.fused_moe(x[:7], ids[:7], weights[:7], *ws, 7.0)
    assert calls == [1]
    assert not fused_moe_tma.available(x, ws[0].float(), ws[1], ws[2])
    d60 = [ws[0][:, :, :60].contiguous(), ws[1][:, :, :60].contiguous(), ws[2][:, :60].contiguous()]
    assert not fused_moe_tma.available(x[:, :60].contiguous(), *d60)  # 120-byte rows: not TMA-aligned
    assert not fused_moe_tma.available(x, ws[0].transpose(1, 2).contiguous().transpose(1, 2), ws[1], ws[2])


def test_fused_moe_tma_refused_config_falls_back(device, monkeypatch):
    """A TMA config whose kernels do not compile on the device is refused once, with a warning, and
    the call (and every later one with it) runs on the pointer GEMMs: the same result."""
    from backends.kernels import fused_moe_tma

    if device.type == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs SM90+")
    tries = []

    def fails(*a, **kw):
        tries.append(1)
        raise triton.runtime.errors.OutOfResources(300000, 232448, "shared memory")

    monkeypatch.setattr(fused_moe_tma, "grouped_gemms", fails)
    monkeypatch.setattr(fused_moe_tma, "_REFUSED", {})
    g = _gen("tma-refused")
    x, ids, weights, ws, _ = _to(device, *_problem(g, 9, 64, 32, 4, 2, torch.bfloat16, False))
    ptr = fm.fused_moe(x, ids, weights, *ws, 7.0, tma=False)
    with pytest.warns(RuntimeWarning, match="does not compile"):
        out = fm.fused_moe(x, ids, weights, *ws, 7.0, tma=True, config=_tma_cfg())
    assert torch.equal(out, ptr) and len(fused_moe_tma.refusals()) == 1
    assert torch.equal(fm.fused_moe(x, ids, weights, *ws, 7.0, tma=True, config=_tma_cfg()), ptr)
    assert tries == [1]
