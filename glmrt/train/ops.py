"""The reference ops for training: whole sequences, no prefix, differentiable, batched.

`TrainingOps` runs glmrt's own model modules (glmrt/model/*) on a padded [B, T] batch laid out
flat as the modules expect ([B*T, ...]). Where the serving reference loops over requests and
reads and writes paged caches, these ops see every sequence from its first token and keep a
layer's intermediate results in a `LayerScratch` instead: the math is the reference's (same
formulas, same dtypes), batched, and every op has a backward. KDA runs fla-core's chunk_kda on
CUDA when it is installed, else the reference chunked delta rule with the batch folded into
the heads.

What training needs beyond the forward is recorded on the way:
  - per DSA layer with an indexer, the indexer's pool logits and the dense attention's mass per
    pool (no gradient): the KL objective that trains the indexer (top-k gives it none);
  - per MoE router, the experts each real token picked: the bias update that balances them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from backends.reference import ReferenceOps, column_planes, head_weights
from backends.reference_kda import kda_chunked

_FLOOR = -1e30


@dataclass
class DenseBatch:
    """The `meta` of a training forward: B sequences of T tokens each, from position 0."""
    batch: int
    length: int
    valid: torch.Tensor  # [B*T] bool, real (not padding) tokens


@dataclass
class LayerScratch:
    latent: torch.Tensor | None = None        # [B, T, R]
    pooled: torch.Tensor | None = None        # [B, P, di]
    index_logits: torch.Tensor | None = None  # [B, T, P], _FLOOR where a pool is not eligible


class TrainingCache:
    """Stands where the serving ModelCache does: one scratch per layer."""

    def __init__(self):
        self.layers: dict[int, LayerScratch] = {}

    def _get(self, layer: int) -> LayerScratch:
        return self.layers.setdefault(layer, LayerScratch())

    latent = pooled = conv = recurrent = _get

    def tail(self, layer: int):
        return self._get(layer), None


@dataclass
class IndexerTerm:
    logits: torch.Tensor   # [B, T, P] indexer scores (grad), _FLOOR where ineligible
    target: torch.Tensor   # [B, T, P] dense attention mass per pool, rows sum to 1 (no grad)
    rows: torch.Tensor     # [B, T] bool: queries with at least two eligible pools


@dataclass
class Records:
    indexer: list[IndexerTerm] = field(default_factory=list)
    routes: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (gate weight, picks [E])


class TrainingOps(ReferenceOps):
    name = "training"

    def __init__(self, *, use_fla: bool | None = None, kda_chunk: int = 32):
        self.records = Records()
        self.dense_attention = False  # attend to every earlier token (the indexer's warm-up)
        self.kda_chunk = kda_chunk
        self._use_fla = use_fla
        self._chunk_kda = None
        self._valid: torch.Tensor | None = None

    def reset(self) -> Records:
        done, self.records = self.records, Records()
        return done

    # ---- KDA ------------------------------------------------------------------------------
    def causal_conv(self, x, conv_state, weight, meta: DenseBatch, planes: int = 1):
        b, t = meta.batch, meta.length
        k = weight.shape[-1]
        xs = x.view(b, t, -1).transpose(1, 2).float()  # [B, C, T]
        y = F.conv1d(F.pad(xs, (k - 1, 0)), weight.float()[:, None, :], groups=weight.shape[0])
        y = F.silu(y).transpose(1, 2).reshape(x.shape).to(x.dtype)
        return column_planes(y, planes)

    def _fla(self, device: torch.device):
        if self._chunk_kda is None:
            want = device.type == "cuda" if self._use_fla is None else self._use_fla
            self._chunk_kda = False
            if want:
                try:
                    from fla.ops.kda import chunk_kda
                    self._chunk_kda = chunk_kda
                except ImportError:
                    if self._use_fla:
                        raise
        return self._chunk_kda

    def kda(self, q, k, v, g, beta, state, meta: DenseBatch, chunk_size: int = 64, *, gate_floor=None,
            slots_zeroed: bool = False):
        # gate_floor (ops.kda's hint that g >= it) is not used here: the reference form needs none,
        # and `--kda fla` keeps fla's general chunk path, whose backward is the one measured;
        # slots_zeroed neither: a training batch starts every sequence from zeros
        b, t = meta.batch, meta.length
        h, dk, dv = q.shape[1], q.shape[2], v.shape[2]
        qf, kf = q.float(), k.float()
        qf = qf / torch.sqrt((qf * qf).sum(-1, keepdim=True) + 1e-6)
        kf = kf / torch.sqrt((kf * kf).sum(-1, keepdim=True) + 1e-6)
        chunk_kda = self._fla(q.device)
        if chunk_kda:
            shape = (b, t, h)
            o, _ = chunk_kda(qf.view(*shape, dk), kf.view(*shape, dk), v.float().view(*shape, dv),
                             g.float().view(*shape, dk), beta.float().view(*shape), scale=dk ** -0.5,
                             output_final_state=False, use_qk_l2norm_in_kernel=False)
            return o.reshape(v.shape).to(v.dtype)

        def fold(x):  # [B*T, H, d] -> [T, B*H, d]: the batch as more heads
            return x.reshape(b, t, h, -1).transpose(0, 1).reshape(t, b * h, -1)

        s0 = torch.zeros(b * h, dk, dv, dtype=torch.float32, device=q.device)
        o, _ = kda_chunked(fold(qf * dk ** -0.5), fold(kf), fold(v.float()), fold(g.float()),
                           beta.float().reshape(b, t, h).transpose(0, 1).reshape(t, b * h), s0,
                           chunk_size=self.kda_chunk)
        return o.reshape(t, b, h, dv).transpose(0, 1).reshape(v.shape).to(v.dtype)

    # ---- DSA indexer ----------------------------------------------------------------------
    def indexer_update(self, k, g, ape, pooled: LayerScratch, tail_k, tail_g, meta: DenseBatch, kpool: int):
        b, t = meta.batch, meta.length
        p = t // kpool
        kk = k.view(b, t, -1)[:, : p * kpool].reshape(b, p, kpool, -1)
        logits = g.view(b, t, -1)[:, : p * kpool].reshape(b, p, kpool, -1).float() + ape.float()
        probs = torch.softmax(logits, dim=2).to(kk.dtype)
        pooled.pooled = (probs * kk).sum(dim=2)  # [B, P, di]

    def indexer_select(self, q, w, pooled: LayerScratch, meta: DenseBatch, kpool: int, topk_pools: int):
        b, t = meta.batch, meta.length
        keys = pooled.pooled.float()
        p = keys.shape[1]
        scale = q.shape[-1] ** -0.5
        qb = q.view(b, t, q.shape[1], -1).float()
        scores = torch.relu(torch.einsum("bthd,bpd->bthp", qb, keys) * scale)
        index = torch.einsum("bth,bthp->btp", head_weights(w, q.shape[1]).view(b, t, -1), scores)
        eligible = _eligible(t, p, kpool, q.device)  # [T, P]
        # NOTE: a finite floor, not -inf: a query with no eligible pool must not give NaN gradients
        index = index.masked_fill(~eligible, _FLOOR)
        pooled.index_logits = index
        sel = torch.full((b * t, topk_pools), -1, dtype=torch.long, device=q.device)
        k_take = min(topk_pools, p)
        if k_take == 0:
            return sel
        order = torch.sort(index.detach(), dim=-1, descending=True, stable=True).indices[..., :k_take]
        ok = torch.gather(eligible.expand(b, t, p), 2, order)
        sel[:, :k_take] = torch.where(ok, order, -1).reshape(b * t, k_take)
        return sel

    # ---- sparse MLA -----------------------------------------------------------------------
    def write_latent(self, latent, cache: LayerScratch, meta):
        cache.latent = latent

    def sparse_mla(self, q, cache: LayerScratch, w_kc, w_vc, sel, meta: DenseBatch, kpool: int, scale: float,
                   with_tail: bool = True):
        b, t = meta.batch, meta.length
        n, h, _ = q.shape
        c = cache.latent.view(b, t, -1).to(q.dtype)
        k = torch.einsum("btr,hdr->bhtd", c, w_kc.to(q.dtype))
        v = torch.einsum("btr,hvr->bhtv", c, w_vc.to(q.dtype))
        scores = torch.einsum("bshd,bhtd->bhst", q.view(b, t, h, -1), k).float() * scale
        pos = torch.arange(t, device=q.device)
        causal = pos[None, :] <= pos[:, None]  # [S, T]
        if cache.index_logits is not None:
            self._record_indexer(cache.index_logits, scores.detach(), causal, kpool, meta)
        if sel is None or self.dense_attention:
            mask = causal[None]
        else:
            mask = _selected_tokens(sel.view(b, t, -1), t, kpool, with_tail, causal)
        p = torch.softmax(scores.masked_fill(~mask[:, None], float("-inf")), dim=-1).to(q.dtype)
        return torch.einsum("bhst,bhtv->bshv", p, v).reshape(n, h, -1)

    def _record_indexer(self, logits, scores, causal, kpool: int, meta: DenseBatch) -> None:
        b, t = meta.batch, meta.length
        p = logits.shape[-1]
        with torch.no_grad():
            dense = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1).mean(dim=1)  # [B, S, T]
            mass = dense[..., : p * kpool].reshape(b, t, p, kpool).sum(-1)
            eligible = _eligible(t, p, kpool, logits.device)
            mass = mass.masked_fill(~eligible, 0.0)
            target = mass / mass.sum(-1, keepdim=True).clamp_min(1e-12)
            rows = (eligible.sum(-1) >= 2)[None] & meta.valid.view(b, t)
        self.records.indexer.append(IndexerTerm(logits, target, rows))

    # ---- MoE ------------------------------------------------------------------------------
    def moe_route(self, x, gate_w, bias, top_k, n_group, topk_group, norm_topk_prob, scaling, *,
                  append_expert=None):
        weights, ids = super().moe_route(x, gate_w, bias, top_k, n_group, topk_group, norm_topk_prob, scaling,
                                         append_expert=append_expert)
        self.records.routes.append((gate_w, expert_counts(ids.detach(), gate_w.shape[0], self._valid)))
        return weights, ids

    def moe_experts(self, x, ids, weights, w_gate, w_up, w_down, limit, scales=None, block=(128, 128), *,
                    defer_sum=False):
        """Every expert on every token, combined with the routing weights (zero off the top-k):
        E/k times the top-k FLOPs, but no per-expert gathers or host syncs, and deterministic."""
        if scales is not None:
            raise ValueError("training runs on unquantised weights")
        dt = x.dtype
        gate = torch.einsum("nd,eid->nei", x, w_gate.to(dt))
        up = torch.einsum("nd,eid->nei", x, w_up.to(dt))
        y = torch.einsum("nei,edi->ned", self.swiglu(gate, up, limit), w_down.to(dt))
        dense_w = torch.zeros(x.shape[0], w_gate.shape[0], dtype=weights.dtype, device=x.device)
        dense_w = dense_w.scatter_add(1, ids, weights)
        return torch.einsum("ned,ne->nd", y.float(), dense_w).to(dt)

    def set_valid(self, valid: torch.Tensor | None) -> None:
        self._valid = valid


def expert_counts(ids: torch.Tensor, num_experts: int, valid: torch.Tensor | None) -> torch.Tensor:
    """[E] float: how often each expert was picked by the real tokens (a scatter, not bincount
    or boolean indexing: neither waits for the GPU)."""
    w = torch.ones(ids.shape, dtype=torch.float32, device=ids.device)
    if valid is not None:
        w = w * valid[:, None].float()
    counts = torch.zeros(num_experts + 1, dtype=torch.float32, device=ids.device)  # +1: an appended shared id
    return counts.scatter_add_(0, ids.reshape(-1).clamp(max=num_experts), w.reshape(-1))[:num_experts]


def _eligible(t: int, p: int, kpool: int, device) -> torch.Tensor:
    """[T, P]: pool p is complete and ends at or before query t (the reference's rule)."""
    pos = torch.arange(t, device=device)
    return torch.arange(p, device=device)[None, :] < ((pos + 1) // kpool)[:, None]


def _selected_tokens(sel, t: int, kpool: int, with_tail: bool, causal) -> torch.Tensor:
    """[B, S, T] bool: the selected pools' tokens (and the query's incomplete pool), causal."""
    b = sel.shape[0]
    n_slots = t // kpool + 1
    valid = sel >= 0
    chosen = torch.zeros(b, t, n_slots + 1, dtype=torch.bool, device=sel.device)
    chosen.scatter_(2, torch.where(valid, sel, n_slots), valid)
    pool_of = torch.arange(t, device=sel.device) // kpool
    mask = chosen[:, :, pool_of] & causal[None]
    if with_tail:
        pos = torch.arange(t, device=sel.device)
        tail_start = ((pos + 1) // kpool) * kpool
        mask |= ((pos[None, :] >= tail_start[:, None]) & causal)[None]
    return mask


def indexer_kl(terms: list[IndexerTerm]) -> torch.Tensor | None:
    """Mean KL(dense attention mass || indexer distribution) over the recorded layers' queries."""
    losses = []
    for term in terms:
        logp = torch.log_softmax(term.logits.float(), dim=-1)
        tgt = term.target
        kl = torch.where(tgt > 0, tgt * (torch.log(tgt.clamp_min(1e-12)) - logp), 0.0).sum(-1)
        rows = term.rows.float()  # a masked mean: no host sync on how many rows there are
        losses.append((kl * rows).sum() / rows.sum().clamp_min(1.0))
    return torch.stack(losses).mean() if losses else None
