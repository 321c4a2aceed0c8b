"""The cuda-h200 fused MoE (backends/kernels/fused_moe.py) against ReferenceOps.moe_experts: bf16,
fp32 and fp8 weights, w8a8 activations, pair blocks, dropped ids, the ops dispatch and the model's
MoE layer.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1 is set
before Triton is imported); with CUDA the same tests run compiled (the "cuda" parameter). The
problems and the check they share: tests/backends/moe_problems.py.
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
from backends.reference import ReferenceOps  # noqa: E402
from backends.fp8_numerics import dequantize_block_fp8  # noqa: E402
from tests.backends.conftest import INTERPRET as _INTERPRET, gen as _gen, rel as _rel  # noqa: E402
from tests.backends.moe_problems import (FP8, REF, check as _check, problem as _problem,  # noqa: E402
                                         route as _route, same as _same, to as _to, truth as _truth)


# ---- the fused op -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,d,i,e,k,used,limit", [
    (1, 128, 64, 8, 2, None, None),
    (5, 256, 128, 16, 4, 9, 7.0),
    (33, 64, 96, 12, 3, 7, 0.5),      # I not a multiple of the tile; a tight clamp that bites
])
def test_fused_moe(device, dtype, n, d, i, e, k, used, limit):
    g = _gen("moe", dtype, n, d, i, e, k)
    _check(device, *_problem(g, n, d, i, e, k, dtype, False, used), limit)


@pytest.mark.parametrize("n,d,i,e,k,used,limit", [
    (1, 256, 128, 8, 2, None, 7.0),
    (5, 256, 128, 16, 4, 10, None),
    (33, 192, 96, 12, 3, 6, 3.0),     # partial 128x128 scale blocks
])
def test_fused_moe_fp8(device, n, d, i, e, k, used, limit):
    g = _gen("fp8", n, d, i, e, k)
    _check(device, *_problem(g, n, d, i, e, k, torch.bfloat16, True, used), limit)


def _both(**kw):
    return dict(gate_up=dict(kw), down=dict(kw))


@pytest.mark.parametrize("name,config", [
    ("per-element", _both(scale_acc=False)),                                  # the old dequant
    ("swap-ab", _both(SWAP_AB=True, BLOCK_N=64, BLOCK_K=128)),
    ("swap-ab-per-element", _both(SWAP_AB=True, BLOCK_N=64, BLOCK_K=64, scale_acc=False)),
    ("n256", _both(BLOCK_N=256, BLOCK_K=64)),                                 # a scale per column
    ("swap-n256", _both(SWAP_AB=True, BLOCK_N=256, BLOCK_K=128)),
    ("k256", _both(BLOCK_N=32, BLOCK_K=256)),                                 # K tile straddles
    ("swap-n256-k256", _both(SWAP_AB=True, BLOCK_N=256, BLOCK_K=256, num_warps=8)),
])
def test_fused_moe_fp8_paths(device, name, config):
    """Each way of applying the scales (partial product per K tile, per column, per element) and
    both operand orders; D and I not multiples of the 128x128 scale block (partial blocks, K
    tails). The aligned blocks here (27 pairs would take pair blocks: test_fused_moe_pair_blocks)."""
    g = _gen("fp8-paths", name)
    _check(device, *_problem(g, 9, 320, 192, 6, 3, torch.bfloat16, True, 5), 7.0, config=config, pair_blocks=False)


@pytest.mark.parametrize("config", [None, _both(BLOCK_N=128, BLOCK_K=32), _both(SWAP_AB=True, BLOCK_N=64, BLOCK_K=64)])
def test_fused_moe_fp8_small_scale_blocks(device, config):
    """32x64 scale blocks: tiles wider than a block (a scale per column, or per element)."""
    g = _gen("fp8-blocks", repr(config))
    blk = (32, 64)
    n, d, i, e, k = 7, 192, 160, 5, 2
    ids, weights = _route(g, n, e, k)
    x = torch.randn(n, d, generator=g).to(torch.bfloat16)
    ws = [(torch.randn(s, generator=g) * 2).to(FP8) for s in ((e, i, d), (e, i, d), (e, d, i))]
    scales = tuple(torch.rand(e, -(-o // blk[0]), -(-c // blk[1]), generator=g) * c ** -0.5 + 0.2 * c ** -0.5
                   for o, c in ((i, d), (i, d), (d, i)))
    w64 = [dequantize_block_fp8(w, s, blk, torch.float64) for w, s in zip(ws, scales)]
    truth = REF.moe_experts(x.double(), ids, weights.double(), *w64, 7.0)
    x, ids, weights, ws, scales = _to(device, x, ids, weights, ws, scales)
    assert fm.supported(x, ids, weights, *ws, scales, blk)
    out = fm.fused_moe(x, ids, weights, *ws, 7.0, scales, blk, config=config)
    ref = REF.moe_experts(x, ids, weights, *ws, 7.0, scales, blk)
    assert _rel(out, truth) < 1e-2
    assert _rel(out, ref) < 2e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_moe_swap_ab(device, dtype):
    """The transposed product with 16/32-bit weights (no scales)."""
    g = _gen("swap", dtype)
    _check(device, *_problem(g, 20, 192, 96, 8, 2, dtype, False, 6), 3.0,
           config=dict(BLOCK_M=16, **_both(SWAP_AB=True, BLOCK_N=64, BLOCK_K=64)))


def test_fused_moe_fp8_closer_to_truth(device):
    """Scaling the fp32 partials is at least as accurate as rounding each dequantised weight."""
    g = _gen("fp8-truth")
    x, ids, weights, ws, scales = _to(device, *_problem(g, 16, 256, 128, 4, 2, torch.bfloat16, True))
    truth = _truth(x, ids, weights, ws, scales, 10.0)
    acc = fm.fused_moe(x, ids, weights, *ws, 10.0, scales, config=_both(scale_acc=True))
    elem = fm.fused_moe(x, ids, weights, *ws, 10.0, scales, config=_both(scale_acc=False))
    assert _rel(acc, truth) <= _rel(elem, truth) * 1.25 + 1e-4
    assert 1e-4 < _rel(acc, truth) < 1e-2


# ---- w8a8: activations quantised on the fly (act_fp8) ------------------------------------------
REF_A8 = ReferenceOps()
REF_A8.fp8_activations = "dynamic"


@pytest.mark.parametrize("name,n,config,pair_blocks", [
    ("table-pairs", 3, None, None),                                            # pair blocks, table tiles
    ("table-aligned", 9, None, False),
    ("swap-ab", 9, _both(SWAP_AB=True, BLOCK_N=64, BLOCK_K=128), False),       # fp8 wgmma when compiled
    ("swap-n256", 9, _both(SWAP_AB=True, BLOCK_N=256), False),                 # a weight scale per column
    ("k64-asked", 9, _both(BLOCK_N=32, BLOCK_K=64), False),                    # BLOCK_K forced to the block
    ("plain-m64", 9, dict(BLOCK_M=64, **_both(BLOCK_N=128, num_warps=4, num_stages=2, SWAP_AB=False)), False),
])
def test_fused_moe_w8a8(device, name, n, config, pair_blocks):
    """act_fp8: both GEMMs' inputs are quantised per row and 128-wide K block (the scale block; by
    act_quant first at every size by default) and the GEMMs multiply e4m3 by e4m3 (the swapped
    decode tiles, and the plain layout of prefill's), against ReferenceOps with
    fp8_activations="dynamic" (same quantised values, fp32 products): equal to fp32 summation
    order and the bf16 roundings both make. D and I are not multiples of 128 (a partial last
    group). Against the unquantised float64 truth the distance is the activations' e4m3 rounding:
    a few 1e-2, and more than w8a16's."""
    g = _gen("w8a8", name)
    x, ids, weights, ws, scales = _to(device, *_problem(g, n, 320, 192, 6, 3, torch.bfloat16, True, 5))
    out = torch.full(x.shape, float("nan"), dtype=x.dtype, device=device)
    fm.fused_moe(x, ids, weights, *ws, 7.0, scales, out=out, config=config, pair_blocks=pair_blocks, act_fp8=True)
    ref = REF_A8.moe_experts(x, ids, weights, *ws, 7.0, scales)
    w8a16 = fm.fused_moe(x, ids, weights, *ws, 7.0, scales, config=config, pair_blocks=pair_blocks)
    truth = _truth(x, ids, weights, ws, scales, 7.0)
    # a bf16 rounding of g/u that lands the other way flips h's e4m3 code (6%): a few 1e-3 over so few
    # outputs (compiled, in-GEMM quantisation, BLOCK_N 256: 6.9e-3; the act_quant route on another
    # problem, test_fused_moe_w8a8_prequantised: 1.4e-2 and 1.6e-2); the quantisation alone is ~4e-2
    assert _rel(out, ref) < (1e-2 if _INTERPRET else 2.5e-2)
    assert _rel(w8a16, truth) < _rel(out, truth) < 6e-2
    assert torch.equal(out, fm.fused_moe(x, ids, weights, *ws, 7.0, scales, config=config,
                                         pair_blocks=pair_blocks, act_fp8=True))


@pytest.mark.parametrize("name,config", [(f"table-{lim}", c) for lim, c in fm.FP8A8_CONFIGS])
def test_fused_moe_w8a8_table_tiles(device, name, config):
    """Every w8a8 tile table entry as the GPU launches it (decode's swapped tiles, prefill's 64- and
    128-row blocks over one and two warpgroups; D and I multiples of the 128-wide K block, as the
    model's are), on one problem: so the suite's compile check builds the tiles the GPU runs."""
    g = _gen("w8a8-table", name)
    x, ids, weights, ws, scales = _to(device, *_problem(g, 9, 384, 256, 6, 3, torch.bfloat16, True, 5))
    # the entry whole: a key it leaves out takes its default, not the 9-token row's value
    config = {k: (dict(dict(SWAP_AB=False), **v) if isinstance(v, dict) else v) for k, v in config.items()}
    out = fm.fused_moe(x, ids, weights, *ws, 7.0, scales, config=config, pair_blocks=False, act_fp8=True)
    assert _rel(out, REF_A8.moe_experts(x, ids, weights, *ws, 7.0, scales)) < (1e-2 if _INTERPRET else 2.5e-2)


@pytest.mark.parametrize("name,config", [
    ("aligned", None), ("swap-ab", _both(SWAP_AB=True, BLOCK_N=64, BLOCK_K=128)),
    ("m64", dict(BLOCK_M=64, **_both(BLOCK_N=64, num_warps=4, num_stages=2))),
])
def test_fused_moe_w8a8_prequantised(device, monkeypatch, name, config):
    """Above INKERNEL_QUANT_MAX_TOKENS (every size by default) x and h are quantised once by
    act_quant and the GEMMs read e4m3 rows and their scales (X_FP8): the same values as the in-GEMM
    route, so the same reference (up to the in-GEMM divide's last bit when compiled)."""
    g = _gen("w8a8-pre", name)
    x, ids, weights, ws, scales = _to(device, *_problem(g, 9, 320, 192, 6, 3, torch.bfloat16, True, 5))
    monkeypatch.setattr(fm, "INKERNEL_QUANT_MAX_TOKENS", 1024)
    inside = fm.fused_moe(x, ids, weights, *ws, 7.0, scales, config=config, pair_blocks=False, act_fp8=True)
    monkeypatch.setattr(fm, "INKERNEL_QUANT_MAX_TOKENS", 4)
    pre = fm.fused_moe(x, ids, weights, *ws, 7.0, scales, config=config, pair_blocks=False, act_fp8=True)
    # Compiled, h's e4m3 code moves by a step (1/16 relative) where the GEMM's bf16 h is one ulp
    # off the reference's: 1.4e-2 and 1.6e-2 here measured on an H200, where
    # the quantisation's own error is ~4e-2 (the truth bound below).
    assert _rel(pre, REF_A8.moe_experts(x, ids, weights, *ws, 7.0, scales)) < (1e-2 if _INTERPRET else 2.5e-2)
    assert _rel(pre, _truth(x, ids, weights, ws, scales, 7.0)) < 6e-2
    assert _rel(pre, inside) < (1e-6 if _INTERPRET else 2.5e-2)


@pytest.mark.parametrize("pair_blocks", [True, False])
def test_fused_moe_unreduced(device, pair_blocks):
    """reduce=False leaves the top-k sum to the consumer: MoEPartials whose reduce() is the
    reduced result bit for bit (the same fp32 sum, one rounding)."""
    from backends.reference import MoEPartials

    g = _gen("unreduced", pair_blocks)
    x, ids, weights, ws, scales = _to(device, *_problem(g, 5, 64, 96, 6, 3, torch.bfloat16, False))
    ids[2, 1] = -1
    out = fm.fused_moe(x, ids, weights, *ws, 7.0, scales, pair_blocks=pair_blocks)
    parts = fm.fused_moe(x, ids, weights, *ws, 7.0, scales, pair_blocks=pair_blocks, reduce=False)
    assert isinstance(parts, MoEPartials) and parts.y.shape == (5, 3, 64) and parts.num_experts == 6
    assert torch.equal(parts.reduce().cpu(), out.cpu())


def test_fused_moe_w8a8_falls_back():
    """act_fp8 applies to e4m3 weights with 16-bit activations and K blocks of 32..256 only (an
    fp8 MMA needs K >= 32); the reference and the kernels agree on where (else both are w8a16)."""
    from backends.fp8_numerics import w8a8_applies

    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    cases = [(FP8, torch.bfloat16, (128, 128), True), (FP8, torch.float16, (16, 32), True),
             (FP8, torch.bfloat16, (32, 16), False), (FP8, torch.float32, (128, 128), False),
             (torch.float8_e5m2, torch.bfloat16, (128, 128), False), (FP8, torch.bfloat16, (128, 512), False),
             (torch.bfloat16, torch.bfloat16, (128, 128), False)]
    for wdt, xdt, blk, want in cases:
        w = torch.zeros(4, 64, dtype=wdt)
        assert fm.act_fp8_supported(True, xdt, wdt, blk) is want
        assert w8a8_applies("dynamic", x.to(xdt), w, blk) is want
        assert not fm.act_fp8_supported(False, xdt, wdt, blk) and not w8a8_applies("none", x.to(xdt), w, blk)


def test_act_quant_e4m3():
    """Per row and group: the group's largest magnitude maps to 448 (exactly representable), every
    value is an e4m3 value times the group's scale, zero groups stay zero, a partial last group is
    scaled by its own elements only."""
    from backends.fp8_numerics import act_quant_e4m3

    g = _gen("act-quant")
    x = torch.randn(3, 200, generator=g).to(torch.bfloat16)
    x[1, :128] = 0
    x[2, 128:] *= 1000
    dq = act_quant_e4m3(x, 128)
    assert dq.dtype == torch.float32 and dq.shape == x.shape
    assert torch.equal(dq[1, :128], torch.zeros(128))
    for r in range(3):
        for lo, hi in ((0, 128), (128, 200)):
            xs, ds = x[r, lo:hi].float(), dq[r, lo:hi]
            if not xs.abs().max() > 0:
                continue
            s = xs.abs().max() / 448
            q = ds / s
            assert torch.allclose(q.abs().max(), torch.tensor(448.0))
            assert torch.allclose(q, q.to(FP8).float(), rtol=1e-6, atol=0)  # e4m3 values
            assert _rel(ds, xs) < 0.05


def test_fused_moe_flash_routing(device):
    """The real expert count and top-k (288, top-8) at small widths."""
    g = _gen("flash-routing")
    _check(device, *_problem(g, 9, 128, 64, 288, 8, torch.bfloat16, False), 10.0)

def test_fused_moe_fp8_fp32_activations(device):
    g = _gen("fp8-fp32")
    _check(device, *_problem(g, 3, 128, 128, 6, 2, torch.float32, True), 7.0)


@pytest.mark.parametrize("bm,group,n,e", [(64, 8, 48, 4), (16, 3, 40, 8)])
def test_fused_moe_grouped_tiles(device, bm, group, n, e):
    """The prefill tiles (BLOCK_M 64) and the grouped launch order over more blocks than GROUP_M."""
    g = _gen("grouped", bm, group)
    cfg = fm.get_config(1 << 20)
    cfg["BLOCK_M"] = bm
    for part in ("gate_up", "down"):
        cfg[part]["GROUP_M"] = group
    _check(device, *_problem(g, n, 128, 128, e, 2, torch.bfloat16, True), 7.0, config=cfg)


@pytest.mark.parametrize("pair_blocks", [False, True])
def test_fused_moe_dropped_ids(device, pair_blocks):
    """Pairs routed to -1 contribute nothing (as if their weight were zero)."""
    g = _gen("dropped")
    x, ids, weights, ws, _ = _problem(g, 6, 64, 64, 5, 3, torch.float32, False)
    drop = torch.rand(ids.shape, generator=g) < 0.3
    drop[0] = True                                            # a token with no expert at all
    x, ids, weights, ws = _to(device, x, ids, weights, ws)
    drop = drop.to(device)
    out = fm.fused_moe(x, ids.masked_fill(drop, -1), weights, *ws, 7.0, pair_blocks=pair_blocks)
    ref = REF.moe_experts(x, ids, weights.masked_fill(drop, 0.0), *ws, 7.0)
    assert (out[0] == 0).all()
    assert _rel(out[1:], ref[1:]) < 1e-5


@pytest.mark.parametrize("dtype,fp8,config", [
    (torch.bfloat16, False, None),
    (torch.float32, False, None),
    (torch.bfloat16, True, None),
    (torch.bfloat16, False, _both(SWAP_AB=True, BLOCK_N=64, BLOCK_K=64)),
    (torch.bfloat16, True, _both(SWAP_AB=True, BLOCK_N=64, BLOCK_K=128)),
    (torch.bfloat16, True, _both(SWAP_AB=True, BLOCK_N=64, BLOCK_K=64, scale_acc=False, GROUP_M=4)),
    (torch.bfloat16, True, _both(BLOCK_N=32, BLOCK_K=256)),                   # K tile straddles
    (torch.bfloat16, True, _both(SWAP_AB=True, BLOCK_N=256, BLOCK_K=128)),    # a scale per column
])
def test_fused_moe_pair_blocks(device, dtype, fp8, config):
    """Tiny batches, one block per (token, slot) pair and no alignment: tokens that pick the same
    experts (each pair reads its expert's weights), dropped ids (-1 and E), against the truth and
    the reference, and against the aligned blocks (_check runs both)."""
    g = _gen("pairs", dtype, fp8, repr(config))
    n, d, i, e, k = 4, 192, 160, 6, 3
    x, ids, weights, ws, scales = _problem(g, n, d, i, e, k, dtype, fp8)
    ids[1] = ids[0]                  # a token with the same experts as token 0
    ids[2, 0] = ids[0, 2]
    ids[2, 2] = -1                   # dropped pairs
    ids[3, 1] = e
    _check(device, x, ids, weights, ws, scales, 7.0, config=config, pair_blocks=True)


def test_fused_moe_pair_blocks_threshold(device, monkeypatch):
    """Up to PAIR_BLOCKS_MAX_PAIRS pairs no alignment runs; above it, or when forced off, it does;
    forced on above the threshold the pair blocks still give the same result."""
    calls = []
    align = fm.moe_align
    monkeypatch.setattr(fm, "moe_align", lambda ids, *a, **kw: calls.append(ids.numel()) or align(ids, *a, **kw))
    g = _gen("pairs-threshold")
    lim = fm.PAIR_BLOCKS_MAX_PAIRS
    assert lim == 32
    for n, k, force, aligned in ((1, 8, None, False), (lim // 8, 8, None, False), (lim + 1, 1, None, True),
                                 (2, 8, False, True), (lim + 1, 1, True, False)):
        x, ids, weights, ws, _ = _to(device, *_problem(g, n, 64, 32, 16, k, torch.bfloat16, False))
        calls.clear()
        out = fm.fused_moe(x, ids, weights, *ws, 7.0, pair_blocks=force)
        assert calls == ([n * k] if aligned else [])
        _same(out, fm.fused_moe(x, ids, weights, *ws, 7.0, pair_blocks=not aligned))


def test_ops_dispatch(device):
    """CudaH200Ops.moe_experts takes the kernel, and the reference for what the kernel refuses."""
    g = _gen("ops")
    x, ids, weights, ws, scales = _to(device, *_problem(g, 4, 128, 128, 6, 2, torch.bfloat16, True))
    ops = CudaH200Ops()
    assert ops.fp8_activations == "dynamic"  # w8a8 by default: act_fp8 reaches the kernel
    out = ops.moe_experts(x, ids, weights, *ws, 7.0, scales, (128, 128))
    assert _rel(out, fm.fused_moe(x, ids, weights, *ws, 7.0, scales, act_fp8=True)) == 0.0
    ops.fp8_act_max_tokens = 3  # 4 tokens: above it, w8a16 (prefill-sized calls)
    assert _rel(ops.moe_experts(x, ids, weights, *ws, 7.0, scales, (128, 128)),
                fm.fused_moe(x, ids, weights, *ws, 7.0, scales)) == 0.0
    ops.fp8_act_max_tokens = 1024
    ops.fp8_activations = "none"
    assert _rel(ops.moe_experts(x, ids, weights, *ws, 7.0, scales, (128, 128)),
                fm.fused_moe(x, ids, weights, *ws, 7.0, scales)) == 0.0
    assert not fm.supported(x, ids, weights, *ws, scales, (96, 128))   # not a power of two
    assert not fm.supported(x, ids, weights, *ws, None)                # fp8 without scales
    wg_t = ws[0].transpose(1, 2).contiguous().transpose(1, 2)          # stride(-1) != 1
    assert not fm.supported(x, ids, weights, wg_t, *ws[1:], scales)
    out_fb = ops.moe_experts(x, ids, weights, wg_t, *ws[1:], 7.0, scales, (128, 128))
    assert _rel(out_fb, REF.moe_experts(x, ids, weights, *ws, 7.0, scales)) == 0.0  # both "none"
    empty = ops.moe_experts(x[:0], ids[:0], weights[:0], *ws, 7.0, scales, (128, 128))
    assert empty.shape == (0, 128)


@pytest.mark.parametrize("fp8", [False, True])
def test_model_moe_layer(device, fp8, monkeypatch):
    """The model's MoE FFN (tiny preset: group-limited routing, shared expert) on cuda-h200 ops."""
    from glmrt.checkpoint.presets import preset_config
    from glmrt.model.moe import MoE
    from glmrt.model.weights import quantize_block_fp8, random_tensor

    text = preset_config("tiny").text
    moe = MoE(text, ReferenceOps(), torch.bfloat16)
    if fp8:
        for p in (moe.experts.gate_proj, moe.experts.up_proj, moe.experts.down_proj):
            p.to_fp8((128, 128))
    mods = dict(moe.named_modules())
    for name, p in moe.named_parameters():
        if name.endswith("weight_scale_inv"):
            continue
        value = random_tensor(f"model.layers.3.mlp.{name}", tuple(p.shape), text, 5)
        owner = mods[name.rsplit(".", 1)[0]]
        if getattr(owner, "is_fp8", False):
            q, sc = quantize_block_fp8(value, owner.block)
            p.data.copy_(q)
            owner.weight_scale_inv.data.copy_(sc)
        else:
            p.data.copy_(value)
    moe = moe.to(device)
    moe.ops.fp8_activations = CudaH200Ops.fp8_activations  # the reference in the kernels' fp8 mode (w8a8)
    x = torch.randn(7, text.hidden_size, generator=_gen("layer", fp8)).to(device, torch.bfloat16)
    ref = moe(x)
    calls = []
    kernel = fm.fused_moe
    monkeypatch.setattr(fm, "fused_moe", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    moe.ops = CudaH200Ops()
    out = moe(x)
    assert calls == [1]
    assert _rel(out, ref) < 1e-2


# ---- GPU only: graph capture and no host syncs ----------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("n", [16, 2])  # aligned blocks; pair blocks (8 pairs)
def test_route_and_experts_graph_safe(n):
    dev = torch.device("cuda")
    g = _gen("graph", n)
    d, i, e, k = 256, 128, 32, 4
    x, _, _, ws, scales = _to(dev, *_problem(g, n, d, i, e, k, torch.bfloat16, True))
    gate_w = torch.randn(e, d, generator=g).to(dev, torch.bfloat16) * d ** -0.5
    bias = torch.randn(e, generator=g).to(dev) * 0.01
    ops = CudaH200Ops()
    ops.fused_small_ops = True  # the router kernel too

    def step():
        w, ids = ops.moe_route(x, gate_w, bias, k, 1, 1, True, 2.5)
        return ops.moe_experts(x, ids, w, *ws, 7.0, scales, (128, 128))

    eager = step()  # compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    x.copy_(torch.randn(n, d, generator=g).to(dev, torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert _rel(static, step()) == 0.0
    assert _rel(static, eager) > 0.0  # the replay saw the new input
