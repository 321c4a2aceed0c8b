"""DSA layers: NoPE MLA over the cached latent, selected by the k-pool DSA indexer.

Only the latent `c = kv_a_layernorm(kv_a_proj(x))` is cached per token (never per-head K/V);
a full indexer layer also caches one pooled key per completed k-pool and keeps the tail of
the incomplete pool in the request's state slot (docs/MODEL.md §3, §8.1).

Over several ranks the queries (q_b_proj), the latent's up-projection (kv_b_proj) and
o_proj (ROW-parallel: one all-reduce per layer) are split by head; q_a / kv_a, their norms,
the latent cache and the whole indexer are replicated (each rank computes them in full).
"""

from __future__ import annotations

import torch
from torch import nn

from glmrt.config import TextConfig
from glmrt.model.layers import COLUMN, ROW, LayerNorm, Linear, LinearGroup, RMSNorm, _param
from glmrt.parallel import Parallel


class Indexer(nn.Module):
    """Scores complete k-pools per query and returns the top pools (ties -> lower index)."""

    def __init__(self, cfg: TextConfig, layer: int, ops, dtype: torch.dtype):
        super().__init__()
        self.ops, self.layer = ops, layer
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.kpool, self.topk_pools = cfg.index_kpool, cfg.index_topk_pools
        d = cfg.hidden_size
        self.wq_b = Linear(ops, cfg.q_lora_rank, self.n_heads * self.head_dim, dtype=dtype)
        self.wk = Linear(ops, d, self.head_dim, dtype=dtype)
        self.k_norm = LayerNorm(ops, self.head_dim, 1e-6, dtype=dtype)
        self.weights_proj = Linear(ops, d, self.n_heads, dtype=dtype)
        self.index_kpool_compress_gate = _param(self.head_dim, d, dtype=dtype)
        self.index_kpool_compress_ape = _param(self.kpool, self.head_dim, dtype=dtype)
        # the two projections of the layer input, one GEMV once fused (weights_proj last: its 32
        # rows are no whole FP8 scale block)
        self.x_proj = LinearGroup(self.wk, self.weights_proj)
        self.weight_groups = (self.x_proj,)

    def keys(self, x: torch.Tensor, meta, cache) -> torch.Tensor:
        """The layer input's keys into the k-pools (tails, and pooled keys of completed pools);
        -> the per-head weights w for select. Reads x alone (the attention forks it beside its
        queries)."""
        k, w = self.x_proj(x)
        k = self.k_norm(k)
        g = self.ops.linear(x, self.index_kpool_compress_gate)
        capture = getattr(cache, "capture", None)  # a verify forward of speculative decoding (glmrt/engine/rollback.py)
        if capture is not None:
            capture.take(self.layer, capture.select(k), capture.select(g))
        tail_k, tail_g = cache.tail(self.layer)
        self.ops.indexer_update(k, g, self.index_kpool_compress_ape, cache.pooled(self.layer), tail_k, tail_g,
                                meta, self.kpool)
        return w

    def select(self, q_resid: torch.Tensor, w: torch.Tensor, meta, cache,
               q: torch.Tensor | None = None) -> torch.Tensor:
        """The top pools per query, after keys. `q`: wq_b(q_resid) when the attention computed it
        with its own queries (one GEMV)."""
        q = (self.wq_b(q_resid) if q is None else q).view(-1, self.n_heads, self.head_dim)
        # w goes unscaled: the op scales it by n_heads^-0.5 in fp32 where it scores pools (a
        # decode batch of short requests takes all pools and never reads it)
        return self.ops.indexer_select(q, w, cache.pooled(self.layer), meta, self.kpool, self.topk_pools)


