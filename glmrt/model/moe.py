"""The MoE FFN: sigmoid router with correction bias and group limit, routed experts, shared expert."""

from __future__ import annotations

import torch
from torch import nn

from glmrt.config import TextConfig
from glmrt.model.layers import StackedLinear, SwiGLUMLP, _param


class Router(nn.Module):
    def __init__(self, cfg: TextConfig, dtype: torch.dtype):
        super().__init__()
        self.weight = _param(cfg.n_routed_experts, cfg.hidden_size, dtype=dtype)
        self.e_score_correction_bias = _param(cfg.n_routed_experts, dtype=torch.float32)


class Experts(nn.Module):
    """Routed experts stacked per projection: gate/up [E, I, D], down [E, D, I]."""

    def __init__(self, cfg: TextConfig, dtype: torch.dtype):
        super().__init__()
        e, d, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_proj = StackedLinear(e, d, i, dtype=dtype)
        self.up_proj = StackedLinear(e, d, i, dtype=dtype)
        self.down_proj = StackedLinear(e, i, d, dtype=dtype)


class MoE(nn.Module):
    def __init__(self, cfg: TextConfig, ops, dtype: torch.dtype):
        super().__init__()
        self.ops, self.cfg = ops, cfg
        self.gate = Router(cfg, dtype)
        self.experts = Experts(cfg, dtype)
        self.shared_experts = SwiGLUMLP(ops, cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts,
                                        cfg.swiglu_limit, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        weights, ids = self.ops.moe_route(x, self.gate.weight, self.gate.e_score_correction_bias,
                                          c.num_experts_per_tok, c.n_group, c.topk_group, c.norm_topk_prob,
                                          c.routed_scaling_factor)
        ex = self.experts
        scales = None
        if ex.gate_proj.is_fp8:
            scales = (ex.gate_proj.weight_scale_inv, ex.up_proj.weight_scale_inv, ex.down_proj.weight_scale_inv)
        routed = self.ops.moe_experts(x, ids, weights, ex.gate_proj.weight, ex.up_proj.weight, ex.down_proj.weight,
                                      c.swiglu_limit, scales, ex.gate_proj.block)
        return routed + self.shared_experts(x)
