"""The cuda-h200 dense FP8 linear (backends/kernels/fp8_linear.py) against ReferenceOps.linear.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1 is set
before Triton is imported); with CUDA the same tests run compiled (the "cuda" parameter). Fresh
random inputs per check (fp8 weights with 128x128 block scales, partial blocks at the edges),
outputs NaN-poisoned first and checked fully written; bounds (tests/backends/conftest.py)
against a float64 evaluation of the same dequantised weights: fp32 ~1e-5 relative, bf16 ~1e-2.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from backends.cuda_h200 import CudaH200Ops  # noqa: E402
from backends.kernels import fp8_linear as f8  # noqa: E402
from backends.reference import ReferenceOps  # noqa: E402
from backends.fp8_numerics import dequantize_block_fp8  # noqa: E402

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
from tests.backends.conftest import gen as _gen, rel as _rel, tol as _tol  # noqa: E402

REF = ReferenceOps()
FP8 = torch.float8_e4m3fn


def _ref_for(ops) -> ReferenceOps:
    """The reference with the kernel set's fp8 activation mode (w8a8, "dynamic", by default on cuda-h200)."""
    ref = ReferenceOps()
    ref.fp8_activations = ops.fp8_activations
    return ref



def _problem(g, n, in_f, out_f, dtype, bias, block=(128, 128)):
    x = torch.randn(n, in_f, generator=g).to(dtype)
    w = (torch.randn(out_f, in_f, generator=g) * 2).to(FP8)
    so, si = -(-out_f // block[0]), -(-in_f // block[1])
    s = torch.rand(so, si, generator=g) * in_f ** -0.5 + 0.2 * in_f ** -0.5
    b = torch.randn(out_f, generator=g).to(dtype) if bias else None
    return x, w, s, b


def _to(device, *ts):
    return [None if t is None else t.to(device) for t in ts]


def _check(device, x, w, s, b, block=(128, 128), **kw):
    x, w, s, b = _to(device, x, w, s, b)
    out = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=x.dtype, device=device)
    res = f8.fp8_linear(x, w, s, block, b, out=out, **kw)
    assert res is out
    w64 = dequantize_block_fp8(w.cpu(), s.cpu(), block, x.dtype).double()  # the rounded weight
    truth = x.double().cpu() @ w64.T
    if b is not None:
        truth += b.double().cpu()
    ref = REF.linear(x, w, b, s, block)
    tol = _tol(x.dtype)
    assert _rel(out, truth) < tol
    assert _rel(ref, truth) < tol  # the oracle itself, for scale
    assert _rel(out, ref) < tol
    return out


# ---- the kernel -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,in_f,out_f,bias", [
    (1, 256, 192, False),          # out a partial scale block
    (3, 300, 200, True),           # both partial; in not a multiple of BLOCK_K
    (37, 192, 136, False),         # several M rows of a tile, partial blocks
])
def test_fp8_linear(device, dtype, n, in_f, out_f, bias):
    g = _gen("lin", dtype, n, in_f, out_f, bias)
    _check(device, *_problem(g, n, in_f, out_f, dtype, bias))


@pytest.mark.parametrize("n,splits,bias", [(1, None, True), (3, 3, False), (37, 2, True)])
def test_fp8_linear_split_k(device, n, splits, bias):
    """Split-K (fp32 partials + ordered reduction) equals the unsplit result up to rounding."""
    g = _gen("split", n, splits, bias)
    x, w, s, b = _problem(g, n, 520, 72, torch.bfloat16, bias)   # 5 K blocks, one out tile
    if splits is None:  # the heuristic splits here: 2 tiles for 132 "SMs"
        assert f8.split_k(n, 72, 520, f8.get_config(n), 132)[0] > 1
    out = _check(device, x, w, s, b, splits=splits)
    one = _check(device, x, w, s, b, splits=1)
    assert _rel(out, one) < 1e-2


