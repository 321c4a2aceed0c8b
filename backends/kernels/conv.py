"""KDA short causal depthwise conv + SiLU over a flat varlen batch (docs/MODEL.md §4 step 2).

    out[t, c] = silu( Σ_{j<K} W[c, j] · m_{t-K+1+j}[c] )          in fp32, cast to x.dtype

where the inputs before a request's first new token come from its conv state
conv_state[slot, K-1 + p] (p < 0; zeros when the request's prefix_len is 0, whatever the
slot holds) and the last K-1 inputs are written back to the slot in place
(ReferenceOps.causal_conv; state layout [slots, K-1, C]).

Three kernels, all reading only device tensors (req_index, cu_seqlens_t, prefix_lens_t,
slot_ids) with grids of N tokens and B requests, so a decode step can be graph-captured:

  _conv_out_kernel    any batch: one program per BLOCK_T tokens x BLOCK_C channels, K shifted
                      tile loads (the overlap comes from L1/L2, not HBM), history rows from the
                      slot where a shifted row falls before the request's first new token.
  _conv_state_kernel  any batch, launched after _conv_out_kernel (same stream) so every output
                      is computed from the old history: one program per request x BLOCK_C
                      writes the K-1 new history rows. New row i reads old row n+i (> i) when
                      the run n is shorter than K-1, so rows are rewritten in increasing order
                      and none is read after it was overwritten.
  _conv_decode_kernel one token per request: one program per request x BLOCK_C reads the old
                      history once, writes the output and the shifted history (row j-1 <- old
                      row j after row j was read). Half the bytes of the two-kernel path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..meta import BatchMeta
from . import pdl
from .pdl import pdl_enter
from .interpreter import patch_interpreter

patch_interpreter()  # interpreter only: the state and output stores round fp32 to bf16, as compiled code does


@triton.jit
def _conv_out_kernel(X, STATE, W, OUT, REQ, CU, PREFIX, SLOTS,
                     N, C, CP, stride_x, stride_o, stride_op, stride_ss, stride_sr, stride_wc, stride_wk,
                     K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    t_ok = t < N
    c_ok = c < C
    r = tl.load(REQ + t, mask=t_ok, other=0)
    local = t - tl.load(CU + r, mask=t_ok, other=0)          # position within this forward
    has_hist = tl.load(PREFIX + r, mask=t_ok, other=0) > 0
    slot = tl.load(SLOTS + r, mask=t_ok, other=0).to(tl.int64)
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(K):
        p = local + (j - (K - 1))                             # source position, < 0: history
        in_x = p >= 0
        m = t_ok[:, None] & c_ok[None, :]
        vx = tl.load(X + (t + (j - (K - 1)))[:, None] * stride_x + c[None, :],
                     mask=m & in_x[:, None], other=0.0).to(tl.float32)
        vh = tl.load(STATE + slot[:, None] * stride_ss + (p + (K - 1))[:, None] * stride_sr + c[None, :],
                     mask=m & (~in_x & has_hist)[:, None], other=0.0).to(tl.float32)
        w = tl.load(W + c * stride_wc + j * stride_wk, mask=c_ok, other=0.0).to(tl.float32)
        acc += w[None, :] * (vx + vh)
    y = acc * tl.sigmoid(acc)
    o_col = (c // CP) * stride_op + c % CP  # channel c in plane c // CP (one plane: CP = C)
    tl.store(OUT + t[:, None] * stride_o + o_col[None, :], y.to(OUT.dtype.element_ty),
             mask=t_ok[:, None] & c_ok[None, :])


@triton.jit
def _conv_state_kernel(X, STATE, CU, PREFIX, SLOTS, C, stride_x, stride_ss, stride_sr,
                       K: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.program_id(0)
    c = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    s0 = tl.load(CU + r)
    n = tl.load(CU + r + 1) - s0
    has_hist = tl.load(PREFIX + r) > 0
    base = STATE + tl.load(SLOTS + r).to(tl.int64) * stride_ss
    for i in tl.static_range(K - 1):
        p = n - (K - 1) + i                                   # source position of new row i
        vx = tl.load(X + (s0 + p) * stride_x + c, mask=c_ok & (p >= 0), other=0.0)
        vh = tl.load(base + (n + i) * stride_sr + c, mask=c_ok & (p < 0) & has_hist, other=0.0)
        v = tl.where(p >= 0, vx.to(tl.float32), vh.to(tl.float32))
        tl.store(base + i * stride_sr + c, v.to(STATE.dtype.element_ty), mask=c_ok)


@triton.jit
def _conv_decode_kernel(X, STATE, W, OUT, CU, PREFIX, SLOTS, C, CP, stride_x, stride_o, stride_op,
                        stride_ss, stride_sr, stride_wc, stride_wk, K: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    r = tl.program_id(0)
    c = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    t = tl.load(CU + r).to(tl.int64)
    has_hist = tl.load(PREFIX + r) > 0
    base = STATE + tl.load(SLOTS + r).to(tl.int64) * stride_ss
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(K - 1):
        h = tl.load(base + j * stride_sr + c, mask=c_ok & has_hist, other=0.0)
        w = tl.load(W + c * stride_wc + j * stride_wk, mask=c_ok, other=0.0).to(tl.float32)
        acc += w * h.to(tl.float32)
        if j > 0:
            tl.store(base + (j - 1) * stride_sr + c, h.to(STATE.dtype.element_ty), mask=c_ok)
    x = tl.load(X + t * stride_x + c, mask=c_ok, other=0.0)
    w = tl.load(W + c * stride_wc + (K - 1) * stride_wk, mask=c_ok, other=0.0).to(tl.float32)
    acc += w * x.to(tl.float32)
    tl.store(base + (K - 2) * stride_sr + c, x.to(STATE.dtype.element_ty), mask=c_ok)
    o_col = (c // CP) * stride_op + c % CP
    tl.store(OUT + t * stride_o + o_col, (acc * tl.sigmoid(acc)).to(OUT.dtype.element_ty), mask=c_ok)


def device_lens(meta: BatchMeta, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(prefix_lens_t [B], cu_seqlens_t [B+1]) on `device`; built from the host lists only when a
    hand-made BatchMeta lacks them (never the case for the runner's metas, which graphs replay)."""
    pre, cu = meta.prefix_lens_t, meta.cu_seqlens_t
    if pre is None:
        pre = torch.tensor(meta.prefix_lens, dtype=torch.long, device=device)
    if cu is None:
        cu = torch.tensor(meta.cu_seqlens, dtype=torch.long, device=device)
    return pre, cu


