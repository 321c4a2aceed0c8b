"""What one rank of a tensor- (and expert-) parallel glmrt engine holds and touches, counted
from the model itself: `bench.projection` builds rank 0 of each configuration on torch's
`meta` device (no memory, no weights) with glmrt's own `build_model`, so every shard, every
replicated tensor and every FP8 conversion is the code's, not a re-derivation.

A decode step is cut into parts, one per decoder layer plus the `head` (embedding rows, final
norm, LM head) and the `mtp` draft layer; each part carries its weight bytes and the
multiply-adds a token does in it, split by weight format (the FP8 and the 16-bit rate differ).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from glmrt.cache.layout import DTYPE_BYTES, CacheLayout
from glmrt.config import ModelConfig
from glmrt.model.layers import FP8, Linear
from glmrt.model.loader import build_model, default_fp8_modules, param_splits
from glmrt.parallel import Parallel

NO_FLOPS = ("weight_scale_inv", "e_score_correction_bias")  # stored, never multiplied per token


@dataclass
class Part:
    """One layer of one rank. `dense_*` is read whole by every step; `expert_*` are the routed
    experts this rank holds (read only where the batch routes); elements count the weights a
    token multiplies (2 FLOPs each), routed experts by the share k/E a token picks."""

    name: str
    kind: str                      # "kda", "dsa", "head", "mtp"
    has_indexer: bool = False
    dense_bytes: int = 0
    expert_bytes: int = 0
    elems_16: int = 0              # 16/32-bit weights a token multiplies
    elems_fp8: int = 0
    expert_elems_16: int = 0
    expert_elems_fp8: int = 0
    embed_row_bytes: int = 0       # head: one embedding row (a step reads b of them)
    derived_bytes: int = 0         # FP8 kv_b_proj's kept bf16 copy: held and read instead of it


@dataclass
class RankModel:
    """Rank 0 of a (tp, ep) engine of `cfg` in one weight format, as parts; the whole model's
    bytes beside it (replicated = the tensors every rank holds whole)."""

    cfg: ModelConfig
    tp: int
    ep: int
    quantization: str
    parts: list[Part]
    params: int                    # parameters of this rank (elements)
    weight_bytes: int              # everything this rank stores, kept derived copies included
    replicated_bytes: int          # tensors this rank holds whole although tp > 1
    layout: CacheLayout = field(repr=False, default=None)
    model: torch.nn.Module = field(repr=False, default=None)  # the meta-device rank it counts

    def target(self) -> list[Part]:
        return [p for p in self.parts if p.kind != "mtp"]

    def mtp(self) -> Part | None:
        return next((p for p in self.parts if p.kind == "mtp"), None)

    def head(self) -> Part:
        return next(p for p in self.parts if p.kind == "head")


def _tally(part: Part, module: torch.nn.Module, prefix: str, experts: set[str], splits: dict) -> int:
    """Add `module`'s parameters to `part`; -> the bytes of those held whole although sharded
    elsewhere (split None while the group has several ranks)."""
    whole = 0
    for name, p in module.named_parameters(prefix=prefix):
        nbytes = p.numel() * p.element_size()
        is_expert = name.rpartition(".")[0].rpartition(".")[0] in experts
        flops = name.rpartition(".")[2] not in NO_FLOPS
        fp8 = p.dtype == FP8
        if is_expert:
            part.expert_bytes += nbytes
        else:
            part.dense_bytes += nbytes
        if flops:
            elems = ("expert_" if is_expert else "") + ("elems_fp8" if fp8 else "elems_16")
            setattr(part, elems, getattr(part, elems) + p.numel())
        if splits.get(name) is None:
            whole += nbytes
    return whole


def rank_model(cfg: ModelConfig, tp: int = 1, ep: int = 1, quantization: str = "bf16",
               *, page_size: int = 64, kv_dtype: str = "bfloat16") -> RankModel:
    """Build rank 0 of `cfg` at (tp, ep) on the meta device and count it (text model + MTP
    layer; the vision tower is left out). `quantization` "fp8": the linears and experts glmrt's
    `--quantization fp8` converts (block-scaled e4m3), the rest in bf16, as load_dummy does."""
    if quantization not in ("bf16", "fp8"):
        raise ValueError(f"--quantization {quantization!r}: choose bf16 or fp8")
    dtype = torch.bfloat16
    fp8 = default_fp8_modules(cfg, dtype) if quantization == "fp8" else []
    block = cfg.quantization.weight_block_size if cfg.quantization else (128, 128)
    model = build_model(cfg, None, dtype, "meta", fp8_modules=fp8, fp8_block=tuple(block), with_vision=False,
                        with_mtp=True, parallel=Parallel(0, tp, ep))
    splits = param_splits(model) if tp > 1 else {}
    experts = {n for n, m in model.named_modules() if type(m).__name__ == "Experts"}
    t = cfg.text
    parts, whole = [], 0
    head = Part("head", "head")
    for prefix, mod in (("model.embed_tokens", model.model.embed_tokens), ("model.norm", model.model.norm),
                        ("lm_head", model.lm_head)):
        whole += _tally(head, mod, prefix, experts, splits)
    emb = model.model.embed_tokens.weight
    head.embed_row_bytes = emb.shape[1] * emb.element_size()
    # the lookup multiplies nothing: its weights are bytes (b rows), not FLOPs
    head.elems_16 -= emb.numel()
    head.dense_bytes -= emb.numel() * emb.element_size()
    for i, layer in enumerate(model.model.layers):
        part = Part(f"layer{i}", "dsa" if t.is_dsa(i) else "kda", has_indexer=t.has_indexer(i))
        whole += _tally(part, layer, f"model.layers.{i}", experts, splits)
        parts.append(part)
    if model.mtp is not None:
        part = Part("mtp", "mtp", has_indexer=True)
        whole += _tally(part, model.mtp, "mtp", experts, splits)
        parts.append(part)
    # An FP8 kv_b_proj is dequantised once and kept (Linear.dense_weight): the absorbed MLA reads
    # that bf16 copy every step, and it is held beside the FP8 weight.
    for name, mod in model.named_modules():
        if name.endswith("kv_b_proj") and isinstance(mod, Linear) and mod.is_fp8:
            owner = "mtp" if name.startswith("mtp.") else f"layer{name.split('.')[2]}"
            p = next(x for x in parts if x.name == owner)
            p.derived_bytes += mod.weight.numel() * 2
    parts.append(head)
    params = sum(p.numel() for p in model.parameters())
    stored = sum(p.numel() * p.element_size() for p in model.parameters()) + sum(p.derived_bytes for p in parts)
    layout = CacheLayout.from_config(t, page_size=page_size, kv_dtype=kv_dtype, model_dtype="bfloat16", tp_size=tp)
    return RankModel(cfg, tp, ep, quantization, parts, params, stored, whole if tp > 1 else 0, layout, model)


def touched_fraction(cfg: ModelConfig, tokens: int) -> float:
    """Expected share of the routed experts a batch of `tokens` reaches, uniform routing."""
    t = cfg.text
    return 1 - (1 - t.num_experts_per_tok / t.n_routed_experts) ** tokens


def busiest_rank_experts(cfg: ModelConfig, ep: int, tokens: int) -> float:
    """Expected largest count of reached experts on one of `ep` ranks of E / ep experts each
    (each expert reached independently with the uniform-routing probability): the rank the step
    waits for. At ep 1 (TP-MoE) every rank reads the same slices: the mean, E p."""
    t = cfg.text
    p = touched_fraction(cfg, tokens)
    n = t.n_routed_experts // ep
    if ep == 1:
        return n * p
    cdf, acc = [], 0.0
    for m in range(n + 1):
        acc += math.comb(n, m) * p ** m * (1 - p) ** (n - m)
        cdf.append(min(acc, 1.0))
    return sum(1 - cdf[m - 1] ** ep for m in range(1, n + 1))


def selected_rows(cfg: ModelConfig, context: int) -> int:
    """Latent rows one query of a DSA layer reads: the top pools and the incomplete tail pool."""
    t = cfg.text
    return min(context, t.index_topk_pools * t.index_kpool + t.index_kpool - 1)


def cache_bytes(rm: RankModel, part: Part, b: int, context: int) -> int:
    """HBM bytes a decode step of `b` requests at `context` reads and writes in `part`'s caches on
    this rank: a DSA layer's selected latent rows and (with its own indexer) the pooled keys it
    scores, its indexer tail read and written; a KDA layer's conv and recurrent state read and
    written; the head: the kept last hidden state, as bench.decode_overlap.floor_ms counts it."""
    lay, t = rm.layout, rm.cfg.text
    if part.kind in ("dsa", "mtp"):
        n = b * selected_rows(rm.cfg, context) * lay.latent_row_bytes
        if part.has_indexer:
            n += b * (context // t.index_kpool) * t.index_head_dim * DTYPE_BYTES[lay.index_dtype]
            n += 2 * b * 2 * lay.kpool * lay.index_head_dim * DTYPE_BYTES[lay.index_dtype]
        return n
    if part.kind == "kda":
        return 2 * b * (lay.conv_bytes_per_slot + lay.recurrent_bytes_per_slot) // max(1, lay.num_kda)
    return 2 * b * lay.hidden_bytes_per_slot


def attention_flops(rm: RankModel, part: Part, context: int) -> float:
    """FLOPs per token beyond the weights, on this rank: sparse MLA over the selected rows (score
    and output, 2 x 2 x heads x kv_lora_rank per row, this rank's heads), the indexer over the
    pooled keys (replicated), KDA at 4 dk dv per head (the prefill bench's count)."""
    t = rm.cfg.text
    if part.kind in ("dsa", "mtp"):
        heads = t.num_attention_heads // rm.tp
        f = 4.0 * heads * t.kv_lora_rank * selected_rows(rm.cfg, context)
        if part.has_indexer:
            f += 2.0 * t.index_n_heads * t.index_head_dim * (context // t.index_kpool)
        return f
    if part.kind == "kda":
        return 4.0 * (t.linear_num_heads // rm.tp) * t.linear_head_dim ** 2
    return 0.0


def step_bytes(rm: RankModel, part: Part, b: int, context: int, expert_tokens: int | None = None) -> float:
    """HBM bytes of `part` in one forward of `b` requests on the busiest rank: its dense weights
    once (the kept bf16 kv_b_proj instead of its FP8 original), the routed experts the forward's
    tokens reach (`expert_tokens`, default b), the embedding rows, the caches."""
    n = part.dense_bytes + cache_bytes(rm, part, b, context) + b * part.embed_row_bytes
    if part.derived_bytes:
        n += part.derived_bytes - part.derived_bytes // 2  # read the bf16 copy, not the e4m3 weight
    if part.expert_bytes:
        e = rm.cfg.text.n_routed_experts // rm.ep
        n += part.expert_bytes / e * busiest_rank_experts(rm.cfg, rm.ep, expert_tokens or b)
    return n


def token_flops(rm: RankModel, part: Part, context: int) -> tuple[float, float]:
    """-> (16-bit FLOPs, FP8 FLOPs) one token does in `part` on this rank (routed experts by
    the expected k / E share of this rank's experts' weights)."""
    t = rm.cfg.text
    share = t.num_experts_per_tok / t.n_routed_experts
    f16 = 2.0 * (part.elems_16 + share * part.expert_elems_16) + attention_flops(rm, part, context)
    f8 = 2.0 * (part.elems_fp8 + share * part.expert_elems_fp8)
    return f16, f8