def test_fp8_linear_prefill_tiles(device):
    """The prefill tile (BLOCK_M 128, grouped order over several M tiles) at a small size."""
    g = _gen("prefill")
    cfg = f8.get_config(1 << 20)
    cfg.update(BLOCK_M=32, BLOCK_N=64, GROUP_M=3)   # 5 M tiles x 3 out tiles, groups of 3
    _check(device, *_problem(g, 150, 256, 160, torch.bfloat16, True), config=cfg)


@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_w8a8_cublas_blockwise(device, monkeypatch, bias):
    """From CUBLAS_MIN_ROWS rows w8a8 goes to cuBLASLt's block-scaled fp8 GEMM where torch has it:
    the same e4m3 products as the Triton GEMM and ReferenceOps' dynamic w8a8."""
    if device.type != "cuda":
        pytest.skip("cuBLASLt: CUDA only")
    monkeypatch.setattr(f8, "CUBLAS_MIN_ROWS", 64)
    g = _gen("w8a8-cublas", bias)
    x, w, s, b = _to(device, *_problem(g, 128, 384, 264, torch.bfloat16, bias))
    got = f8.fp8_linear(x, w, s, (128, 128), b, act_fp8=True)
    if f8._CUBLAS_OK.get(device.index if device.index is not None else torch.cuda.current_device()) is not True:
        pytest.skip("this torch's _scaled_mm takes no 1x128/128x128 block scales")
    monkeypatch.setattr(f8, "CUBLAS_MIN_ROWS", 1 << 30)
    triton_out = f8.fp8_linear(x, w, s, (128, 128), b, act_fp8=True)
    ref_a8 = ReferenceOps()
    ref_a8.fp8_activations = "dynamic"
    ref = ref_a8.linear(x, w, b, s, (128, 128))
    assert _rel(got, ref) < 5e-3 and _rel(got, triton_out) < 5e-3


def test_w8a8_tile_choice():
    """w8a8 takes its own measured tiles up to 16 rows (swapped) and past the table's 256-row
    entry; between them, and for w8a16 everywhere, the table's."""
    assert f8.get_config(16384, act_fp8=True) == f8.A8_PREFILL_CONFIG
    assert f8.get_config(16384) == f8.CONFIGS[-1][1]
    for n in (1, 16):
        assert f8.get_config(n, act_fp8=True) == f8.A8_DECODE_CONFIG and f8.A8_DECODE_CONFIG["SWAP_AB"]
        assert not f8.get_config(n).get("SWAP_AB")
    assert f8.get_config(17, act_fp8=True) == f8.get_config(17)
    assert f8.get_config(64, act_fp8=True) == f8.get_config(64)


def test_split_heuristic():
    sms = 132
    cfg = f8.get_config(1)
    assert f8.split_k(1, 512, 4096, cfg, sms)[0] > 1         # kv_a at decode: 8 tiles -> split
    assert f8.split_k(1, 154880, 4096, cfg, sms)[0] == 1     # lm_head fills the chip
    for n, out_f, in_f in ((1, 512, 4096), (16, 1536, 4096), (128, 128, 4096), (64, 4096, 16384)):
        c = f8.get_config(n)
        s, k_split = f8.split_k(n, out_f, in_f, c, sms)
        assert k_split % c["BLOCK_K"] == 0 and (s - 1) * k_split < in_f <= s * k_split
        assert s * n * out_f * 8 <= max(out_f * in_f, n * out_f * 8)   # workspace <= weight bytes
    for lim, c in f8.CONFIGS:
        assert 128 % c["BLOCK_N"] == 0 and 128 % c["BLOCK_K"] == 0


