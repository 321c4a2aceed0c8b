"""The Hopper w8a8 prefill GEMMs of the fused MoE (backends/kernels/fused_moe_sm90.py).

Gluon has no interpreter, so on a machine without CUDA both GEMMs are compiled for sm_90 down to
the cubin (layouts, shared memory, registers, and that ptxas keeps the products asynchronous); on
a Hopper GPU the fused MoE is run through them and compared with the Triton GEMMs they stand in
for.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton")

from backends.kernels import fused_moe as fm  # noqa: E402
from backends.kernels import fused_moe_sm90 as g  # noqa: E402
from tests.backends.conftest import INTERPRET, gen, rel  # noqa: E402
from tests.backends.moe_problems import problem, truth  # noqa: E402

_COMPILE = """
import json, os, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from backends.kernels import fused_moe_sm90 as g
part, variant = sys.argv[1], json.loads(sys.argv[2])
c = {**g.CONFIG[part], **variant}
fn = g._moe_gemm_sm90_kernel
merged = part == "gate_up" and c.get("merged", False)
rows = c["BLOCK_N"] // (c["num_warps"] // 4) if merged else c["BLOCK_N"]  # a weight tile by TMA
layout = gl.NVMMASharedLayout.get_default_for([rows, g.BLOCK_K], gl.float8e4nv)
desc = f"tensordesc<fp8e4nv[{rows}, {g.BLOCK_K}],{layout!r}>"
types = dict(X="*fp8e4nv", XS="*fp32", W0=desc, W1=desc, S0="*fp32", S1="*fp32", OUT="*bf16", RW="*bf16",
             SORTED="*i32", BLOCK_EXPERT="*i32", BLOCK_ROWS="*i32", limit="fp32")
consts = dict(GATE_UP=part == "gate_up", MERGED=merged, HAS_LIMIT=True, BLOCK_M=g.BLOCK_M, BLOCK_N=c["BLOCK_N"], BLOCK_K=g.BLOCK_K,
              GROUP_M=c["GROUP_M"], STAGES=c["STAGES"], SCALE_BN=128, num_warps=c["num_warps"])
sig = {a: "constexpr" if a in consts else types.get(a, "i32") for a in fn.arg_names}
# the activations, their scales and the outputs are 16-byte aligned with 16-byte row strides (`supported`)
aligned = ("X", "XS", "OUT", "stride_x", "stride_out", "K") + (() if c.get("b_tma", True) else ("W0", "W1"))
src = GluonASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                     attrs={(fn.arg_names.index(a),): [("tt.divisibility", 16)] for a in aligned})
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=c["num_warps"]))
path = os.path.join(tempfile.mkdtemp(), "k.ptx")
open(path, "w").write(k.asm["ptx"])
ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
info = subprocess.run([ptxas, "-v", "-arch=sm_90a", path, "-o", os.devnull], capture_output=True, text=True,
                      check=True).stderr
