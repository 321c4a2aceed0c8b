"""MXFP4 and NVFP4 weights on disk: the one naming convention per format, and the codec.

Both formats store e2m1 ("FP4") values, two per uint8 along the input dimension, the low
nibble holding the even element (`byte = code[2j] | code[2j+1] << 4`). A code is a sign bit
(bit 3) and a magnitude index (bits 0-2) into {0, 0.5, 1, 1.5, 2, 3, 4, 6}, so codes 0-15
are +0 ... +6, -0 ... -6. A quantised linear `X` with weight `[out, in]` is written under
its usual checkpoint name (per expert for routed experts, docs/MODEL.md §9.1); everything not
quantised stays in the model dtype, and the config's ignore list names those linear layers.

**MXFP4** (OCP microscaling; AMD Quark export, as the MI355X release ships it; vLLM's and
SGLang's `quark` loaders read it):

    X.weight        uint8  [out, in/2]    packed e2m1
    X.weight_scale  uint8  [out, in/32]   E8M0: scale = 2^(byte - 127), 255 = NaN (rejected)
    W[i, j] = e2m1(i, j) * 2^(weight_scale[i, j // 32] - 127)

    config.json "quantization_config": {"quant_method": "quark", "global_quant_config":
      {"weight": {"dtype": "fp4", "qscheme": "per_group", "group_size": 32,
      "scale_format": "e8m0", ...}, "input_tensors": {... "is_dynamic": true}}, "exclude": [...],
      "export": {...}}

  HF transformers' own `{"quant_method": "mxfp4", "modules_to_not_convert": [...]}` spelling
  is read as the same format with the same tensors (HF's gpt-oss-only fused
  `*_blocks`/`*_scales` expert tensors do not exist in this model family). The scale of a
  block is the smallest power of two s with amax / s < 7 (Quark's "even" mode: nothing is
  clipped beyond what round-to-nearest-even onto the grid does anyway).

**NVFP4** (NVIDIA ModelOpt export, as `nvidia/*-NVFP4` releases ship it; vLLM's and SGLang's
`modelopt_fp4` loaders read it):

    X.weight          uint8          [out, in/2]    packed e2m1
    X.weight_scale    float8_e4m3fn  [out, in/16]   per-block scale
    X.weight_scale_2  float32        []             per-tensor scale = amax(W) / (6 * 448)
    X.input_scale     float32        []             static activation scale (W4A4 engines)
    W[i, j] = (e2m1(i, j) * float(weight_scale[i, j // 16])) * weight_scale_2

    config.json "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4",
      "group_size": 16, "ignore": [...], ...}; legacy `hf_quant_config.json`:
      {"quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": [...]}}

  Per-block scale = amax(block) / (6 * weight_scale_2) rounded to e4m3 (0 -> 1); gate_proj
  and up_proj of one MLP/expert share weight_scale_2, as ModelOpt exports them (engines fuse
  them into one GEMM with one global scale).

glmrt has no native FP4 GEMM yet: the loader dequantises each weight to the model dtype as it
reads it (fp32 math, one tensor at a time) and activations stay unquantised, so `input_scale`
is read, checked and dropped.
"""

from __future__ import annotations

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
MXFP4_GROUP = 32
NVFP4_GROUP = 16
FP4_SCHEMES = ("mxfp4", "nvfp4")
GROUP_SIZE = {"mxfp4": MXFP4_GROUP, "nvfp4": NVFP4_GROUP}
# Midpoints between neighbouring grid magnitudes: a tie goes to the even code.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def e2m1_lut(device=None) -> torch.Tensor:
    """The 16 code values (fp32): +grid then -grid."""
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags])


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even onto the e2m1 grid (saturating at ±6) -> codes (uint8, 0..15)."""
    x = x.float()
    a = x.abs()
    mids = torch.tensor(_MIDPOINTS, dtype=torch.float32, device=x.device)
    mag = torch.bucketize(a, mids)  # number of midpoints strictly below a
    tie = a == mids[mag.clamp(max=len(_MIDPOINTS) - 1)]
    mag = mag + (tie & (mag % 2 == 1)).to(mag.dtype)  # a tie between codes k, k+1 goes to the even one
    return (mag | ((x < 0).to(mag.dtype) << 3)).to(torch.uint8)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[..., n] codes (n even) -> [..., n/2] uint8, low nibble = even element."""
    if codes.shape[-1] % 2:
        raise ValueError(f"FP4 packing needs an even last dimension, got {tuple(codes.shape)}")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., n/2] uint8 -> [..., n] codes (uint8, 0..15)."""
    p = packed.to(torch.uint8)
    return torch.stack([p & 0x0F, p >> 4], dim=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)


def fp4_values(packed: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 -> its values as fp32, [..., n]."""
    return e2m1_lut(packed.device)[unpack_fp4(packed).int()]


