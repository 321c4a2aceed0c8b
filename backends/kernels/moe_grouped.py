"""Prefill-size routed MoE for 16-bit weights on torch's grouped GEMM (torch._grouped_mm: CUTLASS on
SM90), with our own glue kernels; backends/kernels/fused_moe.py hands it the calls it takes.

At prefill sizes every expert gets hundreds of rows, so the product is a set of ordinary GEMMs. The
fused kernel gathers its rows per tile and pads every expert to whole BLOCK_M blocks (~12% of the
rows at 16K tokens, 289 experts, BLOCK_M 128); here the pairs are sorted by expert once, x is
gathered into that order once, and each projection is one grouped GEMM over exact group sizes:

    sort the (token, slot) pairs by expert (dropped pairs last)   -> perm, offs (no host sync)
    xs = x[perm // k]                                             [P, D]
    g, u = xs · W_gate[e]ᵀ, xs · W_up[e]ᵀ per group               [P, I] each, rounded to bf16
    h = swiglu(g, u) with the clamp (_swiglu_kernel)              [P, I]
    ys = h · W_down[e]ᵀ per group                                 [P, D], rounded
    y[perm] = ys * routing weight, rounded (_scatter_kernel)      [N·k, D] in pair order

The roundings are the fused kernel's (gate, up, silu(gate), the product, the down output, the
weighted row), so its pair rows and sum (or MoEPartials) follow; the products differ only in
their fp32 summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .interpreter import patch_interpreter

patch_interpreter()


@triton.jit
def _swiglu_kernel(G, U, H, OFFS, E, I, limit, stride_g, stride_u, stride_h,
                   HAS_LIMIT: tl.constexpr, BLOCK_I: tl.constexpr):
    row = tl.program_id(0)
    if row >= tl.load(OFFS + E - 1):  # dropped pairs sort last: their rows are never read
        return
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    ok = cols < I
    r = row.to(tl.int64)
    g = tl.load(G + r * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(U + r * stride_u + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_LIMIT:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    dt = H.dtype.element_ty
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(H + r * stride_h + cols, (s * u).to(dt), mask=ok)


@triton.jit
def _scatter_kernel(YS, PERM, RW, Y, OFFS, E, D, stride_ys, stride_y, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    if row >= tl.load(OFFS + E - 1):
        return
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = cols < D
    pair = tl.load(PERM + row).to(tl.int64)
    w = tl.load(RW + pair).to(tl.float32)
    y = tl.load(YS + row.to(tl.int64) * stride_ys + cols, mask=ok, other=0.0).to(tl.float32) * w
    tl.store(Y + pair * stride_y + cols, y.to(Y.dtype.element_ty), mask=ok)


def available() -> bool:
    return hasattr(torch, "_grouped_mm")


def supported(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    """bf16 activations and weights, dims the grouped GEMM takes (multiples of 16 elements), weights
    row-major per expert (their transposes are the column-major operands it wants)."""
    if not available() or x.dtype != torch.bfloat16:
        return False
    ws = (w_gate, w_up, w_down)
    if any(w.dtype != torch.bfloat16 or not w.is_contiguous() for w in ws):
        return False
    _, i, d = w_gate.shape
    return i % 16 == 0 and d % 16 == 0


def moe_grouped(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w_gate: torch.Tensor,
                w_up: torch.Tensor, w_down: torch.Tensor, limit: float | None) -> torch.Tensor:
    """The weighted pair rows y [N·k, D] (pair order; rows of dropped pairs undefined), as the fused
    MoE's down kernel writes them; the caller sums them or hands them on as MoEPartials."""
    n, d = x.shape
    top_k = ids.shape[1]
    e, i, _ = w_gate.shape
    m = n * top_k
    flat = ids.reshape(-1)
    key = torch.where((flat >= 0) & (flat < e), flat, e).to(torch.int32)  # dropped pairs sort last
    sorted_e, perm = torch.sort(key, stable=True)
    offs = torch.searchsorted(sorted_e, torch.arange(e, dtype=torch.int32, device=x.device),
                              right=True).to(torch.int32)               # group ends; offs[-1] = routed pairs
    xs = x.index_select(0, perm // top_k)
    g = torch._grouped_mm(xs, w_gate.transpose(1, 2), offs=offs)
    u = torch._grouped_mm(xs, w_up.transpose(1, 2), offs=offs)
    del xs
    h = torch.empty(m, i, dtype=x.dtype, device=x.device)
    block_i = min(1024, triton.next_power_of_2(i))
    _swiglu_kernel[(m, triton.cdiv(i, block_i))](g, u, h, offs, e, i, float(limit) if limit is not None else 0.0,
                                                 g.stride(0), u.stride(0), h.stride(0),
                                                 HAS_LIMIT=limit is not None, BLOCK_I=block_i, num_warps=4)
    del g, u
    ys = torch._grouped_mm(h, w_down.transpose(1, 2), offs=offs)
    del h
    y = torch.empty(m, d, dtype=x.dtype, device=x.device)
    rw = weights.reshape(-1).contiguous()
    block_d = min(1024, triton.next_power_of_2(d))
    _scatter_kernel[(m, triton.cdiv(d, block_d))](ys, perm, rw, y, offs, e, d, ys.stride(0), y.stride(0),
                                                  BLOCK_D=block_d, num_warps=4)
    return y
