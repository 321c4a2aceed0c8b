"""KDA's forget gate (ReferenceOps.kda_gate) in one Triton launch.

    g = lb · sigmoid(exp(A_log[h]) · (f + dt_bias))          with a lower bound lb
    g = -exp(A_log[h]) · softplus(f + dt_bias)               without (softplus = f above 20)

f is the forget-gate projection [N, H·d] in the model dtype; g comes out fp32 [N, H, d].
kda_gate_proj also does the projection (f = f_a · W_fbᵀ, 16-bit W) for a decode step's few rows. The
reference's chain is six elementwise launches per KDA layer (cast, bias add, exp, multiply,
sigmoid, scale), each a few microseconds at decode for a few kilobytes of data.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .pdl import pdl_enter
from .interpreter import patch_interpreter

patch_interpreter()


@triton.jit
def _kda_gate_kernel(F, BIAS, ALOG, G, total, HD, D, stride_f, lower_bound,
                     HAS_LOWER: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    offs = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    ok = offs < total
    row = offs // HD
    col = offs % HD
    f = tl.load(F + row * stride_f + col, mask=ok, other=0.0).to(tl.float32)
    f = f + tl.load(BIAS + col, mask=ok, other=0.0).to(tl.float32)
    rate = tl.exp(tl.load(ALOG + col // D, mask=ok, other=0.0).to(tl.float32))
    if HAS_LOWER:
        g = lower_bound * (1.0 / (1.0 + tl.exp(-(rate * f))))  # torch's sigmoid
    else:
        g = -rate * tl.where(f > 20.0, f, tl.log(1.0 + tl.exp(tl.minimum(f, 20.0))))
    tl.store(G + offs, g, mask=ok)


@triton.jit
def _kda_gate_proj_kernel(X, W, BIAS, ALOG, G, HD, K, D, stride_x, stride_w, lower_bound,
                          HAS_LOWER: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
                          PDL: tl.constexpr = False):
    """f = x[row] · W[cols]ᵀ (fp32 sums, rounded to the model dtype as the linear's output is),
    then the gate: grid (column blocks, rows)."""
    pdl_enter(PDL)
    cols = (tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    row = tl.program_id(1).to(tl.int64)
    c_ok = cols < HD
    offs_k = tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    x = tl.load(X + row * stride_x + offs_k, mask=k_ok, other=0.0).to(tl.float32)
    w = tl.load(W + cols[:, None] * stride_w + offs_k[None, :], mask=c_ok[:, None] & k_ok[None, :],
                other=0.0).to(tl.float32)
    f = tl.sum(w * x[None, :], 1).to(X.dtype.element_ty).to(tl.float32)
    f = f + tl.load(BIAS + cols, mask=c_ok, other=0.0).to(tl.float32)
    rate = tl.exp(tl.load(ALOG + cols // D, mask=c_ok, other=0.0).to(tl.float32))
    if HAS_LOWER:
        g = lower_bound * (1.0 / (1.0 + tl.exp(-(rate * f))))  # torch's sigmoid
    else:
        g = -rate * tl.where(f > 20.0, f, tl.log(1.0 + tl.exp(tl.minimum(f, 20.0))))
    tl.store(G + row * HD + cols, g, mask=c_ok)


# Rows up to which kda_gate_proj runs the projection inside the gate (a decode step's few
# tokens: each row re-reads the weight from L2); its K (the head dim) at most.
PROJ_MAX_ROWS = 8
PROJ_MAX_K = 256


def proj_supported(x: torch.Tensor, w: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor,
                   num_heads: int) -> bool:
    """Whether kda_gate_proj takes x [N, K] · w [H·d, K]ᵀ: 16-bit x and w of one dtype, a few rows."""
    return (x.dim() == 2 and w.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype
            and 1 <= x.shape[0] <= PROJ_MAX_ROWS and x.shape[1] == w.shape[1] <= PROJ_MAX_K
            and x.stride(-1) == 1 and w.stride(-1) == 1 and num_heads >= 1 and w.shape[0] % num_heads == 0
            and dt_bias.shape == (w.shape[0],) and a_log.shape == (num_heads,)
            and dt_bias.is_contiguous() and a_log.is_contiguous()
            and x.device == w.device == dt_bias.device == a_log.device)


def kda_gate_proj(x: torch.Tensor, w: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor,
                  lower_bound: float | None, num_heads: int) -> torch.Tensor:
    """kda_gate(x · wᵀ) in one launch (ReferenceOps.kda_forget_gate with a 16-bit weight)."""
    n, k = x.shape
    hd = w.shape[0]
    d = hd // num_heads
    g = torch.empty(n, num_heads, d, dtype=torch.float32, device=x.device)
    if n == 0:
        return g
    block_c = 64
    _kda_gate_proj_kernel[(triton.cdiv(hd, block_c), n)](
        x, w, dt_bias, a_log, g, hd, k, d, x.stride(0), w.stride(0), float(lower_bound or 0.0),
        HAS_LOWER=lower_bound is not None, BLOCK_C=block_c, BLOCK_K=max(16, triton.next_power_of_2(k)),
        **pdl.launch(x.device), num_warps=4)
    return g


def supported(f: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor, num_heads: int) -> bool:
    return (f.dim() == 2 and num_heads >= 1 and f.shape[1] % num_heads == 0 and dt_bias.shape == (f.shape[1],)
            and a_log.shape == (num_heads,) and f.stride(-1) == 1
            and dt_bias.is_contiguous() and a_log.is_contiguous()
            and f.device == dt_bias.device == a_log.device)


def kda_gate(f: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor, lower_bound: float | None,
             num_heads: int) -> torch.Tensor:
    n, hd = f.shape
    d = hd // num_heads
    g = torch.empty(n, num_heads, d, dtype=torch.float32, device=f.device)
    total = n * hd
    if total == 0:
        return g
    block = 1024
    _kda_gate_kernel[(triton.cdiv(total, block),)](
        f, dt_bias, a_log, g, total, hd, d, f.stride(0), float(lower_bound or 0.0),
        HAS_LOWER=lower_bound is not None, BLOCK=block, **pdl.launch(f.device), num_warps=4)
    return g