# ---- w8a8 (act_fp8) ---------------------------------------------------------------------------
@pytest.mark.parametrize("n,in_f,out_f,bias,kw", [
    (1, 520, 72, True, {}),                                       # split-K (heuristic), partial last group
    (3, 300, 200, True, dict(splits=1)),
    (37, 256, 136, False, {}),
    (150, 256, 160, True, dict(config=dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=3, num_warps=4,
                                           num_stages=3))),     # BLOCK_K forced to the scale block
    # swapped tiles (the weight rows on the MMA's M side): in-GEMM quantisation at 5 rows, act_quant's
    # rows at 64, split K, a ragged K and out tail
    (5, 520, 200, True, dict(config=dict(BLOCK_M=16, BLOCK_N=128, SWAP_AB=True, num_warps=8, num_stages=3))),
    (64, 384, 264, False, dict(config=dict(BLOCK_M=64, BLOCK_N=128, SWAP_AB=True, num_warps=8, num_stages=3),
                               splits=2)),
    (300, 384, 264, True, {}),                                    # past 256 rows: A8_PREFILL_CONFIG
])
def test_fp8_linear_w8a8(device, monkeypatch, n, in_f, out_f, bias, kw):
    """act_fp8: x quantised per row and 128-wide K block (inside the GEMM up to 16 rows, by
    act_quant above: PREQUANT_MIN_WEIGHT lowered so that these small weights take that route
    too), e4m3 x e4m3 products, against ReferenceOps with fp8_activations="dynamic"; the
    unquantised product is a few 1e-2 away."""
    monkeypatch.setattr(f8, "PREQUANT_MIN_WEIGHT", 0)
    g = _gen("w8a8", n, in_f, out_f, bias)
    x, w, s, b = _to(device, *_problem(g, n, in_f, out_f, torch.bfloat16, bias))
    out = f8.fp8_linear(x, w, s, (128, 128), b, act_fp8=True, **kw)
    ref_a8 = ReferenceOps()
    ref_a8.fp8_activations = "dynamic"
    ref = ref_a8.linear(x, w, b, s, (128, 128))
    assert _rel(out, ref) < 5e-3
    w16 = REF.linear(x, w, b, s, (128, 128))
    assert 5e-3 < _rel(out, w16) < 6e-2
    assert torch.equal(out, f8.fp8_linear(x, w, s, (128, 128), b, act_fp8=True, **kw))


def test_act_quant_kernel(device):
    """act_quant (the launch before a w8a8 GEMM of more than INKERNEL_QUANT_MAX_ROWS rows) gives
    exactly act_quant_e4m3's values: e4m3 codes and fp32 scales per row and 128-wide group
    (K 300: a partial last group; a zero row; a row of large values)."""
    from backends.fp8_numerics import act_quant_e4m3

    g = _gen("act-quant-kernel")
    x = torch.randn(5, 300, generator=g).to(torch.bfloat16)
    x[1] = 0
    x[3] *= 1e4
    xq, xs = f8.act_quant(x.to(device), 128)
    assert xq.dtype == FP8 and xs.shape == (5, 3)
    dq = (xq.cpu().float().view(5, 300) * xs.cpu().repeat_interleave(128, dim=1)[:, :300])
    assert torch.equal(dq, act_quant_e4m3(x, 128))


def test_fp8_linear_w8a8_prequantised_equals_in_kernel(device, monkeypatch):
    """The two w8a8 routes (x quantised once by act_quant, or per K tile inside the GEMM) multiply
    the same e4m3 values, up to the divide's last bit (see quant_act_e4m3)."""
    g = _gen("w8a8-routes")
    x, w, s, b = _to(device, *_problem(g, 24, 384, 136, torch.bfloat16, True))
    monkeypatch.setattr(f8, "PREQUANT_MIN_WEIGHT", 0)
    pre = f8.fp8_linear(x, w, s, (128, 128), b, act_fp8=True)
    monkeypatch.setattr(f8, "INKERNEL_QUANT_MAX_ROWS", 64)
    inside = f8.fp8_linear(x, w, s, (128, 128), b, act_fp8=True)
    # in the interpreter bit for bit; compiled, the GEMM's approximate divide moves a code now
    # and then (1.5e-3 on the H200) where act_quant divides as IEEE does
    assert _rel(pre, inside) < 5e-3


