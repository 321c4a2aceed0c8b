"""The GLM-5.3-Flash text model, read aloud:

    ids -> embed -> copy into hc_mult streams -> [mHC(attn), mHC(ffn)] x L -> stream mean -> norm -> lm_head

Serving-shaped: one flat batch of tokens from many requests (no padding), described by a
`BatchMeta`, reading and writing per-request caches through a `ModelCache`. Attention is
KDA or DSA per `layer_types`, the FFN dense or MoE per `mlp_layer_types`. A "shared" DSA
layer reuses the selection of the DSA layer right before it.

Built with a `Parallel` of several ranks, each rank holds its shard of every layer (see the
layer modules) and the mHC streams whole; the embedding and the LM head are split by vocab
(the lookup masks other ranks' ids and all-reduces; the head's logits are all-gathered, so
every rank returns the full logits). Every rank runs every collective of a step in the same
order, whatever its batch: a step of 0 tokens still takes part (with empty tensors).
"""

from __future__ import annotations

import torch
from torch import nn

from glmrt.config import ModelConfig, TextConfig
from glmrt.model.kda import KDAAttention
from glmrt.model.layers import COLUMN, Linear, RMSNorm, SwiGLUMLP, WeightOnly, _param
from glmrt.model.mla_dsa import DSAAttention
from glmrt.model.moe import MoE
from glmrt.parallel import Parallel


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer: int, ops, dtype: torch.dtype, parallel: Parallel | None = None):
        super().__init__()
        self.ops, self.layer, self.cfg = ops, layer, cfg
        self.is_dsa = cfg.is_dsa(layer)
        d, m = cfg.hidden_size, cfg.hc_mult
        self.input_layernorm = RMSNorm(ops, d, cfg.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(ops, d, cfg.rms_norm_eps, dtype=dtype)
        mix = (2 + m) * m
        # NOTE: mHC parameters are kept fp32 (as SGLang does; HF rounds them to the load dtype).
        self.hc_attn_fn = _param(mix, m * d, dtype=torch.float32)
        self.hc_attn_base = _param(mix, dtype=torch.float32)
        self.hc_attn_scale = _param(3, dtype=torch.float32)
        self.hc_ffn_fn = _param(mix, m * d, dtype=torch.float32)
        self.hc_ffn_base = _param(mix, dtype=torch.float32)
        self.hc_ffn_scale = _param(3, dtype=torch.float32)
        if self.is_dsa:
            self.self_attn = DSAAttention(cfg, layer, ops, dtype, has_indexer=cfg.has_indexer(layer),
                                          parallel=parallel)
        else:
            self.self_attn = KDAAttention(cfg, layer, ops, dtype, parallel)
        self.mlp = MoE(cfg, ops, dtype, parallel) if cfg.is_moe(layer) else \
            SwiGLUMLP(ops, d, cfg.intermediate_size, cfg.swiglu_limit, dtype=dtype, parallel=parallel)

    def _hc_pre(self, streams, fn, base, scale, norm: RMSNorm):
        """mHC pre, its collapse through the sublayer's input norm (one op: the kernels fuse it)."""
        c = self.cfg
        return self.ops.mhc_pre(streams, fn, base, scale, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps,
                                norm=(norm.weight, norm.eps))

    def forward(self, streams: torch.Tensor, meta, cache, carried_sel):
        post, comb, h = self._hc_pre(streams, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale,
                                     self.input_layernorm)
        sel = None
        if self.is_dsa:
            h, sel = self.self_attn(h, meta, cache, carried_sel)
        else:
            h = self.self_attn(h, meta, cache)
        streams = self.ops.mhc_post(h, streams, post, comb)
        post, comb, x = self._hc_pre(streams, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale,
                                     self.post_attention_layernorm)
        # the MoE's top-k sum is left to mhc_post where the ops can (one launch less per layer)
        h = self.mlp(x, defer_sum=True) if isinstance(self.mlp, MoE) else self.mlp(x)
        return self.ops.mhc_post(h, streams, post, comb), sel


class TextModel(nn.Module):
    def __init__(self, cfg: TextConfig, ops, dtype: torch.dtype, parallel: Parallel | None = None):
        super().__init__()
        self.cfg, self.ops = cfg, ops
        self.parallel = parallel or Parallel.single()
        vocab = self.parallel.split(cfg.vocab_size, "vocab_size", 0)
        self.embed_tokens = WeightOnly(cfg.vocab_size, cfg.hidden_size, dtype=dtype, split=vocab)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, ops, dtype, parallel)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(ops, cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        w = self.embed_tokens.weight
        if not self.parallel.active:
            return w[input_ids]
        # vocab-parallel: this rank's rows for its ids, zeros for the others', summed over ranks
        local = input_ids - self.embed_tokens.splits["weight"].start
        mine = (local >= 0) & (local < w.shape[0])
        out = w[torch.where(mine, local, 0)] * mine.unsqueeze(-1).to(w.dtype)
        return self.parallel.all_reduce(out)

    def embed_streams(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The mHC streams [N, M, D] of token ids, each stream the token's embedding: one gather
        of [N, M] ids, not a lookup and then a copy into M streams (over a vocab split, the
        summed lookup, then the copy)."""
        if self.parallel.active:
            return self._streams(self.embed(input_ids))
        return self.embed_tokens.weight[input_ids.unsqueeze(1).expand(-1, self.cfg.hc_mult)]

    def _streams(self, embeds: torch.Tensor) -> torch.Tensor:
        return embeds.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()

    def forward(self, embeds: torch.Tensor, meta, cache) -> torch.Tensor:
        """embeds [N, D] (or their streams [N, M, D], embed_streams) -> final normed hidden states
        [N, D] (the lm_head input)."""
        self.ops.begin_forward(embeds.shape[0])
        streams = embeds if embeds.dim() == 3 else self._streams(embeds)
        sel = None
        for layer in self.layers:
            streams, sel = layer(streams, meta, cache, sel)
        return self.ops.stream_mean_rms_norm(streams, self.norm.weight, self.norm.eps)


class Glm5NextForCausalLM(nn.Module):
    """Text model + LM head, with the optional vision tower and MTP draft layer beside it."""

    def __init__(self, config: ModelConfig, ops, dtype: torch.dtype = torch.bfloat16, *,
                 with_vision: bool = True, with_mtp: bool = True, parallel: Parallel | None = None):
        super().__init__()
        self.config, self.ops, self.dtype = config, ops, dtype
        self.parallel = parallel or Parallel.single()
        t = config.text
        self.model = TextModel(t, ops, dtype, self.parallel)
        self.lm_head = Linear(ops, t.hidden_size, t.vocab_size, dtype=dtype, parallel=self.parallel,
                              style=COLUMN, name="vocab_size")
        self.visual = None
        if with_vision and config.vision is not None:
            from glmrt.model.vision import VisionTower
            self.visual = VisionTower(config.vision).to(dtype)
        self.mtp = None
        if with_mtp and t.num_nextn_predict_layers > 0:
            from glmrt.model.mtp import MTPLayer
            self.mtp = MTPLayer(t, ops, dtype, self.parallel)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocab logits on every rank (each rank's vocab slice, all-gathered)."""
        if self.config.text.tie_word_embeddings:
            logits = self.ops.linear(hidden, self.model.embed_tokens.weight)
        else:
            logits = self.lm_head(hidden)
        return self.parallel.all_gather(logits, dim=-1)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor | None, meta, cache, *, input_embeds: torch.Tensor | None = None,
                logits_indices: torch.Tensor | None = None):
        """One serving step. -> (logits [len(logits_indices) or N, V], hidden [N, D]).

        `input_embeds` (e.g. with image features merged in) replaces the embedding lookup;
        `logits_indices` selects the flat tokens whose logits are needed (the last of each
        request when sampling), so the LM head runs only on those.
        """
        embeds = self.model.embed_streams(input_ids) if input_embeds is None else input_embeds.to(self.dtype)
        hidden = self.model(embeds, meta, cache)
        h = hidden if logits_indices is None else hidden[logits_indices]
        return self.compute_logits(h), hidden
