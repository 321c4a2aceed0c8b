"""The Hopper sparse-MLA prefill kernel (backends/kernels/sparse_mla_sm90.py).

Gluon has no interpreter, so on a machine without CUDA the kernel is compiled for sm_90 down to
the cubin (its layouts, shared-memory budget and register use checked by Triton's compiler and
ptxas); on a Hopper GPU it is run and compared with the Triton kernel it stands in for.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton")

from backends.kernels import sparse_mla_sm90 as g  # noqa: E402
from tests.backends.conftest import INTERPRET, gen, rel  # noqa: E402

_COMPILE = """
import json, os, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from backends.kernels import sparse_mla_sm90 as g
sig = dict(Q="*bf16", KV="*bf16", IDX="*i32", NTOK="*i32", O="*bf16", stride_qb="i32", stride_qh="i32",
           stride_kv="i32", stride_ib="i32", stride_ob="i32", stride_oh="i32", K="i32", qk_scale="fp32",
           H="constexpr", R="constexpr", BLOCK_N="constexpr", STAGES="constexpr", num_warps="constexpr")
fn = g._sparse_mla_rows_sm90_kernel
consts = dict(H=g.HEADS, R=g.RANK, **{**g.CONFIG, **json.loads(sys.argv[1])}, num_warps=g.NUM_WARPS)
# the pointers and the row strides of q, the cache and out are 16-byte multiples (`supported`); the
# row lists' stride and width are whatever the selection makes them
aligned = ("Q", "KV", "IDX", "NTOK", "O", "stride_qb", "stride_qh", "stride_kv", "stride_ob", "stride_oh")
src = GluonASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                     attrs={(fn.arg_names.index(a),): [("tt.divisibility", 16)] for a in aligned})
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=g.NUM_WARPS))
path = os.path.join(tempfile.mkdtemp(), "k.ptx")
open(path, "w").write(k.asm["ptx"])
ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
info = subprocess.run([ptxas, "-v", "-arch=sm_90a", path, "-o", os.devnull], capture_output=True, text=True,
                      check=True).stderr
print(json.dumps(dict(shared=k.metadata.shared, ptx=k.asm["ptx"], ptxas=info)))
"""


# the table's tile, and the variants `bench.prefill_h200 --mla-sweep` times beside it
VARIANTS = [{}, dict(BLOCK_N=32, STAGES=4)]


@pytest.mark.parametrize("variant", VARIANTS)
def test_compiles_for_sm90_without_spills(variant, tmp_path):
    # in a child without TRITON_INTERPRET (the interpreter swaps Triton's own jit helpers, which the
    # compiler then refuses) and with its own cache, so the compiler really runs
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(variant)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    k = json.loads(done.stdout.strip().splitlines()[-1])
    assert k["shared"] <= 232448  # an H100 / H200 block's shared memory
    # the score tile is split between the warpgroups: 64 x BLOCK_N/2 each, K 512 in 32 steps
    half = {**g.CONFIG, **variant}["BLOCK_N"] // 2
    assert k["ptx"].count(f"wgmma.mma_async.sync.aligned.m64n{half}k16") == 32
    assert k["ptx"].count("wgmma.mma_async.sync.aligned.m64n256k16") == half // 8  # P·C: K = BLOCK_N
    assert "0 bytes spill stores" in k["ptxas"], k["ptxas"]


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.version.hip is None and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET or not _hopper(), reason="runs on a Hopper GPU")
@pytest.mark.parametrize("rows", [1, 63, 64, 65, 300])
@pytest.mark.parametrize("variant", VARIANTS)
def test_matches_the_triton_kernel(rows, variant):
    from backends.kernels import sparse_mla as sm

    dev, bf = torch.device("cuda"), torch.bfloat16
    gg = gen("sm90", rows)  # the same inputs for every variant
    b, k = 37, 320
    cache = torch.randn(rows + 20, g.RANK, generator=gg).to(dev, bf)
    q = (torch.randn(b, g.HEADS, g.RANK, generator=gg) * g.RANK ** -0.25).to(dev, bf)
    idx = torch.randint(0, rows + 20, (b, k), generator=gg, dtype=torch.int32)
    idx[torch.rand(b, k, generator=gg) < 0.1] = -1  # holes anywhere in a row's list
    ntok = torch.randint(0, min(rows, k) + 1, (b,), generator=gg, dtype=torch.int32)
    ntok[0], ntok[1] = 0, min(rows, k)  # a row with nothing to attend to, a full one
    idx, ntok = idx.to(dev), ntok.to(dev)
    ref = sm.sparse_mla_decode(q, cache, idx, 0.07, ntok, num_splits=1, config=dict(BLOCK_N=64))
    out = g.sparse_mla_rows_sm90(q, cache, idx, ntok, 0.07, torch.full_like(q, float("nan")), config=variant)
    assert (out[0] == 0).all()  # written as zeros, like the Triton kernel (the buffer starts as NaN)
    assert rel(out, ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET or not _hopper(), reason="runs on a Hopper GPU")
@pytest.mark.parametrize("kernel", ["sm90", "triton"])
def test_prefill_op_at_the_full_shape(kernel, monkeypatch):
    """The op a prefill calls, at 64 heads x 512, against the reference: a long prompt (enough
    rows for the Hopper kernel), a cached prefix, a decode token and an empty request; and 40
    rows after a prefix, each attending to 40 pools: too few rows for the chip, lists long
    enough to split, so the Triton kernel's split launch keeps them."""
    from backends.kernels import sparse_mla_prefill as smp
    from backends.reference import ReferenceOps
    from tests.backends.dsa_problems import generator, h200_ops, prefill_mla_inputs, prefill_sel

    monkeypatch.setattr(smp, "PREFILL_KERNEL", kernel)
    calls = []
    run = g.sparse_mla_rows_sm90
    monkeypatch.setattr(g, "sparse_mla_rows_sm90", lambda *a, **k: calls.append(a[0].shape[0]) or run(*a, **k))
    # 910 rows of up to 23 pools + tail (two blocks of the kernel's loop); 40 rows of up to 39 pools
    for reqs, topk, hopper in (([(0, 900), (13, 9), (30, 1), (7, 0)], 24, kernel == "sm90"), ([(200, 40)], 40, False)):
        calls.clear()
        meta, cache, q, w_kc, w_vc = prefill_mla_inputs(reqs, g.RANK, torch.bfloat16, torch.device("cuda"),
                                                        seed=95, h=g.HEADS)
        sel = prefill_sel(meta, 4, topk, generator(96))
        ref = ReferenceOps().sparse_mla(q, cache, w_kc, w_vc, sel, meta, 4, 0.25, True)
        out = h200_ops().sparse_mla(q, cache, w_kc, w_vc, sel, meta, 4, 0.25, True)
        assert calls == ([meta.num_tokens] if hopper else [])
        empty = torch.isnan(ref).flatten(1).any(1)  # a query that sees no token: NaN there, zeros here
        assert (out[empty] == 0).all()
        assert rel(out[~empty], ref[~empty]) < 2e-2