# ---- the ops entry point ---------------------------------------------------------------------
def test_ops_dispatch(device, monkeypatch):
    """CudaH200Ops.linear takes the kernel for fp8 weights (any leading dims), else the reference."""
    g = _gen("ops")
    x, w, s, b = _to(device, *_problem(g, 6, 256, 130, torch.bfloat16, True))
    ops = CudaH200Ops()
    calls = []
    kernel = f8.fp8_linear
    monkeypatch.setattr(f8, "fp8_linear", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    x3 = x.view(2, 3, 256)
    out = ops.linear(x3, w, b, s, (128, 128))
    assert calls == [1] and out.shape == (2, 3, 130)
    assert ops.fp8_activations == "dynamic"
    assert _rel(out.reshape(6, 130), _ref_for(ops).linear(x, w, b, s, (128, 128))) < 1e-2
    # above fp8_act_max_tokens rows (prefill chunks) the product stays w8a16, as in the reference
    ops.fp8_act_max_tokens = 5
    assert not ops.uses_w8a8(x, w, (128, 128))
    assert _rel(ops.linear(x, w, b, s, (128, 128)), REF.linear(x, w, b, s, (128, 128))) < 1e-2
    ops.fp8_act_max_tokens = 1024
    # refused: bf16 weight without scales, wrong scale shape -> the reference, bit for bit
    wb = (torch.randn(130, 256, generator=g) * 0.05).to(torch.bfloat16).to(device)
    assert _rel(ops.linear(x, wb, b), REF.linear(x, wb, b)) == 0.0
    assert not f8.supported(x, w, s[:1], (128, 128))
    assert not f8.supported(x, w, s, (96, 128))
    assert calls == [1, 1]
    empty = ops.linear(x[:0], w, b, s, (128, 128))
    assert empty.shape == (0, 130)


def test_model_linear_fp8(device):
    """The model's Linear (to_fp8 + quantize_block_fp8) on cuda-h200 ops vs the reference."""
    from glmrt.model.layers import Linear
    from glmrt.model.weights import quantize_block_fp8

    g = _gen("model")
    lin = Linear(REF, 320, 200, bias=False, dtype=torch.bfloat16)
    lin.to_fp8((128, 128))
    q, sc = quantize_block_fp8(torch.randn(200, 320, generator=g) * 0.05, (128, 128))
    lin.weight.data = q
    lin.weight_scale_inv.data = sc.float()
    lin = lin.to(device)
    x = torch.randn(5, 320, generator=g).to(device, torch.bfloat16)
    ops = CudaH200Ops()
    for mode in ("dynamic", "none"):  # w8a8 (the default) and w8a16, each against its reference
        ops.fp8_activations = mode
        lin.ops = _ref_for(ops)
        ref = lin(x)
        lin.ops = ops
        assert _rel(lin(x), ref) < 1e-2


# ---- GPU only: no host syncs, graph capture ----------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fp8_linear_graph_safe():
    dev = torch.device("cuda")
    g = _gen("graph")
    x, w, s, b = _to(dev, *_problem(g, 4, 4096, 512, torch.bfloat16, True))   # split-K path
    ops = CudaH200Ops()
    eager = ops.linear(x, w, b, s)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops.linear(x, w, b, s)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = ops.linear(x, w, b, s)
    x.copy_(torch.randn(4, 4096, generator=g).to(dev, torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert _rel(static, ops.linear(x, w, b, s)) == 0.0
    assert _rel(static, eager) > 0.0


# ---- 16-bit weights at decode sizes (skinny_linear: the same kernel, SCALED=False) ----------------
def _check_skinny(device, n, in_f, out_f, bias, dtype=torch.bfloat16, **kw):
    g = _gen(f"skinny{n}-{in_f}-{out_f}-{bias}")
    x = torch.randn(n, in_f, generator=g).to(dtype)
    w = (torch.randn(out_f, in_f, generator=g) * in_f ** -0.5).to(dtype)
    b = torch.randn(out_f, generator=g).to(dtype) if bias else None
    xd, wd, bd = _to(device, x, w, b)
    out = f8.skinny_linear(xd, wd, bd, **kw)
    truth = x.double() @ w.double().T + (b.double() if bias else 0)
    assert out.shape == (n, out_f) and out.dtype == dtype
    assert _rel(out, truth) < _tol(dtype)
    assert _rel(REF.linear(xd, wd, bd), truth) < _tol(dtype)


@pytest.mark.parametrize("n,in_f,out_f,bias,splits", [
    (1, 512, 200, False, None),    # out not a multiple of the tile
    (3, 300, 96, True, None),      # K not a multiple of BLOCK_K, bias
    (8, 256, 64, False, None),     # the most rows it takes
    (2, 1024, 48, True, 3),        # split K (+ the reduce launch, bias added there)
    (1, 96, 4096, False, None),    # short K, wide out (the KDA f_b / g_b shape class)
])
def test_skinny_linear(device, n, in_f, out_f, bias, splits):
    _check_skinny(device, n, in_f, out_f, bias, splits=splits)


def test_skinny_config_shapes():
    """The tile rule at the decode shapes of the real model, on 132 SMs: wide out tiles where the
    out dim alone fills the SMs twice, a K tile of ~16 KB of weight, K split when the out tiles
    are few or K is long."""
    cases = {  # (out, in) -> (BLOCK_N, splits)
        (154880, 4096): (128, 1),    # LM head
        (24896, 4096): (64, 1),      # KDA in_proj (q, k, v, f_a, g_a, b)
        (4096, 8192): (64, 4),       # KDA o_proj: long K behind 4K outputs, 64-wide tiles, K in 4
        (2048, 4096): (64, 4),       # MLA q_a + kv_a
        (4096, 16384): (64, 4),      # MLA o_proj
        (4096, 1536): (16, 1),       # indexer wq_b: short K stays unsplit (and with cuBLAS)
        (128, 4096): (16, 8),        # indexer wk: 8 out tiles, K split
    }
    for (out_f, in_f), (bn, s) in cases.items():
        cfg, splits, k_split = f8.skinny_config(1, out_f, in_f, 132)
        assert (cfg["BLOCK_N"], splits) == (bn, s), (out_f, in_f, cfg, splits)
        assert cfg["BLOCK_N"] * cfg["BLOCK_K"] * 2 <= f8.SKINNY_TILE_BYTES
        assert k_split * splits >= in_f and k_split % cfg["BLOCK_K"] == 0


def test_skinny_dispatch(device, monkeypatch):
    """CudaH200Ops.linear takes the skinny kernel for a few 16-bit rows ("all"), only at the shapes
    where it measured faster ("measured", the default), cuBLAS past SKINNY_MAX_ROWS, and never "off"."""
    calls = []
    kernel = f8.skinny_linear
    monkeypatch.setattr(f8, "skinny_linear", lambda *a, **k: calls.append(a[0].shape[0]) or kernel(*a, **k))
    ops = CudaH200Ops()
    assert ops.skinny_linear == "measured"
    g = _gen("dispatch")
    w = torch.randn(64, 128, generator=g).to(device, torch.bfloat16)         # short K: preferred
    for rows in (1, f8.SKINNY_MAX_ROWS, f8.SKINNY_MAX_ROWS + 1):
        x = torch.randn(rows, 128, generator=g).to(device, torch.bfloat16)
        assert _rel(ops.linear(x, w), REF.linear(x, w)) < _tol(torch.bfloat16)
    assert calls == [1, f8.SKINNY_MAX_ROWS]
    wide = torch.randn(4096, 1024, generator=g).to(device, torch.bfloat16)   # 16-wide tiles, long K
    assert not f8.skinny_preferred(1, 4096, 1024, 132)
    x = torch.randn(1, 1024, generator=g).to(device, torch.bfloat16)
    ops.linear(x, wide)
    assert calls == [1, f8.SKINNY_MAX_ROWS]
    ops.skinny_linear = "all"
    ops.linear(x, wide)
    assert calls == [1, f8.SKINNY_MAX_ROWS, 1]
    ops.skinny_linear = "off"
    ops.linear(torch.randn(1, 128, generator=g).to(device, torch.bfloat16), w)
    assert calls == [1, f8.SKINNY_MAX_ROWS, 1]
    x3 = torch.randn(2, 1, 128, generator=g).to(device, torch.bfloat16)   # leading dims kept
    assert CudaH200Ops().linear(x3, w).shape == (2, 1, 64)
