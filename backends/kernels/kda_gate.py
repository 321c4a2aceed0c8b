"""KDA's forget gate (ReferenceOps.kda_gate) in one Triton launch.

    g = lb · sigmoid(exp(A_log[h]) · (f + dt_bias))          with a lower bound lb
    g = -exp(A_log[h]) · softplus(f + dt_bias)               without (softplus = f above 20)

f is the forget-gate projection [N, H·d] in the model dtype; g comes out fp32 [N, H, d]. The
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
