"""The MTP (NextN) draft layer: a plain DeepSeek-V3 block (DSA attention with its own indexer,
MoE, ordinary residuals, no mHC) fed by the target's final hidden state (docs/MODEL.md §6).

Draft step for position t: e = embed(token_{t+1}), h = target hidden at t (after the final
norm), z = eh_proj([enorm(e); hnorm(h)]), z -> block -> shared_head.norm -> target lm_head.
Further draft steps feed the returned hidden state back as h. Its cache is one extra DSA
layer, at layer index `num_hidden_layers` of the ModelCache.
"""

from __future__ import annotations

import torch
from torch import nn

from glmrt.config import TextConfig
from glmrt.model.layers import Linear, RMSNorm
from glmrt.model.mla_dsa import DSAAttention
from glmrt.model.moe import MoE
from glmrt.parallel import Parallel


class SharedHead(nn.Module):
    def __init__(self, ops, cfg: TextConfig, dtype: torch.dtype):
        super().__init__()
        self.norm = RMSNorm(ops, cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)


class MTPLayer(nn.Module):
    def __init__(self, cfg: TextConfig, ops, dtype: torch.dtype, parallel: Parallel | None = None):
        super().__init__()
        self.ops, self.layer = ops, cfg.num_hidden_layers
        d = cfg.hidden_size
        self.eh_proj = Linear(ops, 2 * d, d, dtype=dtype)
        self.enorm = RMSNorm(ops, d, cfg.rms_norm_eps, dtype=dtype)
        self.hnorm = RMSNorm(ops, d, cfg.rms_norm_eps, dtype=dtype)
        self.shared_head = SharedHead(ops, cfg, dtype)
        self.input_layernorm = RMSNorm(ops, d, cfg.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(ops, d, cfg.rms_norm_eps, dtype=dtype)
        # sharded as the target's layers are; eh_proj and the norms are replicated
        self.self_attn = DSAAttention(cfg, self.layer, ops, dtype, has_indexer=True, parallel=parallel)
        self.mlp = MoE(cfg, ops, dtype, parallel)

    @torch.no_grad()
    def forward(self, next_embeds: torch.Tensor, hidden: torch.Tensor, meta, cache) -> torch.Tensor:
        """next_embeds [N, D] (embedding of token t+1), hidden [N, D] -> draft hidden [N, D] (normed)."""
        return self.draft(next_embeds, hidden, meta, cache)

    def draft(self, next_embeds: torch.Tensor, hidden: torch.Tensor, meta, cache) -> torch.Tensor:
        """`forward` where autograd may record it (training: glmrt/train/)."""
        ops = self.ops
        ops.begin_forward(next_embeds.shape[0])
        z = self.eh_proj(ops.rms_norm_pair(next_embeds, self.enorm.weight, hidden, self.hnorm.weight, self.enorm.eps))
        a, _ = self.self_attn(self.input_layernorm(z), meta, cache, None)
        # each residual add with the norm after it (one launch each on cuda-h200)
        z, h = ops.add_rms_norm(z, a, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps)
        _, out = ops.add_rms_norm(z, self.mlp(h), self.shared_head.norm.weight, self.shared_head.norm.eps)
        return out
