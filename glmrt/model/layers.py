"""Parameter-holding building blocks shared by every module of the model.

Each block owns its weights under the checkpoint's own names (`weight`, `bias`,
`weight_scale_inv`) and computes through the backend's ops, so the model never branches on
hardware. Weights are created on whatever device is current (`meta` while building, then
materialised by the loader or the random initialiser).
"""

from __future__ import annotations

import math

import torch
from torch import nn

FP8 = torch.float8_e4m3fn


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T (+ b); W may be FP8 e4m3 with per-block `weight_scale_inv` (see `to_fp8`)."""

    def __init__(self, ops, in_features: int, out_features: int, *, bias: bool = False,
                 dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.ops = ops
        self.in_features, self.out_features = in_features, out_features
        self.weight = _param(out_features, in_features, dtype=dtype)
        self.bias = _param(out_features, dtype=dtype) if bias else None
        self.weight_scale_inv: nn.Parameter | None = None
        self.block = (128, 128)

    def to_fp8(self, block: tuple[int, int]) -> None:
        """Switch storage to FP8 block-scaled (call before weights are materialised)."""
        self.block = tuple(block)
        self.weight = _param(self.out_features, self.in_features, dtype=FP8)
        self.weight_scale_inv = _param(math.ceil(self.out_features / block[0]),
                                       math.ceil(self.in_features / block[1]), dtype=torch.float32)

    @property
    def is_fp8(self) -> bool:
        return self.weight_scale_inv is not None

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in `dtype` (dequantised when FP8); for ops that need the matrix itself."""
        if self.is_fp8:
            from backends.reference import dequantize_block_fp8
            return dequantize_block_fp8(self.weight, self.weight_scale_inv, self.block, dtype)
        return self.weight.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, self.weight, self.bias, self.weight_scale_inv, self.block)


class StackedLinear(nn.Module):
    """E expert matrices stored as one [E, out, in] tensor (FP8-capable like Linear)."""

    def __init__(self, num: int, in_features: int, out_features: int, *, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.num, self.in_features, self.out_features = num, in_features, out_features
        self.weight = _param(num, out_features, in_features, dtype=dtype)
        self.weight_scale_inv: nn.Parameter | None = None
        self.block = (128, 128)

    def to_fp8(self, block: tuple[int, int]) -> None:
        self.block = tuple(block)
        self.weight = _param(self.num, self.out_features, self.in_features, dtype=FP8)
        self.weight_scale_inv = _param(self.num, math.ceil(self.out_features / block[0]),
                                       math.ceil(self.in_features / block[1]), dtype=torch.float32)

    @property
    def is_fp8(self) -> bool:
        return self.weight_scale_inv is not None


class RMSNorm(nn.Module):
    def __init__(self, ops, dim: int, eps: float, *, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.ops, self.eps = ops, eps
        self.weight = _param(dim, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class LayerNorm(nn.Module):
    def __init__(self, ops, dim: int, eps: float, *, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.ops, self.eps = ops, eps
        self.weight = _param(dim, dtype=dtype)
        self.bias = _param(dim, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.layer_norm(x, self.weight, self.bias, self.eps)


class WeightOnly(nn.Module):
    """A module that only carries `weight` (conv kernels, embeddings), named as in checkpoints."""

    def __init__(self, *shape: int, dtype: torch.dtype):
        super().__init__()
        self.weight = _param(*shape, dtype=dtype)


class SwiGLUMLP(nn.Module):
    """Dense or shared-expert MLP: down(silu(clamp(gate)) * clamp(up))."""

    def __init__(self, ops, hidden: int, inter: int, limit: float | None, *, dtype: torch.dtype):
        super().__init__()
        self.ops, self.limit = ops, limit
        self.gate_proj = Linear(ops, hidden, inter, dtype=dtype)
        self.up_proj = Linear(ops, hidden, inter, dtype=dtype)
        self.down_proj = Linear(ops, inter, hidden, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.swiglu(self.gate_proj(x), self.up_proj(x), self.limit))