def supports(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor) -> bool:
    """Shapes and dtypes the kernels handle (anything else takes the reference)."""
    fl = (torch.float32, torch.bfloat16, torch.float16)
    return (x.dim() == 2 and weight.dim() == 2 and conv_state.dim() == 3 and weight.shape[1] >= 2
            and tuple(conv_state.shape[1:]) == (weight.shape[1] - 1, x.shape[1]) and weight.shape[0] == x.shape[1]
            and x.dtype in fl and conv_state.dtype in fl and weight.dtype in fl and conv_state.stride(2) == 1
            and x.device == conv_state.device == weight.device)


def causal_conv(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, meta: BatchMeta, *,
                out: torch.Tensor | None = None, decode: bool | None = None, block_t: int = 16,
                block_c: int = 256, planes: int = 1, num_warps: int = 4) -> torch.Tensor:
    """ReferenceOps.causal_conv: x [N, C], conv_state [slots, K-1, C] (updated in place), weight [C, K].

    `planes` P > 1: the output is [P, N, C/P], its P column groups each contiguous (the KDA
    layer's q, k and v, which the recurrence reads as dense [N, H, d] tensors). `out` ([N, C],
    or [P, N, C/P], x.dtype, unit column stride) is written when given. `decode` (default: every
    request has one new token) picks the fused one-token kernel; False forces the general
    two-kernel path (tests). `block_t` x `block_c` and `num_warps`: the prefill kernel's tile."""
    n, c = x.shape
    k = weight.shape[1]
    b = meta.num_reqs
    assert planes >= 1 and c % planes == 0
    cp = c // planes
    shape = (n, c) if planes == 1 else (planes, n, cp)
    if x.stride(1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    assert tuple(out.shape) == shape and out.dtype == x.dtype and out.stride(-1) == 1
    if b == 0:
        return out
    stride_o, stride_op = (out.stride(0), 0) if planes == 1 else (out.stride(1), out.stride(0))
    if decode is None:
        decode = n == b and all(s == 1 for s in meta.seq_lens)
    pre, cu = device_lens(meta, x.device)
    cb = triton.cdiv(c, block_c)
    st = (conv_state.stride(0), conv_state.stride(1))
    ws = (weight.stride(0), weight.stride(1))
    if decode:
        _conv_decode_kernel[(b, cb)](x, conv_state, weight, out, cu, pre, meta.slot_ids, c, cp, x.stride(0),
                                     stride_o, stride_op, *st, *ws, K=k, BLOCK_C=block_c, **pdl.launch(x.device),
                                     num_warps=4)
        return out
    if n:
        _conv_out_kernel[(triton.cdiv(n, block_t), cb)](x, conv_state, weight, out, meta.req_index, cu, pre,
                                                        meta.slot_ids, n, c, cp, x.stride(0), stride_o, stride_op,
                                                        *st, *ws, K=k, BLOCK_T=block_t, BLOCK_C=block_c,
                                                        num_warps=num_warps)
    _conv_state_kernel[(b, cb)](x, conv_state, cu, pre, meta.slot_ids, c, x.stride(0), *st,
                                K=k, BLOCK_C=block_c, num_warps=4)
    return out