def _groups(x: torch.Tensor, group: int) -> torch.Tensor:
    if x.shape[-1] % group:
        raise ValueError(f"the input dimension ({x.shape[-1]}) must be a multiple of {group}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // group, group)


# ---- MXFP4 -----------------------------------------------------------------------------------

def mxfp4_scale_exponents(amax: torch.Tensor) -> torch.Tensor:
    """Per-block amax -> biased E8M0 exponents (uint8): the smallest 2^e with amax / 2^e < 7."""
    mant, exp = torch.frexp(amax.float())  # amax = mant * 2^exp, mant in [0.5, 1)
    e = exp - 3 + (mant >= 0.875).to(exp.dtype)  # floor(log2 amax) - 2, +1 when amax/2^floor >= 1.75
    e = torch.where(amax > 0, e, torch.full_like(e, -127))
    return (e.clamp(-127, 127) + 127).to(torch.uint8)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., out, in] float -> (packed uint8 [..., out, in/2], E8M0 uint8 [..., out, in/32])."""
    g = _groups(w.float(), MXFP4_GROUP)
    scale = mxfp4_scale_exponents(g.abs().amax(dim=-1))
    q = e2m1_codes(g * torch.exp2(127.0 - scale.float())[..., None])  # exact: a power of two
    return pack_fp4(q.reshape(w.shape)), scale


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W = e2m1 * 2^(scale - 127), computed in fp32, returned in `dtype`."""
    vals = _groups(fp4_values(packed), MXFP4_GROUP)
    s = torch.exp2(scale.view(torch.uint8).float() - 127.0)
    s = torch.where(scale.view(torch.uint8) == 255, torch.full_like(s, float("nan")), s)
    return (vals * s[..., None]).reshape(*packed.shape[:-1], packed.shape[-1] * 2).to(dtype)


# ---- NVFP4 -----------------------------------------------------------------------------------

def nvfp4_global_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """weight_scale_2 for a tensor (or tensors sharing it) of absolute maximum `amax`."""
    amax = torch.as_tensor(amax, dtype=torch.float32)
    return torch.where(amax > 0, amax / (E2M1_MAX * E4M3_MAX), torch.ones_like(amax))


def quantize_nvfp4(w: torch.Tensor, global_scale: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[..., out, in] float -> (packed uint8 [..., out, in/2], e4m3 [..., out, in/16], fp32 scalar).

    `global_scale` (weight_scale_2) defaults to amax(w) / (6 * 448); pass a shared one to
    quantise fused partners (gate_proj / up_proj) consistently.
    """
    g = _groups(w.float(), NVFP4_GROUP)
    gs = nvfp4_global_scale(g.abs().amax()) if global_scale is None else torch.as_tensor(
        global_scale, dtype=torch.float32).reshape(())
    block = g.abs().amax(dim=-1) / (E2M1_MAX * gs)
    block = torch.where(block == 0, torch.ones_like(block), block).clamp(max=E4M3_MAX)
    s8 = block.to(torch.float8_e4m3fn)
    denom = (s8.float() * gs)[..., None]  # 0 only where the block scale underflows e4m3: codes 0
    q = e2m1_codes(torch.where(denom > 0, g / denom, torch.zeros_like(g)))
    return pack_fp4(q.reshape(w.shape)), s8, gs.reshape(())


def dequantize_nvfp4(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W = (e2m1 * float(scale)) * global_scale, computed in fp32, returned in `dtype`."""
    vals = _groups(fp4_values(packed), NVFP4_GROUP)
    out = (vals * scale.float()[..., None]) * global_scale.float().reshape(())
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * 2).to(dtype)
