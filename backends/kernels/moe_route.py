"""The MoE router (ReferenceOps.moe_route) as two Triton kernels.

    logits = x · Wᵀ (fp32 accumulation of the model-dtype products: exact products, so only the
             summation order differs from the reference's fp32 GEMM of the upcast operands)
    scores = sigmoid(logits);  choice = scores + bias
    groups (n_group > 1): the experts in n_group equal runs, each scored by the sum of its two
             best choices; only the topk_group best groups (ties: the lower group) stay eligible
    ids    = the top_k eligible experts of choice (ties: the lower id);  w = scores[ids]
    w      = w / (Σ w + 1e-20) if norm_topk_prob;  w *= scaling

The reference spends ten launches on this (two casts, the GEMM, sigmoid, add, topk, gather,
sum, divide, multiply; eleven more for the groups); at decode each is a few microseconds of a step whose bytes take
about one. Here: one launch for the logits, tiled over experts and, at decode sizes, split
over K so that the router's weight is read by many programs (one program per token would
stream it through one SM), and one for the selection (summing the splits in a fixed order),
one program per token, the k picks done in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .pdl import pdl_enter
from .interpreter import patch_interpreter

patch_interpreter()

_MAX_SPLIT = 8  # K splits of the logits at most (the selection sums their partials, unrolled)
_NUM_SMS_GUESS = 132


@triton.jit
def _route_logits_kernel(X, W, L, N, E, D, k_per, stride_x, stride_w, stride_l,
                         BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                         PRECISION: tl.constexpr, PDL: tl.constexpr = False):
    """Partial logits over K split s = program_id(2): L[s, rows, cols]."""
    pdl_enter(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    split = tl.program_id(2)
    r_ok = rows < N
    c_ok = cols < E
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_E], dtype=tl.float32)
    k_lo = split * k_per
    k_hi = tl.minimum(k_lo + k_per, D)
    L += split.to(tl.int64) * N * stride_l
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < k_hi
        x = tl.load(X + rows.to(tl.int64)[:, None] * stride_x + kk[None, :], mask=r_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w = tl.load(W + cols.to(tl.int64)[:, None] * stride_w + kk[None, :], mask=c_ok[:, None] & k_ok[None, :],
                    other=0.0)
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=PRECISION)
    tl.store(L + rows.to(tl.int64)[:, None] * stride_l + cols[None, :], acc, mask=r_ok[:, None] & c_ok[None, :])


@triton.jit
def _route_select_kernel(L, BIAS, WOUT, IDS, N, E, n_split, stride_l, scaling, extra_id, group_size,
                         TOP_K: tl.constexpr, NORM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
                         BLOCK_TOPK: tl.constexpr, MAX_SPLIT: tl.constexpr, EXTRA: tl.constexpr,
                         N_GROUP: tl.constexpr = 1, TOPK_GROUP: tl.constexpr = 1, BLOCK_G: tl.constexpr = 1,
                         PDL: tl.constexpr = False):
    pdl_enter(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    r_ok = rows < N
    cols = tl.arange(0, BLOCK_E)
    c_ok = cols < E
    # the K splits' partials, in split order (deterministic); unrolled so the loads overlap
    logit = tl.zeros([BLOCK_N, BLOCK_E], dtype=tl.float32)
    for s in tl.static_range(MAX_SPLIT):
        logit += tl.load(L + (s * N + rows).to(tl.int64)[:, None] * stride_l + cols[None, :],
                         mask=(r_ok[:, None] & c_ok[None, :]) & (s < n_split), other=0.0)
    scores = 1.0 / (1.0 + tl.exp(-logit))  # torch's sigmoid
    bias = tl.load(BIAS + cols, mask=c_ok, other=0.0).to(tl.float32)
    choice = tl.where(c_ok[None, :], scores + bias[None, :], float("-inf"))
    if N_GROUP > 1:
        group = cols // group_size
        gslots = tl.arange(0, BLOCK_G)
        gscore = tl.full([BLOCK_N, BLOCK_G], float("-inf"), dtype=tl.float32)  # slots past N_GROUP stay -inf
        for g in tl.static_range(N_GROUP):  # a group's two best choices (a repeated best counts twice)
            in_g = (group == g)[None, :]
            top1 = tl.max(tl.where(in_g, choice, float("-inf")), 1)
            at1 = tl.min(tl.where(in_g & (choice == top1[:, None]), cols[None, :], BLOCK_E), 1)
            top2 = tl.max(tl.where(in_g & (cols[None, :] != at1[:, None]), choice, float("-inf")), 1)
            gscore = tl.where(gslots[None, :] == g, (top1 + top2)[:, None], gscore)
        keep = tl.zeros([BLOCK_N, BLOCK_G], dtype=tl.int32)
        for _ in tl.static_range(TOPK_GROUP):
            # names of their own: a name bound here and rebound in the top-k loop below would be
            # carried into that loop with this shape, which the compiler refuses
            g_best = tl.max(gscore, 1)
            gi = tl.min(tl.where(gscore == g_best[:, None], gslots[None, :], BLOCK_G), 1)
            g_hit = gslots[None, :] == gi[:, None]
            keep = tl.where(g_hit, 1, keep)
            gscore = tl.where(g_hit, float("-inf"), gscore)
        for g in tl.static_range(N_GROUP):
            kept = tl.sum(tl.where(gslots[None, :] == g, keep, 0), 1)
            choice = tl.where((group == g)[None, :] & (kept[:, None] == 0), float("-inf"), choice)
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
    # EXTRA: column TOP_K holds extra_id with weight 1 (a shared expert seated as expert E)
    OUT_K: tl.constexpr = TOP_K + EXTRA
    if EXTRA:
        picked_ids = tl.where(slots[None, :] == TOP_K, extra_id, picked_ids)
        picked_w = tl.where(slots[None, :] == TOP_K, 1.0, picked_w)
    out_ok = r_ok[:, None] & (slots[None, :] < OUT_K)
    off = rows.to(tl.int64)[:, None] * OUT_K + slots[None, :]
    tl.store(WOUT + off, picked_w, mask=out_ok)
    tl.store(IDS + off, picked_ids.to(tl.int64), mask=out_ok)


_MAX_GROUPS = 32  # groups are unrolled in the selection


def supported(x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int,
              topk_group: int = 1) -> bool:
    e = gate_w.shape[0] if gate_w.dim() == 2 else 0
    groups_ok = n_group <= 1 or (n_group <= _MAX_GROUPS and e % n_group == 0 and e // n_group >= 2
                                 and 1 <= topk_group <= n_group)
    return (x.dim() == 2 and gate_w.dim() == 2 and gate_w.shape[1] == x.shape[1] and groups_ok
            and 1 <= top_k <= e <= 1024 and bias.shape == (e,)
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and gate_w.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and (x.dtype == torch.float32) == (gate_w.dtype == torch.float32)
            and gate_w.device == x.device and bias.device == x.device)


def moe_route(x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor, top_k: int, norm_topk_prob: bool,
              scaling: float, *, append_expert: int | None = None, n_group: int = 1, topk_group: int = 1,
              splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (weights [N, top_k] fp32, ids [N, top_k] int64), as ReferenceOps.moe_route; with
    `append_expert`, [N, top_k + 1] whose last column is that id with weight 1. `splits` forces
    the logits' K split count (at most MAX_SPLIT; bench.decode_ops sweeps it)."""
    n, d = x.shape
    e = gate_w.shape[0]
    extra = append_expert is not None
    weights = torch.empty(n, top_k + extra, dtype=torch.float32, device=x.device)
    ids = torch.empty(n, top_k + extra, dtype=torch.long, device=x.device)
    if n == 0:
        return weights, ids
    if x.stride(-1) != 1:
        x = x.contiguous()
    w = gate_w if gate_w.stride(-1) == 1 else gate_w.contiguous()
    bn = 16 if n <= 16 else 64
    be = 16 if n <= 64 else 64
    bk = 128 if x.dtype != torch.float32 else 64
    # K splits while the (token, expert) tiles alone fill few SMs (decode: 18 tiles at N = 1):
    # each program's K loop is a chain of dependent load + dot steps (~0.6 µs each on the
    # H200), 32 of them over D 4096 without a split, 19 µs a call
    tiles = triton.cdiv(n, bn) * triton.cdiv(e, be)
    split = max(1, min(_MAX_SPLIT, 2 * _NUM_SMS_GUESS // tiles, triton.cdiv(d, bk)))
    if splits is not None:
        split = max(1, min(_MAX_SPLIT, int(splits), triton.cdiv(d, bk)))
    k_per = triton.cdiv(triton.cdiv(d, split), bk) * bk
    split = triton.cdiv(d, k_per)
    logits = torch.empty(split, n, e, dtype=torch.float32, device=x.device)
    # fp32 operands: exact fp32 products (ieee); 16-bit ones are exact in any mode
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    _route_logits_kernel[(triton.cdiv(n, bn), triton.cdiv(e, be), split)](
        x, w, logits, n, e, d, k_per, x.stride(0), w.stride(0), logits.stride(1),
        BLOCK_N=bn, BLOCK_E=be, BLOCK_K=bk, PRECISION=precision, **pdl.launch(x.device), num_warps=4)
    # one token per program on one warp: the k picks are k rounds of row reductions, and
    # within a warp each is a few shuffles (across warps, a shared-memory round trip each)
    _route_select_kernel[(n,)](
        logits, bias, weights, ids, n, e, split, logits.stride(1), float(scaling),
        int(append_expert) if extra else 0, e // max(n_group, 1),
        TOP_K=top_k, NORM=bool(norm_topk_prob), BLOCK_N=1, BLOCK_E=triton.next_power_of_2(e),
        BLOCK_TOPK=triton.next_power_of_2(top_k + extra), MAX_SPLIT=_MAX_SPLIT, EXTRA=extra,
        N_GROUP=max(n_group, 1), TOPK_GROUP=topk_group if n_group > 1 else 1,
        BLOCK_G=triton.next_power_of_2(max(n_group, 1)),
        **pdl.launch(x.device), num_warps=1)
    return weights, ids
