"""The masked operand load the GEMM kernels share (fused MoE, fp8 / skinny linear)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_k_tile(ptrs, ok, k_left, offs_k, K_AXIS: tl.constexpr, EVEN_K: tl.constexpr):
    """One K step's operand tile at `ptrs`, zero where `ok` (its rows or columns along the other
    axis) is False and, unless EVEN_K, where offs_k >= k_left (K - k0) along axis K_AXIS."""
    if EVEN_K:
        if K_AXIS == 0:
            tile = tl.load(ptrs, mask=ok[None, :], other=0.0)
        else:
            tile = tl.load(ptrs, mask=ok[:, None], other=0.0)
    else:
        k_ok = offs_k < k_left
        if K_AXIS == 0:
            tile = tl.load(ptrs, mask=k_ok[:, None] & ok[None, :], other=0.0)
        else:
            tile = tl.load(ptrs, mask=ok[:, None] & k_ok[None, :], other=0.0)
    return tile
