"""Programmatic dependent launch (backends/kernels/pdl.py): GPU only.

PDL changes when a kernel starts, never what it computes: the tiny model's logits through decode
CUDA graphs must be bit-identical with it on and off (GPU). And every kernel compiled for a PDL launch
must wait for its predecessor before its first global memory access: checked in the PTX of each
kernel the run compiled (a load hoisted above `griddepcontrol.wait` would be a race that a
numeric comparison only catches by luck; GPU). And the launch flags follow the batch size (CPU).
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest
import torch

triton = pytest.importorskip("triton")

from tests.backends.decode_steps import decode_logits  # noqa: E402

_GLOBAL = ("ld.global", "st.global", "atom.global", "red.global", "cp.async", "ld.volatile.global")


def _decode_logits(pdl_on: bool) -> torch.Tensor:
    from backends.kernels import pdl

    pdl.ENABLED = pdl_on
    max_tokens, pdl.MAX_TOKENS = pdl.MAX_TOKENS, 16  # the test batch (3 rows) takes PDL too
    try:
        return decode_logits()
    finally:
        pdl.ENABLED, pdl.MAX_TOKENS = True, max_tokens


def test_pdl_only_for_small_forwards(monkeypatch):
    """The launch flags follow the forward's token count (told by CudaH200Ops.begin_forward):
    PDL up to MAX_TOKENS on an SM90+ device, never on CPU tensors or under the interpreter."""
    from backends.cuda_h200 import CudaH200Ops
    from backends.kernels import pdl

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setitem(pdl._CAPABLE, 0, True)   # a pretend SM90 device 0: nothing is launched here
    dev = torch.device("cuda", 0)
    try:
        CudaH200Ops().begin_forward(pdl.MAX_TOKENS)
        assert pdl.launch(dev) == {"PDL": True, "launch_pdl": True}
        CudaH200Ops().begin_forward(pdl.MAX_TOKENS + 1)
        assert pdl.launch(dev) == {"PDL": False}
        pdl.set_tokens(None)  # not told (a kernel bench): on
        assert pdl.launch(dev)["PDL"]
        assert pdl.launch(torch.device("cpu")) == {"PDL": False}
        monkeypatch.setattr(pdl, "ENABLED", False)
        assert pdl.launch(dev) == {"PDL": False}
    finally:
        pdl.set_tokens(None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pdl_decode_bit_identical():
    on, off = _decode_logits(True), _decode_logits(False)
    assert torch.isfinite(on).all()
    assert torch.equal(on, off)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pdl_kernels_wait_before_memory():
    _decode_logits(True)  # compiles the decode path's kernels with PDL
    import backends.kernels as bk
    from triton.runtime.jit import JITFunction

    checked = 0
    for info in pkgutil.iter_modules(bk.__path__):
        mod = importlib.import_module(f"backends.kernels.{info.name}")
        for name, fn in vars(mod).items():
            if not isinstance(fn, JITFunction):
                continue
            for cache in fn.device_caches.values():
                for kernel in cache[0].values():
                    if not getattr(kernel.metadata, "launch_pdl", False):
                        continue
                    ptx = kernel.asm["ptx"].splitlines()
                    wait = next((i for i, s in enumerate(ptx) if "griddepcontrol.wait" in s), None)
                    first = next((i for i, s in enumerate(ptx) if any(t in s for t in _GLOBAL)), len(ptx))
                    assert wait is not None and wait < first, f"{info.name}.{name}: global access before the PDL wait"
                    checked += 1
    assert checked >= 10, checked  # the decode step's kernels did compile for PDL
