"""The `cuda-blackwell` kernel set (SM100/SM103: B200, GB200, B300, GB300). Never run on that hardware.

It is the cuda-h200 kernel set under another name: Triton kernels are portable across NVIDIA
architectures, so the DSA decode, RMSNorm and mHC kernels of `backends/kernels/` are used as
they are; nothing here is Blackwell-specific (no TMEM / tcgen05 MMA, no FP4 tensor-core GEMM).
Its defaults differ, and live in `backends/adapters.py`: fp8_e4m3 KV by default, NVFP4 as the
preferred weight format (dequantised on load once the loader reads it). The selection logic is
unit-tested on CPU; the kernels have not been compiled or run on SM100, and nothing is claimed
about their speed there.

Importing this module registers the backend. `backends.registry` imports it lazily, only when
resolving a name on sm100 hardware; without Triton the import fails with ImportError and the
registry keeps the reference.
"""

from __future__ import annotations

from .cuda_h200 import CudaH200Ops  # ImportError without Triton
from .registry import register


class CudaBlackwellOps(CudaH200Ops):
    """CudaH200Ops on SM100 (same portable Triton kernels; untested on Blackwell hardware)."""

    name = "cuda-blackwell"


register("cuda-blackwell", CudaBlackwellOps)