class DSAAttention(nn.Module):
    def __init__(self, cfg: TextConfig, layer: int, ops, dtype: torch.dtype, *, has_indexer: bool,
                 parallel: Parallel | None = None):
        super().__init__()
        p = parallel or Parallel.single()
        self.ops, self.layer = ops, layer
        d, h = cfg.hidden_size, cfg.num_attention_heads  # h: the full head count (checkpoint shapes)
        self.num_heads = p.split(h, "num_attention_heads", 0).size  # this rank's heads
        self.kv_lora_rank = cfg.kv_lora_rank
        self.qk_head_dim, self.v_head_dim = cfg.qk_head_dim, cfg.v_head_dim
        self.nope_dim = cfg.qk_nope_head_dim
        self.kpool = cfg.index_kpool
        self.with_tail = cfg.index_kpool_always_select_tail
        self.scale = self.qk_head_dim ** -0.5  # NOTE: stays qk_head_dim^-0.5 in the absorbed form
        bias = cfg.attention_bias
        self.q_a_proj = Linear(ops, d, cfg.q_lora_rank, bias=bias, dtype=dtype)
        self.q_a_layernorm = RMSNorm(ops, cfg.q_lora_rank, cfg.rms_norm_eps, dtype=dtype)
        col = dict(dtype=dtype, parallel=p, style=COLUMN, name="num_attention_heads")
        self.q_b_proj = Linear(ops, cfg.q_lora_rank, h * self.qk_head_dim, **col)
        self.kv_a_proj_with_mqa = Linear(ops, d, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=bias, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(ops, cfg.kv_lora_rank, cfg.rms_norm_eps, dtype=dtype)
        self.kv_b_proj = Linear(ops, cfg.kv_lora_rank, h * (self.nope_dim + self.v_head_dim), **col)
        self.o_proj = Linear(ops, h * self.v_head_dim, d, bias=bias, dtype=dtype, parallel=p, style=ROW,
                             name="num_attention_heads")
        self.indexer = Indexer(cfg, layer, ops, dtype) if has_indexer else None
        self.in_proj = LinearGroup(self.q_a_proj, self.kv_a_proj_with_mqa)  # one GEMV of x once fused
        # the queries and the indexer's queries both read the normed q latent: one GEMV once fused
        self.q_proj = LinearGroup(self.q_b_proj, self.indexer.wq_b) if self.indexer is not None else None
        self.weight_groups = (self.in_proj,) + ((self.q_proj,) if self.q_proj is not None else ())

    def forward(self, x: torch.Tensor, meta, cache, carried_sel: torch.Tensor | None):
        """-> (output [N, D], the selection this layer used, for a following shared layer)."""
        n = x.shape[0]
        side = self.ops.fork(x)  # small independent launches beside each other (backends/side_work.py)
        if self.indexer is not None:
            with side:  # the indexer's keys, from x alone, beside the queries
                w_index = self.indexer.keys(x, meta, cache)
        q_a, kv_a = self.in_proj(x)
        with side:  # the latent's norm and its cache row (after the keys there), beside the queries
            latent = self.kv_a_layernorm(kv_a[..., : self.kv_lora_rank])
            self.ops.write_latent(latent, cache.latent(self.layer), meta)
        q_resid = self.q_a_layernorm(q_a)
        q, q_index = self.q_proj(q_resid) if self.q_proj is not None else (self.q_b_proj(q_resid), None)
        q = q.view(n, self.num_heads, self.qk_head_dim)  # a column slice of the fused product
        side.join()  # the latent is in the cache, the indexer's keys in their pools
        if self.indexer is not None:
            sel = self.indexer.select(q_resid, w_index, meta, cache, q_index)
        elif carried_sel is not None:
            sel = carried_sel
        else:
            raise RuntimeError(f"shared DSA layer {self.layer} got no selection from the layer before it")
        w = self.kv_b_proj.dense_weight(x.dtype).view(self.num_heads, self.nope_dim + self.v_head_dim,
                                                      self.kv_lora_rank)
        w_kc, w_vc = w[:, : self.nope_dim], w[:, self.nope_dim:]
        o = self.ops.sparse_mla(q, cache.latent(self.layer), w_kc, w_vc, sel, meta, self.kpool, self.scale,
                                self.with_tail)
        return self.o_proj(o.reshape(n, self.num_heads * self.v_head_dim)), sel
