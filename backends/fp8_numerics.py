"""Block-scaled fp8 numerics every kernel set shares: weight dequantisation (DeepSeek-V3's 128 x 128
blocks), the dynamic per-token-group activation quantisation of w8a8 products, and the one rule
for when a product quantises its activations. Plain torch; the reference's formulas, which the
fp8 kernels reproduce."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dequantize_block_fp8(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                         dtype: torch.dtype) -> torch.Tensor:
    """W[i, j] = fp8[i, j] * scale_inv[i // bo, j // bi] (DeepSeek-V3 block convention).

    Works on [out, in] or stacked [E, out, in] weights.
    """
    bo, bi = block
    out_dim, in_dim = w.shape[-2], w.shape[-1]
    s = scale_inv.to(torch.float32)
    s = s.repeat_interleave(bo, dim=-2)[..., :out_dim, :].repeat_interleave(bi, dim=-1)[..., :in_dim]
    return (w.to(torch.float32) * s).to(dtype)


def act_quant_e4m3(x: torch.Tensor, group: int) -> torch.Tensor:
    """Dynamic fp8 activation quantisation (w8a8), returned dequantised in fp32: per row and
    `group`-wide block of the last dim, s = max|x| / 448 and x ≈ e4m3(x / s) · s (DeepSeek-V3's
    per-token-group quantisation; all-zero groups stay zero). The kernels' quant_act_e4m3."""
    k = x.shape[-1]
    pad = (-k) % group
    xf = F.pad(x.float(), (0, pad)).unflatten(-1, (-1, group))
    s = xf.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 448.0
    q = (xf / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return (q.float() * s).flatten(-2)[..., :k]


def w8a8_product(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """x · dequant(weight)ᵀ in fp32 with x quantised as the w8a8 kernels do (act_quant_e4m3 per
    K scale block): the reference product of every w8a8 GEMM (dense linear and MoE experts)."""
    return F.linear(act_quant_e4m3(x, int(block[1])), dequantize_block_fp8(weight, scale_inv, block, torch.float32))


def w8a8_possible(act_dtype: torch.dtype, weight_dtype: torch.dtype, block: tuple[int, int]) -> bool:
    """Whether a product can quantise its activations (w8a8): e4m3 weights, 16-bit activations and a
    K scale block of 32..256 (one activation group per K tile; an fp8 MMA takes K >= 32: a 16-wide
    block failed to compile on the H200). The one rule for this and the kernels' act_fp8_supported."""
    return (weight_dtype == torch.float8_e4m3fn and act_dtype in (torch.bfloat16, torch.float16)
            and 32 <= int(block[1]) <= 256)


def w8a8_applies(mode: str, x: torch.Tensor, weight: torch.Tensor, block: tuple[int, int],
                 max_rows: int | None = None) -> bool:
    """Whether fp8_activations=mode quantises x [..., in] for this fp8 weight: "dynamic",
    w8a8_possible, and at most max_rows rows (None: any)."""
    rows = x.numel() // max(1, x.shape[-1])
    return (mode == "dynamic" and w8a8_possible(x.dtype, weight.dtype, block)
            and (max_rows is None or rows <= max_rows))
