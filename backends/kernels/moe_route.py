"""The MoE router (ReferenceOps.moe_route, n_group = 1) as two Triton kernels.

    logits = x · Wᵀ (fp32 accumulation of the model-dtype products: exact products, so only the
             summation order differs from the reference's fp32 GEMM of the upcast operands)
    scores = sigmoid(logits);  choice = scores + bias
    ids    = the top_k experts of choice (ties: the lower id);  w = scores[ids]
    w      = w / (Σ w + 1e-20) if norm_topk_prob;  w *= scaling

The reference spends ten launches on this (two casts, the GEMM, sigmoid, add, topk, gather,
sum, divide, multiply); at decode each is a few microseconds of a step whose bytes take
about one. Here: one launch for the logits, tiled over experts so that the router's weight
is read by many programs (one program per token would stream it through one SM), and one
for the selection, one program per token block, the k picks done in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .interpreter import patch_interpreter

patch_interpreter()


@triton.jit
def _route_logits_kernel(X, W, L, N, E, D, stride_x, stride_w, stride_l,
                         BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                         PRECISION: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    r_ok = rows < N
    c_ok = cols < E
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_E], dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < D
        x = tl.load(X + rows.to(tl.int64)[:, None] * stride_x + kk[None, :], mask=r_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w = tl.load(W + cols.to(tl.int64)[:, None] * stride_w + kk[None, :], mask=c_ok[:, None] & k_ok[None, :],
                    other=0.0)
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=PRECISION)
    tl.store(L + rows.to(tl.int64)[:, None] * stride_l + cols[None, :], acc, mask=r_ok[:, None] & c_ok[None, :])


@triton.jit
def _route_select_kernel(L, BIAS, WOUT, IDS, N, E, stride_l, scaling,
                         TOP_K: tl.constexpr, NORM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
                         BLOCK_TOPK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    r_ok = rows < N
    cols = tl.arange(0, BLOCK_E)
    c_ok = cols < E
    logit = tl.load(L + rows.to(tl.int64)[:, None] * stride_l + cols[None, :], mask=r_ok[:, None] & c_ok[None, :],
                    other=0.0)
    scores = 1.0 / (1.0 + tl.exp(-logit))  # torch's sigmoid
    bias = tl.load(BIAS + cols, mask=c_ok, other=0.0).to(tl.float32)
    choice = tl.where(c_ok[None, :], scores + bias[None, :], float("-inf"))
    slots = tl.arange(0, BLOCK_TOPK)
    picked_ids = tl.zeros([BLOCK_N, BLOCK_TOPK], dtype=tl.int32)
    picked_w = tl.zeros([BLOCK_N, BLOCK_TOPK], dtype=tl.float32)
    for j in range(TOP_K):
        best = tl.max(choice, 1)
        # the lowest id among the maxima (torch.topk's order on ties is unspecified; this is stable)
        idx = tl.min(tl.where(choice == best[:, None], cols[None, :], BLOCK_E), 1)
        hit = cols[None, :] == idx[:, None]
        w = tl.sum(tl.where(hit, scores, 0.0), 1)
        picked_ids = tl.where(slots[None, :] == j, idx[:, None], picked_ids)
        picked_w = tl.where(slots[None, :] == j, w[:, None], picked_w)
        choice = tl.where(hit, float("-inf"), choice)
    if NORM:
        picked_w = picked_w / (tl.sum(picked_w, 1)[:, None] + 1e-20)
    picked_w = picked_w * scaling
    out_ok = r_ok[:, None] & (slots[None, :] < TOP_K)
    off = rows.to(tl.int64)[:, None] * TOP_K + slots[None, :]
    tl.store(WOUT + off, picked_w, mask=out_ok)
    tl.store(IDS + off, picked_ids.to(tl.int64), mask=out_ok)


def supported(x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int) -> bool:
    e = gate_w.shape[0] if gate_w.dim() == 2 else 0
    return (x.dim() == 2 and gate_w.dim() == 2 and gate_w.shape[1] == x.shape[1] and n_group <= 1
            and 1 <= top_k <= e <= 1024 and bias.shape == (e,)
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and gate_w.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and (x.dtype == torch.float32) == (gate_w.dtype == torch.float32)
            and gate_w.device == x.device and bias.device == x.device)


def moe_route(x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor, top_k: int, norm_topk_prob: bool,
              scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (weights [N, top_k] fp32, ids [N, top_k] int64), as ReferenceOps.moe_route (n_group 1)."""
    n, d = x.shape
    e = gate_w.shape[0]
    weights = torch.empty(n, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(n, top_k, dtype=torch.long, device=x.device)
    if n == 0:
        return weights, ids
    if x.stride(-1) != 1:
        x = x.contiguous()
    w = gate_w if gate_w.stride(-1) == 1 else gate_w.contiguous()
    logits = torch.empty(n, e, dtype=torch.float32, device=x.device)
    bn = 16 if n <= 16 else 64
    be = 16 if n <= 16 else 64
    # fp32 operands: exact fp32 products (ieee); 16-bit ones are exact in any mode
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    _route_logits_kernel[(triton.cdiv(n, bn), triton.cdiv(e, be))](
        x, w, logits, n, e, d, x.stride(0), w.stride(0), logits.stride(0),
        BLOCK_N=bn, BLOCK_E=be, BLOCK_K=128 if x.dtype != torch.float32 else 64, PRECISION=precision,
        num_warps=4)
    block_e = triton.next_power_of_2(e)
    sn = max(1, min(16, 4096 // block_e))
    _route_select_kernel[(triton.cdiv(n, sn),)](
        logits, bias, weights, ids, n, e, logits.stride(0), float(scaling),
        TOP_K=top_k, NORM=bool(norm_topk_prob), BLOCK_N=sn, BLOCK_E=block_e,
        BLOCK_TOPK=triton.next_power_of_2(top_k), num_warps=4)
    return weights, ids
