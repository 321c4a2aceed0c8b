"""FP8 MLA latent cache rows: e4m3 values with one fp32 scale per 128 values, in one byte row.

    row (uint8, R + 4 * ceil(R / 128) bytes) = [ e4m3 c[0..R) | fp32 scale[0..G) ]
    c[j] = e4m3[j] * scale[j // 128]          scale = amax(|group|) / 448 (the e4m3 max)

Keeping the scales inside the row means a page of the latent pool is still one contiguous
block: page copies, prefix-cache forks and PD transfers move it without knowing the format.
Only the MLA latent (512 of the ~520 cached bytes per token at bf16's half) is fp8; the
pooled indexer keys and the indexer tail stay in the model dtype (CacheLayout counts it so).
"""

from __future__ import annotations

import torch

GROUP = 128
E4M3_MAX = 448.0


def row_bytes(rank: int) -> int:
    return rank + 4 * -(-rank // GROUP)


def is_fp8_rows(cache: torch.Tensor, rank: int) -> bool:
    return cache.dtype == torch.uint8 and cache.shape[-1] == row_bytes(rank)


def rank_of(cache: torch.Tensor) -> int:
    """R from an fp8 row width (R + 4 ceil(R/128)): exact for every R."""
    w = cache.shape[-1]
    for r in range(w, 0, -1):
        if row_bytes(r) == w:
            return r
    raise ValueError(f"{w} is not an fp8 latent row width")


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., R] (any float dtype) -> uint8 [..., row_bytes(R)]."""
    r = x.shape[-1]
    g = -(-r // GROUP)
    x32 = x.float()
    pad = g * GROUP - r
    grouped = torch.nn.functional.pad(x32, (0, pad)).view(*x.shape[:-1], g, GROUP)
    scale = grouped.abs().amax(-1) / E4M3_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero group: any scale
    q = (grouped / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    vals = q.view(*x.shape[:-1], g * GROUP)[..., :r].view(torch.uint8)
    return torch.cat([vals, scale.contiguous().view(torch.uint8)], dim=-1)


def dequantize_rows(rows: torch.Tensor, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """uint8 [..., row_bytes(R)] -> [..., R] in dtype (fp32 math, one rounding)."""
    g = -(-rank // GROUP)
    vals = rows[..., :rank].contiguous().view(torch.float8_e4m3fn).float()
    scale = rows[..., rank: rank + 4 * g].contiguous().view(torch.float32)
    return (vals * scale.repeat_interleave(GROUP, dim=-1)[..., :rank]).to(dtype)
