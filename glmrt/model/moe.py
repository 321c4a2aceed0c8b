"""The MoE FFN: sigmoid router with correction bias and group limit, routed experts, shared expert.

Over several ranks the router is replicated and the shared expert is split by intermediate
size; the routed experts are either split the same way (TP-MoE, `ep_size` 1: every rank holds
every expert's I / tp slice) or split whole across the ranks (EP: rank r holds experts
[r·E/ep, (r+1)·E/ep)). Either way each rank's output is a partial sum over its share, and the
routed and shared partials are added first and all-reduced once per layer, by the
`TokenDispatcher`.
"""

from __future__ import annotations

import torch
from torch import nn

from glmrt.config import TextConfig
from glmrt.model.layers import StackedLinear, SwiGLUMLP, _param
from glmrt.parallel import Parallel, Split


class Router(nn.Module):
    def __init__(self, cfg: TextConfig, dtype: torch.dtype):
        super().__init__()
        self.weight = _param(cfg.n_routed_experts, cfg.hidden_size, dtype=dtype)
        self.e_score_correction_bias = _param(cfg.n_routed_experts, dtype=torch.float32)


class Experts(nn.Module):
    """Routed experts stacked per projection: gate/up [E, I, D], down [E, D, I] (this rank's
    experts, or every expert's slice of I)."""

    def __init__(self, cfg: TextConfig, dtype: torch.dtype, parallel: Parallel | None = None):
        super().__init__()
        p = parallel or Parallel.single()
        e, d, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        up = down = None
        if p.ep_size > 1:
            up = down = p.split(e, "n_routed_experts", 0, parts=p.ep_size)
        elif p.active:
            up = p.split(i, "moe_intermediate_size", 1)
            down = Split(2, up.start, up.size, up.full)
        self.gate_proj = StackedLinear(e, d, i, dtype=dtype, split=up)
        self.up_proj = StackedLinear(e, d, i, dtype=dtype, split=up)
        self.down_proj = StackedLinear(e, i, d, dtype=dtype, split=down)


