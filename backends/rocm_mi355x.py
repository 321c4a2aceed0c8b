"""The `rocm-mi355x` kernel set (AMD Instinct MI355X, gfx950). Never run on that hardware.

The cuda-h200 Triton kernels through Triton's ROCm backend (PyTorch's ROCm build exposes the
GPU as `cuda`, so the same dispatch applies): DSA decode, RMSNorm and mHC from
`backends/kernels/`, the reference torch path for the rest. Nothing here is ROCm-specific (no
AITER, no MFMA-tuned tiles). Its defaults live in `backends/adapters.py`: fp8_e4m3 KV by
default (gfx950 uses the OCP e4m3 format, torch.float8_e4m3fn), MXFP4 as the preferred weight
format (dequantised on load once the loader reads it), and neither DFlash2 nor breakable CUDA
graphs (SGLang's MI355X recipe disables both). The selection logic is unit-tested on CPU; the
kernels have not been compiled or run on gfx950, and nothing is claimed about their speed there.

Importing this module registers the backend. `backends.registry` imports it lazily, only when
resolving a name on gfx950 hardware; without Triton the import fails with ImportError and the
registry keeps the reference.
"""

from __future__ import annotations

from .cuda_h200 import CudaH200Ops  # ImportError without Triton
from .registry import register


class RocmMI355XOps(CudaH200Ops):
    """CudaH200Ops on gfx950 through Triton's ROCm backend (untested on MI355X hardware)."""

    name = "rocm-mi355x"


register("rocm-mi355x", RocmMI355XOps)