print(json.dumps(dict(shared=k.metadata.shared, ptx=k.asm["ptx"], ptxas=info)))
"""

# the table's tiles, and the variants `bench.moe_h200 --prefill-gemm` times beside them
VARIANTS = [("gate_up", {}), ("down", {}), ("gate_up", dict(merged=False)), ("gate_up", dict(merged=True)),
            ("gate_up", dict(merged=True, BLOCK_N=128, num_warps=8)), ("down", dict(num_warps=8))]
_SM_SHARED = 233472  # an H100 / H200 SM's shared memory; each block also holds 1 KB of its own


@pytest.mark.parametrize("part,variant", VARIANTS)
def test_compiles_for_sm90_with_products_in_flight(part, variant, tmp_path):
    # in a child without TRITON_INTERPRET (the interpreter swaps Triton's own jit helpers, which the
    # compiler then refuses) and with its own cache, so the compiler really runs
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", _COMPILE, part, json.dumps(variant)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    k = json.loads(done.stdout.strip().splitlines()[-1])
    c = {**g.CONFIG[part], **variant}
    if not variant:  # the table's tiles: two programs an SM, so one's scaling overlaps the other's products
        assert 2 * (k["shared"] + 1024) <= _SM_SHARED
    assert k["shared"] + 1024 <= _SM_SHARED
    # a step is two K blocks of 128 (four k32 wgmmas each), gate and up apart or merged into one
    # product, or down; each warpgroup takes BLOCK_N / warpgroups of the tile's columns (of each
    # of gate and up when merged)
    merged = part == "gate_up" and c.get("merged", False)
    n = c["BLOCK_N"] // (c["num_warps"] // 4) * (2 if merged else 1)
    per_step = 2 * 4 * (2 if part == "gate_up" and not merged else 1)
    assert k["ptx"].count(f"wgmma.mma_async.sync.aligned.m64n{n}k32.f32.e4m3.e4m3") == per_step
    # the even block is retired while the odd one is in flight
    waits = re.findall(r"wgmma.wait_group.sync.aligned (\d+)", k["ptx"])
    assert waits == [str(per_step // 8), "0"]
    # ptxas would otherwise serialise every wgmma of the kernel (C7514)
    assert "C7514" not in k["ptxas"], k["ptxas"]
    assert "0 bytes spill stores" in k["ptxas"], k["ptxas"]


def test_bad_setting_is_refused():
    x = torch.zeros(2, 4, dtype=torch.bfloat16)
    w = torch.zeros(1, 4, 4, dtype=torch.float8_e4m3fn)
    old = fm.PREFILL_GEMM
    try:
        fm.PREFILL_GEMM = "cutlass"
        with pytest.raises(ValueError, match="PREFILL_GEMM"):
            fm._hopper_gemms(x, w, w, (128, 128))
        fm.PREFILL_GEMM = "sm90"
        assert fm._hopper_gemms(x, w, w, (128, 128)) is None  # not a GPU tensor
    finally:
        fm.PREFILL_GEMM = old


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.version.hip is None and torch.cuda.get_device_capability()[0] == 9


def _counted(monkeypatch):
    calls = []
    for name in ("gate_up", "down"):
        run = getattr(g, name)
        monkeypatch.setattr(g, name, lambda *a, _run=run, _name=name, **k: calls.append(_name) or _run(*a, **k))
    return calls


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET or not _hopper(), reason="runs on a Hopper GPU")
@pytest.mark.parametrize("variant", VARIANTS[2:] + [None])
def test_matches_the_triton_gemms(variant, monkeypatch):
    """The fused MoE at prefill sizes (x and h quantised by act_quant first) through the Gluon
    GEMMs against the Triton ones: the same e4m3 operands, K-block partials and roundings, so
    equal up to the order in which an fp32 add and multiply are fused. Routing with experts that
    get no token, pairs dropped (-1), and blocks the alignment leaves partly empty."""
    dev = torch.device("cuda")
    if variant is not None:
        part, v = variant
        monkeypatch.setattr(g, "CONFIG", {**g.CONFIG, part: {**g.CONFIG[part], **v}})
    monkeypatch.setattr(fm, "INKERNEL_QUANT_MAX_TOKENS", 16)
    gg = gen("moe-sm90", str(variant))
    x, ids, weights, ws, scales = problem(gg, 300, 512, 768, 12, 4, torch.bfloat16, True, 9)
    ids[torch.rand(ids.shape, generator=gg) < 0.05] = -1
    x, ids, weights = x.to(dev), ids.to(dev), weights.to(dev)
    ws, scales = [w.to(dev) for w in ws], tuple(s.to(dev) for s in scales)
    calls = _counted(monkeypatch)
    out = {}
    for gemm in ("triton", "sm90"):
        monkeypatch.setattr(fm, "PREFILL_GEMM", gemm)
        out[gemm] = fm.fused_moe(x, ids, weights, *ws, 7.0, scales, act_fp8=True)
    assert calls == ["gate_up", "down"]
    assert rel(out["sm90"], out["triton"]) < 1e-3
    assert rel(out["sm90"], truth(x, ids, weights, ws, scales, 7.0).to(dev)) < 6e-2  # the e4m3 activations
    assert torch.equal(out["sm90"], fm.fused_moe(x, ids, weights, *ws, 7.0, scales, act_fp8=True))


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET or not _hopper(), reason="runs on a Hopper GPU")
def test_shapes_it_does_not_take_keep_the_triton_gemms(monkeypatch):
    """An output width the N tile does not divide (D 320), or K blocks too few for the ring: the
    Triton GEMMs run, with the same result as when asked for."""
    dev = torch.device("cuda")
    monkeypatch.setattr(fm, "INKERNEL_QUANT_MAX_TOKENS", 16)
    calls = _counted(monkeypatch)
    for d, i in ((320, 512), (512, 256)):
        x, ids, weights, ws, scales = problem(gen("moe-sm90-no", str(d)), 64, d, i, 6, 3, torch.bfloat16, True, 5)
        x, ids, weights = x.to(dev), ids.to(dev), weights.to(dev)
        ws, scales = [w.to(dev) for w in ws], tuple(s.to(dev) for s in scales)
        monkeypatch.setattr(fm, "PREFILL_GEMM", "sm90")
        out = fm.fused_moe(x, ids, weights, *ws, 7.0, scales, act_fp8=True)
        monkeypatch.setattr(fm, "PREFILL_GEMM", "triton")
        assert torch.equal(out, fm.fused_moe(x, ids, weights, *ws, 7.0, scales, act_fp8=True))
    assert calls == []
