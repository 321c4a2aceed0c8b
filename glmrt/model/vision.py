"""The GLM-5.3-Flash vision tower: pixel patches -> merged embeddings ready for the text stream.

Owns the patch embedding, the 2-D axial rotary, the ViT blocks, the 2x2 downsample and the
merger (docs/MODEL.md, the vision tower). `state_dict()` names are the checkpoint's `model.visual.*`
names with that prefix stripped; nothing else (no rotary buffers) is persistent.

Input layout is the processor's: patches block-major (each 2x2 merge block's 4 patches are
consecutive, row-major inside the block), each patch flattened as (channel, t, y, x).
An item of grid (t, h, w) is `t` independent frames of `h*w` patches; attention never
crosses a frame.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from glmrt.config import VisionConfig

_ACTS = {"silu": F.silu, "gelu": F.gelu}


def num_visual_tokens(grid_thw: torch.Tensor | list, spatial_merge_size: int = 2) -> list[int]:
    """Embeddings each item yields after merging: t*h*w / merge^2."""
    rows = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw
    return [int(t) * int(h) * int(w) // spatial_merge_size**2 for t, h, w in rows]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same rounding as the reference: normalise in fp32, cast back, then scale.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def _clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, act, limit: float | None) -> torch.Tensor:
    # The gate is clamped from above only; `up` on both sides.
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return act(gate) * up


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        d, i, bias = cfg.hidden_size, cfg.intermediate_size, cfg.attention_bias
        self.gate_proj = nn.Linear(d, i, bias=bias)
        self.up_proj = nn.Linear(d, i, bias=bias)
        self.down_proj = nn.Linear(i, d, bias=bias)
        self.act = _ACTS[cfg.hidden_act]
        self.limit = cfg.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(_clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.act, self.limit))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=cfg.attention_bias)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                segments: list[tuple[int, int]]) -> torch.Tensor:
        """x [N, D]; cos/sin [N, 1, head_dim] fp32; segments: (frames, patches per frame) per item."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = self.q_norm(q), self.k_norm(k)
        # Rotary in fp32, result back in the activation dtype (as the reference does).
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(v.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(v.dtype)
        out, start = [], 0
        for frames, frame_len in segments:
            # All frames of one item have the same length: batch them as [frames, H, L, d].
            end = start + frames * frame_len
            qs, ks, vs = (t[start:end].view(frames, frame_len, self.num_heads, self.head_dim).transpose(1, 2)
                          for t in (q, k, v))
            o = F.scaled_dot_product_attention(qs, ks, vs)  # bidirectional, scale = head_dim^-0.5
            out.append(o.transpose(1, 2).reshape(end - start, -1))
            start = end
        return self.proj(torch.cat(out) if len(out) > 1 else out[0])


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm2 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(self, x, cos, sin, segments):
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        k = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        # Kept as a Conv3d so the weight has the checkpoint's [D, C, T, p, p] shape; since
        # kernel == stride == the whole patch, it is applied as one linear map.
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=k, stride=k)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return F.linear(pixels.to(w.dtype), w.reshape(w.shape[0], -1), self.proj.bias)


class PatchMerger(nn.Module):
    """proj -> LayerNorm -> exact GELU -> clamped SwiGLU, all at out_hidden_size, no biases."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        d, i = cfg.out_hidden_size, cfg.projection_intermediate_size
        self.proj = nn.Linear(d, d, bias=False)
        self.post_projection_norm = nn.LayerNorm(d)  # eps 1e-5, not rms_norm_eps
        self.gate_proj = nn.Linear(d, i, bias=False)
        self.up_proj = nn.Linear(d, i, bias=False)
        self.down_proj = nn.Linear(i, d, bias=False)
        self.act = _ACTS[cfg.hidden_act]
        self.limit = cfg.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.post_projection_norm(self.proj(x)))
        return self.down_proj(_clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.act, self.limit))


class VisionTower(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        if cfg.head_dim % 4:
            raise ValueError(f"vision head_dim ({cfg.head_dim}) must be divisible by 4 for 2-D axial rotary")
        if cfg.hidden_act not in _ACTS:
            raise ValueError(f"vision hidden_act={cfg.hidden_act!r} is not supported ({sorted(_ACTS)})")
        self.cfg = cfg
        m = cfg.spatial_merge_size
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.post_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Applied as a linear map over each m*m block of consecutive patches (see forward).
        self.downsample = nn.Conv2d(cfg.hidden_size, cfg.out_hidden_size, kernel_size=m, stride=m)
        self.merger = PatchMerger(cfg)

    def num_visual_tokens(self, grid_thw: torch.Tensor | list) -> list[int]:
        return num_visual_tokens(grid_thw, self.cfg.spatial_merge_size)

    def _rotary(self, grid: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [N, 1, head_dim] (fp32) for every patch, in block-major order."""
        m, hd = self.cfg.spatial_merge_size, self.cfg.head_dim
        pos = []
        for t, h, w in grid:
            rows = torch.arange(h).view(h // m, m, 1, 1).expand(h // m, m, w // m, m)
            cols = torch.arange(w).view(1, 1, w // m, m).expand(h // m, m, w // m, m)
            # (block row, block col, row in block, col in block) = block-major order.
            rc = torch.stack([rows.permute(0, 2, 1, 3).flatten(), cols.permute(0, 2, 1, 3).flatten()], -1)
            pos.append(rc.repeat(t, 1))
        pos = torch.cat(pos).to(device=device, dtype=torch.float32)  # [N, 2]
        # head_dim/4 frequencies per axis; [row angles ; col angles] duplicated for rotate-half.
        inv_freq = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, hd // 2, 2, dtype=torch.float32) / (hd // 2)))
        ang = (pos[:, :, None] * inv_freq.to(device)).flatten(1)  # [N, hd/2]
        ang = torch.cat([ang, ang], dim=-1)[:, None, :]
        return ang.cos(), ang.sin()

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [N_patches, C*T*p*p], grid_thw [n_items, 3] (t, h, w in patches)
        -> [sum(t*h*w) / merge^2, out_hidden_size], items concatenated in order."""
        cfg, m = self.cfg, self.cfg.spatial_merge_size
        grid = [[int(v) for v in row] for row in grid_thw.tolist()]
        for t, h, w in grid:
            if h % m or w % m or t < 1:
                raise ValueError(f"grid (t={t}, h={h}, w={w}) must have h, w divisible by {m} and t >= 1")
        num_patches = sum(t * h * w for t, h, w in grid)
        patch_dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
        if tuple(pixel_values.shape) != (num_patches, patch_dim):
            raise ValueError(f"pixel_values shape {tuple(pixel_values.shape)} != ({num_patches}, {patch_dim}) "
                             f"implied by grid_thw")

        x = self.patch_embed(pixel_values)
        cos, sin = self._rotary(grid, x.device)
        segments = [(t, h * w) for t, h, w in grid]
        for block in self.blocks:
            x = block(x, cos, sin, segments)
        x = self.post_layernorm(x)
        # The conv's input is an m x m block of consecutive patches laid out [i, j, D]; its weight
        # is [out, D, i, j], so bring each block to (D, i, j) order and apply it as a linear map.
        w = self.downsample.weight
        x = x.view(-1, m * m, x.shape[-1]).transpose(1, 2).reshape(-1, w[0].numel())
        x = F.linear(x, w.reshape(w.shape[0], -1), self.downsample.bias)
        return self.merger(x)