class TokenDispatcher:
    """Brings the tokens to the experts of this rank and their outputs back.

    This one serves tensor-parallel attention, where every rank already holds every token: the
    router runs on each rank in full, dispatch keeps each rank's picks of its own experts
    (renumbered from 0; other picks become -1, which `ops.moe_experts` drops), and combine is
    the MoE's one all-reduce of the rank's partial sum (routed + shared). At TP-MoE every pick is
    local and dispatch is the identity. The interface (dispatch before the experts, combine
    after) is where an all-to-all dispatcher (DeepEP-style, or all-gather / reduce-scatter for
    data-parallel attention) fits, sending each token only to the ranks of its experts."""

    def __init__(self, parallel: Parallel, num_experts: int):
        self.parallel = parallel
        self.first, self.local = 0, num_experts
        if parallel.ep_size > 1:
            self.first, self.local = parallel.shard(num_experts, "n_routed_experts", parts=parallel.ep_size)

    def dispatch(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
        """-> (tokens, local expert ids, weights) for this rank's experts."""
        if self.parallel.ep_size == 1:
            return x, ids, weights
        local = ids - self.first
        local = torch.where((local >= 0) & (local < self.local), local, -1)
        return x, local, weights

    def combine(self, partial: torch.Tensor) -> torch.Tensor:
        return self.parallel.all_reduce(partial)


class SharedExpertSlot:
    """The shared expert seated as expert E of the routed experts' stacked tensors, so that one
    fused-MoE launch runs it as a (k+1)-th pick of every token with weight 1 (the router appends
    it): at decode that removes its two GEMVs and four elementwise launches per layer (clamp,
    SiLU, product, the final add), the weights read by the same bandwidth-bound kernel.

    Like LinearGroup, `fuse()` (after the model is built, before weights are written) allocates
    [E+1, out, in] tensors (and FP8 scales) and re-seats the experts' parameters as rows [0, E)
    and the shared expert's as row E: loading and counting see the checkpoint's names and shapes
    unchanged. Only a shared expert of the routed experts' shape and format can sit there; else
    nothing is seated and the shared expert keeps its own (gate/up-fused) path."""

    PROJ = ("gate_proj", "up_proj", "down_proj")  # the same names on Experts and SwiGLUMLP

    def __init__(self, experts: Experts, shared: SwiGLUMLP):
        self.experts, self.shared = experts, shared
        self.tensors: dict[str, torch.Tensor] | None = None
        self.scales: dict[str, torch.Tensor] | None = None

    def fusable(self) -> bool:
        for name in self.PROJ:
            st, lin = getattr(self.experts, name), getattr(self.shared, name)
            if (tuple(lin.weight.shape) != tuple(st.weight.shape[1:]) or lin.weight.dtype != st.weight.dtype
                    or lin.is_fp8 != st.is_fp8 or lin.bias is not None
                    or (st.is_fp8 and tuple(lin.block) != tuple(st.block))):
                return False
        return True

    def fuse(self, device: torch.device | str | None = None) -> bool:
        if self.tensors is not None:
            return True
        dev = torch.device(device) if device is not None else self.experts.gate_proj.weight.device
        if dev.type == "meta" or not self.fusable():
            return self.shared.gate_up.fuse(device)  # the shared expert's own path, gate/up fused
        self.tensors, self.scales = {}, {}
        for name in self.PROJ:
            st, lin = getattr(self.experts, name), getattr(self.shared, name)
            for attr, store in (("weight", self.tensors), ("weight_scale_inv", self.scales)):
                p = getattr(st, attr)
                if p is None:
                    continue
                full = torch.empty(p.shape[0] + 1, *p.shape[1:], dtype=p.dtype, device=dev)
                setattr(st, attr, nn.Parameter(full[:-1], requires_grad=False))
                setattr(lin, attr, nn.Parameter(full[-1], requires_grad=False))
                store[name] = full
        return True

    @property
    def fused(self) -> bool:
        return self.tensors is not None


class MoE(nn.Module):
    def __init__(self, cfg: TextConfig, ops, dtype: torch.dtype, parallel: Parallel | None = None):
        super().__init__()
        p = parallel or Parallel.single()
        self.ops, self.cfg, self.parallel = ops, cfg, p
        self.gate = Router(cfg, dtype)
        self.experts = Experts(cfg, dtype, p)
        self.dispatcher = TokenDispatcher(p, cfg.n_routed_experts)
        self.shared_experts = SwiGLUMLP(ops, cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts,
                                        cfg.swiglu_limit, dtype=dtype, parallel=p, reduce=False)
        self.shared_slot: SharedExpertSlot | None = None
        # Under EP the shared expert (split by I) has not the local experts' (whole) shape: no slot.
        if getattr(ops, "fuse_shared_experts", False) and cfg.n_shared_experts == 1 and p.ep_size == 1:
            # the slot decides at fuse time; it fuses the shared gate/up itself when it cannot seat
            self.shared_slot = SharedExpertSlot(self.experts, self.shared_experts)
            self.shared_experts.weight_groups = ()
            self.weight_groups = (self.shared_slot,)

    def forward(self, x: torch.Tensor, *, defer_sum: bool = False) -> torch.Tensor:
        """`defer_sum`: the caller passes the result to ops.mhc_post, which also takes the ops'
        MoEPartials (the top-k sum done there, not in its own launch). Over several ranks the
        sum is done here, before the all-reduce (partials would cost k times the traffic)."""
        c = self.cfg
        defer_sum = defer_sum and not self.parallel.active
        slot = self.shared_slot if self.shared_slot is not None and self.shared_slot.fused else None
        weights, ids = self.ops.moe_route(x, self.gate.weight, self.gate.e_score_correction_bias,
                                          c.num_experts_per_tok, c.n_group, c.topk_group, c.norm_topk_prob,
                                          c.routed_scaling_factor,
                                          **({"append_expert": c.n_routed_experts} if slot else {}))
        ex = self.experts
        xe, ids, weights = self.dispatcher.dispatch(x, ids, weights)
        if slot is not None:  # the shared expert is pick k+1 (weight 1) of every token
            scales = tuple(slot.scales[p] for p in slot.PROJ) if slot.scales else None
            out = self.ops.moe_experts(xe, ids, weights, *(slot.tensors[p] for p in slot.PROJ),
                                       c.swiglu_limit, scales, ex.gate_proj.block, defer_sum=defer_sum)
            return out if defer_sum else self.dispatcher.combine(out)
        scales = None
        if ex.gate_proj.is_fp8:
            scales = (ex.gate_proj.weight_scale_inv, ex.up_proj.weight_scale_inv, ex.down_proj.weight_scale_inv)
        routed = self.ops.moe_experts(xe, ids, weights, ex.gate_proj.weight, ex.up_proj.weight, ex.down_proj.weight,
                                      c.swiglu_limit, scales, ex.gate_proj.block)
        return self.dispatcher.combine(routed + self.shared_experts(x))
