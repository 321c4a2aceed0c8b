"""The dense MLP's activation in one launch: silu(clamp(gate, max=limit)) * clamp(up, -limit, limit).

ReferenceOps.swiglu is four launches (two clamps, silu, the product); a decode step of a model
with dense layers (GLM-5.3-Flash's first three) pays them per layer. gate and up are the two
column halves of the fused gate/up product (rows strided by its width); the output is dense.
Rounding as torch's: the clamps are exact, silu in fp32 rounded to the input dtype, then the
product in fp32 rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .pdl import pdl_enter

BLOCK = 1024


@triton.jit
def _swiglu_kernel(G, U, Y, stride_g, stride_u, I, limit, HAS_LIMIT: tl.constexpr, BLOCK: tl.constexpr,
                   PDL: tl.constexpr = False):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < I
    dt = Y.dtype.element_ty
    g = tl.load(G + row * stride_g + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_LIMIT:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(Y + row * I + offs, (s * u).to(dt), mask=ok)


def supports(gate: torch.Tensor, up: torch.Tensor) -> bool:
    return (gate.dim() == 2 and gate.shape == up.shape and gate.dtype == up.dtype
            and gate.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and gate.stride(1) == 1 and up.stride(1) == 1 and gate.device == up.device)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """ReferenceOps.swiglu for [N, I] gate and up with dense rows (any row stride)."""
    n, i = gate.shape
    y = torch.empty((n, i), dtype=gate.dtype, device=gate.device)
    if n and i:
        _swiglu_kernel[(n, triton.cdiv(i, BLOCK))](gate, up, y, gate.stride(0), up.stride(0), i,
                                                   float(limit) if limit is not None else 0.0,
                                                   HAS_LIMIT=limit is not None, BLOCK=BLOCK,
                                                   **pdl.launch(gate.device), num_warps=4)
    return y
