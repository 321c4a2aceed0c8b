"""Shared setup of the kernel tests: where they run, and how results are compared.

Without CUDA the kernels run in Triton's interpreter on CPU tensors: TRITON_INTERPRET=1 is set
here, before any test module imports Triton, so the CPU cases run wherever Triton is installed
(the test extra pins it). With CUDA the same tests run compiled on the GPU (the "cuda" case of
the `device` fixture, marked `gpu`: `pytest -m gpu tests/backends` on a CUDA host).
Bounds, relative to a float64 evaluation of the same rounded inputs: fp32 ~1e-5, bf16 operands
~1e-2 (`tol`): fp32 accumulation error over these sizes, and a few bf16 roundings (2^-8 each).
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _devices():
    return [
        pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="CPU tensors need TRITON_INTERPRET=1")),
        pytest.param("cuda", marks=[pytest.mark.gpu,
                                    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]),
    ]


@pytest.fixture(params=_devices())
def device(request):
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def _threads():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; a NaN in `out` (an unwritten element) fails."""
    out, ref = out.double().cpu(), ref.double().cpu()
    assert not torch.isnan(out).any(), "NaN in output (unwritten element?)"
    return float((out - ref).norm() / ref.norm())


def gen(*key) -> torch.Generator:
    """A CPU generator seeded by the test's own key: fresh, reproducible inputs per case."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def tol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1e-2
