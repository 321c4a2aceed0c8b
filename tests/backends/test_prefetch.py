"""L2 prefetch of the weights a decode step reads next (backends/kernels/prefetch.py).

The prefetch is a hint, so what it may change is only when bytes arrive: the checks here are
that a decode forward asks for the right weights at the right places, that the cuda-h200 ops
ask only for few-token forwards on the GPU, and that the kernel keeps the PDL chain ordered
(its trigger first, then the prefetches, then its wait), read in the PTX compiled for sm_90.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import types

import pytest
import torch

triton = pytest.importorskip("triton")

from backends.kernels import prefetch  # noqa: E402


def test_plan_spends_the_budget_in_order():
    per = prefetch.PROGRAM_BYTES
    nbytes, firsts = prefetch.plan([3 * per + 1, 10, 5], max_bytes=3 * per + 5)
    assert nbytes == [3 * per + 1, 4, 0]
    assert firsts == [0, 4, 5, 5]  # 4 programs, 1 program, none
    nbytes, firsts = prefetch.plan([1 << 40])
    assert nbytes == [prefetch.MAX_BYTES, 0, 0] and firsts[3] == triton.cdiv(prefetch.MAX_BYTES, per)
    assert prefetch.plan([7], max_bytes=0) == ([0, 0, 0], [0, 0, 0, 0])


def test_off_the_gpu_nothing_is_launched():
    prefetch.prefetch_l2([torch.ones(100), torch.ones(3)])  # CPU tensors: returns at once
    prefetch.prefetch_l2([])


def test_cuda_h200_prefetches_only_few_token_forwards(monkeypatch):
    from backends.cuda_h200 import CudaH200Ops

    asked = []
    monkeypatch.setattr(prefetch, "prefetch_l2", lambda ts: asked.append(len(ts)))
    on_gpu = types.SimpleNamespace(is_cuda=True)
    ops = CudaH200Ops()
    ops.l2_prefetch_max_tokens = 1
    ops.prefetch_weights([on_gpu])  # no forward begun: a kernel bench, not a step
    ops.begin_forward(ops.l2_prefetch_max_tokens + 1)
    ops.prefetch_weights([on_gpu])
    ops.begin_forward(1)
    ops.prefetch_weights([torch.ones(2)])  # CPU weights
    assert asked == []
    ops.prefetch_weights([on_gpu, on_gpu])
    assert asked == [2]
    ops.l2_prefetch_max_tokens = 0
    ops.prefetch_weights([on_gpu])
    assert asked == [2]


_COMPILE = """
import sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from backends.kernels import prefetch
fn = prefetch._prefetch_l2_kernel
sig = {"P0": "*u8", "N0": "i64", "P1": "*u8", "N1": "i64", "P2": "*u8", "N2": "i64", "F1": "i32", "F2": "i32",
       "BYTES": "constexpr", "STEP": "constexpr", "BULK": "constexpr", "PDL": "constexpr"}
bulk = sys.argv[2] == "bulk"
step = prefetch.PROGRAM_BYTES // (32 * prefetch.NUM_WARPS) if bulk else prefetch._STEP[sys.argv[2]]
cx = {(fn.arg_names.index(k),): v for k, v in (("BYTES", prefetch.PROGRAM_BYTES), ("STEP", step), ("BULK", bulk),
                                                 ("PDL", sys.argv[1] == "1"))}
k = triton.compile(ASTSource(fn, sig, constexprs=cx), target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=prefetch.NUM_WARPS))
print(k.asm["ptx"])
"""


def _ptx(pdl_on: bool, mode: str) -> list[str]:
    """The kernel's PTX for sm_90, compiled in a child without the interpreter (as it launches)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", "import triton\n" + _COMPILE, "1" if pdl_on else "0", mode],
                         capture_output=True, text=True, env=env, timeout=300, check=True,
                         cwd=pathlib.Path(__file__).resolve().parents[2])
    return [line.strip() for line in out.stdout.splitlines()]


@pytest.mark.parametrize("pdl_on, mode", [(False, "line"), (True, "line"), (True, "sector"), (True, "bulk")])
def test_the_kernel_triggers_then_prefetches_then_waits(pdl_on, mode):
    """Its successor may start at once (the trigger), the prefetches overlap the predecessor, and
    the kernel ends only after the predecessor has (the wait): the chain stays ordered."""
    lines = _ptx(pdl_on, mode)
    op = "cp.async.bulk.prefetch.L2.global" if mode == "bulk" else "prefetch.global.L2"
    pf = [i for i, s in enumerate(lines) if op in s]
    trig = [i for i, s in enumerate(lines) if s.startswith("griddepcontrol.launch_dependents")]
    wait = [i for i, s in enumerate(lines) if s.startswith("griddepcontrol.wait")]
    assert pf, "no prefetch instruction"
    assert not any(s.startswith(("ld.global", "st.global")) for s in lines)  # reads nothing, writes nothing
    if pdl_on:
        assert len(trig) == 1 and len(wait) == 1 and trig[0] < min(pf) and max(pf) < wait[0]
    else:
        assert not trig and not wait


def test_a_decode_forward_asks_for_the_weights_it_reads_next():
    """Each attention layer asks for its o_proj after its input GEMV; each layer asks for its MLP's
    fixed weights after the attention and for the next layer's first GEMV (the LM head after the
    last) after the MLP."""
    from backends.reference import ReferenceOps
    from glmrt.checkpoint.presets import preset_config
    from glmrt.model.loader import load_dummy
    from glmrt.model.session import DirectSession

    class Recording(ReferenceOps):
        def __init__(self):
            super().__init__()
            self.asked: list[list[int]] = []

        def prefetch_weights(self, tensors):
            self.asked.append([t.data_ptr() for t in tensors])

    ops = Recording()
    model = load_dummy(preset_config("tiny"), ops, dtype=torch.float32, with_vision=False, with_mtp=False, seed=2)
    sess = DirectSession(model, max_requests=2, max_tokens=64)
    rid = sess.new_request()
    sess.step({rid: list(range(1, 12))})
    ops.asked.clear()
    sess.step({rid: [5]})

    def ptrs(ts):
        return [t.data_ptr() for t in ts]

    want = []
    layers = model.model.layers
    for i, layer in enumerate(layers):
        want.append(ptrs([layer.self_attn.o_proj.weight]))
        want.append(ptrs(layer.mlp.first_weights()))
        nxt = layers[i + 1].self_attn.first_weights() if i + 1 < len(layers) else [model.lm_head.weight]
        want.append(ptrs(nxt))
    assert ops.asked == want
    kda = next(layer.self_attn for layer in layers if not layer.is_dsa)
    assert ptrs(kda.first_weights()) == [kda.q_proj.weight.data_ptr()]  # the fused in_proj starts with q
