"""Weighted RMSNorm (docs/MODEL.md §2.1) as a Triton kernel (and the gated RMSNorm and l2norm of KDA).

    y = w.to(dt) * cast_dt(x32 * rsqrt(mean(x32²) + eps))          dt = x.dtype

in exactly ReferenceOps.rms_norm's order: normalise in fp32, round to the input dtype, then
multiply by the weight rounded to the input dtype (the product of two bf16 values is exact
in fp32, so one rounding of it equals torch's bf16 multiply). One program per row; rows up
to MAX_FUSED_D elements are held in registers (one HBM read of x), longer rows take two
passes over D in BLOCK_D chunks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .pdl import pdl_enter
from .interpreter import patch_interpreter

patch_interpreter()

MAX_FUSED_D = 16384


@triton.jit
def _normed_row(x, W, offs, ok, D, eps, xdt):
    """One row x (fp32, zeros past D) normalised and weighted in ReferenceOps.rms_norm's order."""
    r = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
    y = (x * r).to(xdt).to(tl.float32)
    w = tl.load(W + offs, mask=ok, other=0.0).to(xdt).to(tl.float32)
    return w * y


@triton.jit
def _rms_norm_kernel(X, W, Y, stride_x, stride_y, D, eps,
                     BLOCK_D: tl.constexpr, ONE_PASS: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    xdt = X.dtype.element_ty
    offs = tl.arange(0, BLOCK_D)
    if ONE_PASS:
        ok = offs < D
        x = tl.load(X + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(Y + row * stride_y + offs, _normed_row(x, W, offs, ok, D, eps, xdt).to(Y.dtype.element_ty), mask=ok)
    else:
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            ok = d0 + offs < D
            x = tl.load(X + row * stride_x + d0 + offs, mask=ok, other=0.0).to(tl.float32)
            acc += x * x
        r = tl.rsqrt(tl.sum(acc, 0) / D + eps)
        for d0 in range(0, D, BLOCK_D):
            ok = d0 + offs < D
            x = tl.load(X + row * stride_x + d0 + offs, mask=ok, other=0.0).to(tl.float32)
            y = (x * r).to(xdt).to(tl.float32)
            w = tl.load(W + d0 + offs, mask=ok, other=0.0).to(xdt).to(tl.float32)
            tl.store(Y + row * stride_y + d0 + offs, (w * y).to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _add_rms_norm_kernel(X, R, W, S, Y, stride_x, stride_r, D, eps, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    """S = X + R rounded to X's dtype (torch's add), Y = rms_norm(S): [rows, D] contiguous S, Y."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    xdt = X.dtype.element_ty
    offs = tl.arange(0, BLOCK_D)
    ok = offs < D
    x = tl.load(X + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    x = (x + tl.load(R + row * stride_r + offs, mask=ok, other=0.0).to(tl.float32)).to(xdt)
    tl.store(S + row * D + offs, x, mask=ok)
    tl.store(Y + row * D + offs, _normed_row(x.to(tl.float32), W, offs, ok, D, eps, xdt).to(xdt), mask=ok)


@triton.jit
def _rms_norm_pair_kernel(A, WA, B, WB, Y, stride_a, stride_b, D, eps, BLOCK_D: tl.constexpr,
                          PDL: tl.constexpr = False):
    """Y[row] = [rms_norm(A[row], WA); rms_norm(B[row], WB)] ([rows, 2D] contiguous): program
    (row, 0) writes the first half, (row, 1) the second."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    xdt = A.dtype.element_ty
    offs = tl.arange(0, BLOCK_D)
    ok = offs < D
    if tl.program_id(1) == 0:
        x = tl.load(A + row * stride_a + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(Y + row * 2 * D + offs, _normed_row(x, WA, offs, ok, D, eps, xdt).to(xdt), mask=ok)
    else:
        x = tl.load(B + row * stride_b + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(Y + row * 2 * D + D + offs, _normed_row(x, WB, offs, ok, D, eps, xdt).to(xdt), mask=ok)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """ReferenceOps.add_rms_norm for [N, D] rows of up to MAX_FUSED_D: (x + residual, its norm)."""
    n, d = x.shape
    s = torch.empty((n, d), dtype=x.dtype, device=x.device)
    y = torch.empty_like(s)
    if n:
        x2, r2 = _rows(x, d), _rows(residual, d)
        bd = triton.next_power_of_2(d)
        _add_rms_norm_kernel[(n,)](x2, r2, weight.contiguous(), s, y, x2.stride(0), r2.stride(0), d, float(eps),
                                   BLOCK_D=bd, **pdl.launch(x.device), num_warps=4 if bd <= 2048 else 8)
    return s, y


@triton.jit
def _stream_mean_rms_norm_kernel(X, W, Y, stride_xn, stride_xm, stride_y, D, eps, M: tl.constexpr,
                                 BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    """Y[row] = rms_norm(mean of X[row]'s M streams): the mean summed in fp32 in stream order and
    rounded to X's dtype (torch's mean of a 16-bit tensor), then normalised as _rms_norm_kernel."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    xdt = X.dtype.element_ty
    offs = tl.arange(0, BLOCK_D)
    ok = offs < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for m in tl.static_range(M):
        acc += tl.load(X + row * stride_xn + m * stride_xm + offs, mask=ok, other=0.0).to(tl.float32)
    x = (acc * (1.0 / M)).to(xdt).to(tl.float32)  # times the reciprocal, as torch's mean
    tl.store(Y + row * stride_y + offs, _normed_row(x, W, offs, ok, D, eps, xdt).to(Y.dtype.element_ty), mask=ok)


def stream_mean_rms_norm(streams: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """ReferenceOps.stream_mean_rms_norm for [N, M, D] streams of rows up to MAX_FUSED_D: one launch."""
    n, m, d = streams.shape
    y = torch.empty(n, d, dtype=streams.dtype, device=streams.device)
    if n:
        x = streams if streams.stride(-1) == 1 else streams.contiguous()
        bd = triton.next_power_of_2(d)
        _stream_mean_rms_norm_kernel[(n,)](x, weight.contiguous(), y, x.stride(0), x.stride(1), y.stride(0), d,
                                           float(eps), M=m, BLOCK_D=bd, **pdl.launch(x.device),
                                           num_warps=4 if bd <= 2048 else 8)
    return y


def rms_norm_pair(a: torch.Tensor, wa: torch.Tensor, b: torch.Tensor, wb: torch.Tensor, eps: float) -> torch.Tensor:
    """ReferenceOps.rms_norm_pair for [N, D] rows of up to MAX_FUSED_D: [N, 2D] in one launch."""
    n, d = a.shape
    y = torch.empty(n, 2 * d, dtype=a.dtype, device=a.device)
    if n:
        a2, b2 = _rows(a, d), _rows(b, d)
        bd = triton.next_power_of_2(d)
        _rms_norm_pair_kernel[(n, 2)](a2, wa.contiguous(), b2, wb.contiguous(), y, a2.stride(0), b2.stride(0), d,
                                      float(eps), BLOCK_D=bd, **pdl.launch(a.device), num_warps=4 if bd <= 2048 else 8)
    return y


def _rows(t: torch.Tensor, d: int) -> torch.Tensor:
    """t as [rows, d] with a unit column stride (a copy only when the rows are not)."""
    t2 = t.reshape(-1, d)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _output(x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    assert out.shape == x.shape and out.dtype == x.dtype and out.is_contiguous()
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: torch.Tensor | None = None,
             block_d: int | None = None) -> torch.Tensor:
    """ReferenceOps.rms_norm for x [..., D] (any leading shape), weight [D]; returns x.dtype.

    `out` (same shape as x, x.dtype) is written in place when given; `block_d` (a power of
    two) forces the two-pass chunked path (tests)."""
    d = x.shape[-1]
    assert weight.shape == (d,), (weight.shape, d)
    x2, out = _rows(x, d), _output(x, out)
    n = x2.shape[0]
    if n == 0:
        return out
    y2 = out.view(-1, d)
    w = weight if weight.is_contiguous() else weight.contiguous()
    if block_d is None and d <= MAX_FUSED_D:
        bd, one = triton.next_power_of_2(d), True
    else:
        bd, one = (block_d or 4096), False
    num_warps = 4 if bd <= 2048 else (8 if bd <= 8192 else 16)
    _rms_norm_kernel[(n,)](x2, w, y2, x2.stride(0), y2.stride(0), d, float(eps),
                           BLOCK_D=bd, ONE_PASS=one, **pdl.launch(x2.device), num_warps=num_warps)
    return out


# ---- gated RMSNorm (the KDA output norm) ---------------------------------------------------------
# ReferenceOps.gated_rms_norm, all fp32 then one rounding:
#     y = cast_dt(x32 * rsqrt(mean(x32²) + eps) * w32 * sigmoid(g32))
# Rows are short (the KDA head dim, 128), so a program takes BLOCK_R rows at once: one launch
# instead of the reference's eight elementwise kernels, and no program per 128-element row.
@triton.jit
def _gated_rms_norm_kernel(X, G, W, Y, R, stride_x, stride_g, stride_y, D, eps,
                           BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    r_ok = rows < R
    d_ok = offs < D
    ok = r_ok[:, None] & d_ok[None, :]
    x = tl.load(X + rows[:, None] * stride_x + offs[None, :], mask=ok, other=0.0).to(tl.float32)
    g = tl.load(G + rows[:, None] * stride_g + offs[None, :], mask=ok, other=0.0).to(tl.float32)
    w = tl.load(W + offs, mask=d_ok, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, 1) / D + eps)
    y = x * r[:, None] * w[None, :]
    y = y * (1.0 / (1.0 + tl.exp(-g)))  # torch's sigmoid: 1 / (1 + exp(-g))
    tl.store(Y + rows[:, None] * stride_y + offs[None, :], y.to(Y.dtype.element_ty), mask=ok)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, *,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """ReferenceOps.gated_rms_norm for x, gate [..., D] (same shape), weight [D]; x.dtype out.
    Rows of up to MAX_GATED_D elements (the KDA head dim); longer rows are the caller's to route
    to the reference (`gated_supported`)."""
    d = x.shape[-1]
    assert gated_supported(x, gate, weight), (x.shape, gate.shape, weight.shape)
    x2, g2, out = _rows(x, d), _rows(gate, d), _output(x, out)
    n = x2.shape[0]
    if n == 0:
        return out
    y2 = out.view(-1, d)
    w = weight if weight.is_contiguous() else weight.contiguous()
    bd = triton.next_power_of_2(d)
    br = max(1, min(16, 2048 // bd))
    _gated_rms_norm_kernel[(triton.cdiv(n, br),)](x2, g2, w, y2, n, x2.stride(0), g2.stride(0), y2.stride(0), d,
                                                  float(eps), BLOCK_R=br, BLOCK_D=bd, **pdl.launch(x2.device),
                                                  num_warps=4)
    return out


MAX_GATED_D = 1024


def gated_supported(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor) -> bool:
    d = x.shape[-1] if x.dim() else 0
    return (x.dim() >= 1 and 1 <= d <= MAX_GATED_D and gate.shape == x.shape and weight.shape == (d,)
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and gate.device == x.device and weight.device == x.device)


@triton.jit(do_not_specialize=["n", "heads"])
def _l2norm_kernel(X, Y, n, stride_x, stride_y, D, eps, heads, stride_h, BLOCK_R: tl.constexpr,
                   BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    """Row r of [n, D] is head r % heads of outer row r // heads of X (strides stride_x, stride_h):
    a [N, H, D] view with any row stride (q/k as column slices of the conv output) is read in
    place; a plain [n, D] input has heads 1."""
    pdl_enter(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = rows < n
    offs = tl.arange(0, BLOCK_D)
    ok = r_ok[:, None] & (offs < D)[None, :]
    rows = rows.to(tl.int64)
    xrow = (rows // heads) * stride_x + (rows % heads) * stride_h
    x = tl.load(X + xrow[:, None] + offs[None, :], mask=ok, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 1) + eps)
    tl.store(Y + rows[:, None] * stride_y + offs[None, :], (x * rstd[:, None]).to(Y.dtype.element_ty), mask=ok)


def l2norm(x: torch.Tensor, eps: float = 1e-6, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """y = x / sqrt(Σ x² + eps) over the last dim (fp32 math, x.dtype out): fla's l2norm_fwd
    formula, for KDA's q and k before chunk_kda. fla's own kernel takes NB = cdiv(rows, 65536)
    as a constexpr and an autotune key, so every new multiple of 1024 tokens in a prefill batch
    (at 64 heads) autotuned ~25 variants mid-traffic: 10-s stalls in the H200 serving sweep.
    Here the row count is a plain runtime argument: one compile for every batch."""
    d = x.shape[-1]
    assert 1 <= d <= MAX_GATED_D and x.dtype in (torch.float32, torch.bfloat16, torch.float16), (x.shape, x.dtype)
    out = _output(x, out)
    # [..., H, D] as [rows, H, D] (a view for KDA's q/k, column slices of the conv output whose
    # rows are 3·H·D apart): the kernel reads the heads in place, no strided copy first
    x3 = x.reshape(-1, x.shape[-2], d) if x.dim() >= 3 else x.reshape(-1, 1, d)
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    n = x3.shape[0] * x3.shape[1]
    if n == 0:
        return out
    y2 = out.view(-1, d)
    bd = triton.next_power_of_2(d)
    br = max(1, min(16, 2048 // bd))
    _l2norm_kernel[(triton.cdiv(n, br),)](x3, y2, n, x3.stride(0), y2.stride(0), d, float(eps),
                                          x3.shape[1], x3.stride(1),
                                          BLOCK_R=br, BLOCK_D=bd, **pdl.launch(x3.device), num_warps=4)
    return out
