"""The routed experts at prefill sizes on grouped GEMMs: ReferenceOps.moe_experts for 16-bit weights.

At thousands of tokens the MoE is compute-bound (16K tokens, top-8 + the seated shared expert:
7.4 TFLOP a layer), and its two GEMMs are where a prefill's time goes. Here they run on
torch._grouped_mm (CUTLASS's grouped GEMM on sm_90: TMA, warp-specialised, persistent) over the
pairs sorted by expert, instead of fused_moe's Triton GEMMs on pointer-gathered rows:

1. the (token, slot) pairs sorted by expert (stable: a token's pairs keep their order inside an
   expert's group); each expert's group end from a search of the sorted ids. Pairs outside
   [0, E) (another rank's experts) sort last, past the last group, and add nothing;
2. x's rows gathered into that order;
3. gate and up: two grouped GEMMs [M, D] x [E, D, I] (the stacked [E, I, D] weights, transposed
   views);
4. the clamped SwiGLU (kernels/swiglu.py);
5. down: one grouped GEMM [M, I] x [E, I, D];
6. the weighted top-k sum (fused_moe's `_sum_kernel`, gathering): out[t] = Σ_j w[t, j] · y[pos(t, j)], each term
   rounded to the model dtype, the sum in fp32 in j order, rounded once.

The roundings are fused_moe's (gate, up, silu(gate), the activation, the down product and the
weighted term each in the model dtype), so the two paths agree to the order of fp32 summation
inside the GEMMs. No host sync: every size is N·top_k, the group ends stay on the device.

The price against fused_moe: x's gathered copy, gate and up written and read back, and the
down product's rows read once more by the sum (~3 GB more traffic at 16K tokens), paid for
where the grouped GEMMs' speed outweighs it (CudaH200Ops.moe_experts: GROUPED_MIN_TOKENS).
The result is always the summed [N, D] (a deferred sum would need the rows in pair order: a
scatter that costs more than it saves).
"""

from __future__ import annotations

import torch
import triton

from . import pdl
from .fused_moe_kernels import _sum_kernel
from .swiglu import swiglu

DTYPES = (torch.bfloat16, torch.float16)


def available() -> bool:
    return hasattr(torch, "_grouped_mm")


def supported(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w_gate: torch.Tensor,
              w_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    """16-bit weights in the activations' dtype, rows 16-byte aligned (CUTLASS's TMA), on a
    device whose torch has the grouped GEMM (sm_90 and later on CUDA)."""
    if not available() or x.dim() != 2 or ids.dim() != 2 or weights.shape != ids.shape or ids.shape[0] != x.shape[0]:
        return False
    if x.dtype not in DTYPES or any(w.dtype != x.dtype for w in (w_gate, w_up, w_down)):
        return False
    if w_gate.dim() != 3 or w_gate.shape != w_up.shape or w_down.dim() != 3:
        return False
    e, i, d = w_gate.shape
    if x.shape[1] != d or tuple(w_down.shape) != (e, d, i) or d % 8 or i % 8:
        return False
    if any(w.stride(-1) != 1 or w.stride(-2) % 8 or w.stride(0) % 8 for w in (w_gate, w_up, w_down)):
        return False
    if x.is_cuda and torch.cuda.get_device_capability(x.device) < (9, 0):
        return False
    return all(t.device == x.device for t in (ids, weights, w_gate, w_up, w_down))


def sort_pairs(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (order, ends): order [M] the flat pair indices sorted by expert (dropped pairs last),
    ends [E] int32 the end of each expert's group in that order."""
    flat = ids.reshape(-1)
    key = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    sorted_key, order = torch.sort(key, stable=True)
    bounds = torch.arange(1, num_experts + 1, device=ids.device, dtype=sorted_key.dtype)
    return order, torch.searchsorted(sorted_key, bounds, out_int32=True)


def grouped_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w_gate: torch.Tensor,
                w_up: torch.Tensor, w_down: torch.Tensor, limit: float | None, *,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """ReferenceOps.moe_experts: x [N, D], ids/weights [N, k], gate/up [E, I, D], down [E, D, I]
    (where `supported`); `out` [N, D] written in place when given."""
    n, d = x.shape
    top_k = ids.shape[1]
    e = w_gate.shape[0]
    if out is None:
        out = torch.empty(n, d, dtype=x.dtype, device=x.device)
    assert out.shape == (n, d) and out.dtype == x.dtype and out.stride(-1) == 1
    if n == 0:
        return out
    m = n * top_k
    order, ends = sort_pairs(ids, e)
    xs = x.index_select(0, order // top_k)
    gate = torch._grouped_mm(xs, w_gate.transpose(1, 2), offs=ends)
    up = torch._grouped_mm(xs, w_up.transpose(1, 2), offs=ends)
    del xs
    h = swiglu(gate, up, limit)
    del gate, up
    y = torch._grouped_mm(h, w_down.transpose(1, 2), offs=ends)
    pos = torch.empty_like(order).scatter_(0, order, torch.arange(m, device=x.device, dtype=order.dtype))
    flat_ids = ids.reshape(-1).contiguous()
    rw = weights.reshape(-1).contiguous()
    block_d = min(1024, triton.next_power_of_2(d))
    _sum_kernel[(n, triton.cdiv(d, block_d))](y, flat_ids, out, d, e, top_k, y.stride(0), out.stride(0), pos, rw,
                                              BLOCK_D=block_d, GATHER=True, **pdl.launch(x.device), num_warps=4)
    return out
