"""The reference kernel set: plain torch, float32- and bfloat16-capable, CPU or GPU.

It is the numerical oracle for every fast kernel, so it favours the obvious formulation
over speed: per-request loops over the batch, dense masked attention over the gathered
latent of one request, a per-expert loop in the MoE. Short runs of requests with history
(decode tokens, speculative verify runs) go through the attention, KDA and convolution ops
together, token by token with the same formulas (backends/reference_decode.py): the loop
cost a CPU decode step most of its time. Dtype handling follows the HF
reference (docs/MODEL.md §2-5) so that fp32 results agree with it to ~1e-6.

Cache tensors (one layer's view of the pools, docs/MODEL.md §8):
  latent  [num_pages, page_size, kv_lora_rank]        MLA latent per token
  pooled  [num_pages, page_size // kpool, index_dim]  one pooled indexer key per complete k-pool
  tail_k / tail_g [num_slots, kpool, index_dim]       raw keys/gates of the incomplete pool
  conv    [num_slots, K-1, conv_dim]                  last K-1 pre-conv q/k/v inputs
  state   [num_slots, H, dk, dv]                      KDA recurrent state (fp32 or bf16)
A request whose prefix_len is 0 ignores whatever its slot holds (slots are not zeroed).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import kv_fp8
from . import reference_decode as decode
from .fp8_numerics import dequantize_block_fp8, w8a8_applies, w8a8_product
from .meta import BatchMeta
from .reference_kda import kda_chunked, kda_recurrent
from .side_work import INLINE


class MoEPartials(NamedTuple):
    """An MoE output whose top-k sum is left to its consumer (ops.mhc_post sums it on the way in,
    saving the MoE's sum launch and the [N, D] round trip). y [N, k, D]: row (t, j) is pair
    (t, j)'s weighted expert output, in the model dtype; rows of pairs outside [0, num_experts)
    are undefined and count as zero."""
    y: torch.Tensor
    ids: torch.Tensor
    num_experts: int

    def reduce(self) -> torch.Tensor:
        """Σ_j y[:, j] in fp32, in j order, one rounding to the model dtype: the fused MoE's own
        sum, bit for bit."""
        routed = ((self.ids >= 0) & (self.ids < self.num_experts))[..., None]
        acc = torch.zeros(self.y.shape[0], self.y.shape[2], dtype=torch.float32, device=self.y.device)
        for j in range(self.y.shape[1]):
            acc += torch.where(routed[:, j], self.y[:, j].float(), 0.0)
        return acc.to(self.y.dtype)


def head_weights(w: torch.Tensor, index_heads: int) -> torch.Tensor:
    """The indexer's per-head weights of the pool score: the projection's output in fp32 times
    Hi^-0.5 (one fp32 rounding, as the reference model computes them)."""
    return w.float() * index_heads ** -0.5



def prefill_runs(meta: BatchMeta, done: set[int]):
    """(r, s0, s1) of each request not in `done` (the requests an op took as short runs)."""
    for r, (s0, s1) in enumerate(zip(meta.cu_seqlens[:-1], meta.cu_seqlens[1:])):
        if r not in done:
            yield r, s0, s1


def column_planes(x: torch.Tensor, planes: int) -> torch.Tensor:
    """x [N, C] as [planes, N, C/planes], each column group contiguous (planes 1: x itself)."""
    return x if planes == 1 else x.view(x.shape[0], planes, x.shape[1] // planes).transpose(0, 1).contiguous()

class ReferenceOps:
    """Every op the GLM-5.3-Flash model needs, in plain torch."""

    name = "reference"
    # fp8 (block-scaled) weights: "none" multiplies the 16-bit activations by the dequantised
    # weights (w8a16, as transformers does on the CPU); "dynamic" quantises the activations too,
    # per token and K scale block (w8a8, act_quant_e4m3), and multiplies in fp32: the numerics of
    # the fp8 tensor-core path (CudaH200Ops's default, SGLang's and DeepSeek-V3's recipe).
    fp8_activations = "none"
    # "dynamic" applies to calls of up to this many tokens; None: every size, prefill chunks too
    # (a 16K-token flash-4l prefill with fp8 weights on an H100: 112 ms w8a8, 209 ms with w8a16
    # prefill calls, bench/RESULTS.md). A number keeps larger calls w8a16.
    fp8_act_max_tokens: int | None = None

    def uses_w8a8(self, x: torch.Tensor, weight: torch.Tensor, block: tuple[int, int]) -> bool:
        """Whether this fp8 product quantises its activations (the kernels follow the same rule)."""
        return w8a8_applies(self.fp8_activations, x, weight, block, self.fp8_act_max_tokens)

    def apply_token_bitmask(self, logits: torch.Tensor, bits: torch.Tensor, rows: torch.Tensor) -> None:
        """Structured output: logits[rows[i], t] = -inf wherever bit t of bits[i] is 0, in place
        (int32 words, bit t % 32 of word t // 32; xgrammar's bitmask layout)."""
        if rows.numel() == 0:
            return
        vocab = logits.shape[1]
        shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
        allowed = ((bits[:, :, None] >> shifts) & 1).flatten(1)[:, :vocab].bool()
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))

    def begin_forward(self, num_tokens: int) -> None:
        """Called once per model (or MTP draft) forward with its token count, before any op: a
        kernel set may pick launch modes by batch size here (cuda-h200: PDL for small batches)."""

    def fork(self, x: torch.Tensor):
        """Side work beside the work queued after it, for the layer whose input is x
        (backends/side_work.py): here it runs in place."""
        return INLINE

    # ---- dense building blocks ------------------------------------------------------------
    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               scale_inv: torch.Tensor | None = None, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
        if scale_inv is not None and self.uses_w8a8(x, weight, block):
            y = w8a8_product(x, weight, scale_inv, block)
            if bias is not None:
                y = y + bias.to(x.dtype).float()
            return y.to(x.dtype)
        if scale_inv is not None:
            weight = dequantize_block_fp8(weight, scale_inv, block, x.dtype)
        elif weight.dtype != x.dtype:
            weight = weight.to(x.dtype)
        return F.linear(x, weight, None if bias is None else bias.to(x.dtype))

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # NOTE: normalise in fp32, cast back, *then* scale in the input dtype (HF order).
        x32 = x.float()
        y = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        return weight.to(x.dtype) * y

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """A residual add and the next norm (the draft layer's block): (x + residual, rms_norm of it)."""
        s = x + residual
        return s, self.rms_norm(s, weight, eps)

    def rms_norm_pair(self, a: torch.Tensor, wa: torch.Tensor, b: torch.Tensor, wb: torch.Tensor,
                      eps: float) -> torch.Tensor:
        """[rms_norm(a, wa); rms_norm(b, wb)] joined on the last dim (the draft layer's input)."""
        return torch.cat([self.rms_norm(a, wa, eps), self.rms_norm(b, wb, eps)], dim=-1)

    def stream_mean_rms_norm(self, streams: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """rms_norm of the mean of the mHC streams [N, M, D] (the model's final norm): [N, D]."""
        return self.rms_norm(streams.mean(dim=1), weight, eps)

    def kda_gate(self, f: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor, lower_bound: float | None,
                 num_heads: int) -> torch.Tensor:
        """KDA's per head and channel log-decay g (< 0), fp32 [N, H, d], from the forget-gate
        projection f [N, H*d]: with a lower bound lb·sigmoid(exp(A_log)·(f + dt_bias)), else
        -exp(A_log)·softplus(f + dt_bias)."""
        f = f.float() + dt_bias.float()
        f = f.view(f.shape[0], num_heads, f.shape[-1] // num_heads)
        rate = a_log.float().exp()[:, None]
        if lower_bound is not None:
            return lower_bound * torch.sigmoid(rate * f)
        return -rate * torch.where(f > 20.0, f, F.softplus(f))

    def gated_rms_norm(self, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
        return (y * torch.sigmoid(gate.float())).to(x.dtype)

    def layer_norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), weight.to(x.dtype), bias.to(x.dtype), eps)

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
        if limit is not None:
            gate = gate.clamp(max=limit)
            up = up.clamp(-limit, limit)
        return F.silu(gate) * up

    # ---- mHC ------------------------------------------------------------------------------
    def mhc_pre(self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                sinkhorn_iters: int, hc_eps: float, norm_eps: float,
                norm: tuple[torch.Tensor, float] | None = None):
        """streams [N, M, D] -> (post [N, M] f32, comb [N, M, M] f32, collapsed [N, D] model dtype).
        `norm` = (weight, eps): the collapse passed through rms_norm (the sublayer's input norm),
        which a backend may fuse into the collapse."""
        m = streams.shape[1]
        flat = streams.flatten(1).float()
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
        z = F.linear(flat, fn.float())
        z_pre, z_post, z_comb = z.split([m, m, m * m], dim=-1)
        b_pre, b_post, b_comb = base.float().split([m, m, m * m])
        s = scale.float()
        pre = torch.sigmoid(z_pre * s[0] + b_pre) + hc_eps
        post = 2 * torch.sigmoid(z_post * s[1] + b_post)
        comb = torch.softmax(z_comb.view(-1, m, m) * s[2] + b_comb.view(m, m), dim=-1) + hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
        for _ in range(sinkhorn_iters - 1):  # in place: the same roundings, a one-token call 26% faster on the CPU
            comb.div_(comb.sum(dim=-1, keepdim=True).add_(hc_eps))
            comb.div_(comb.sum(dim=-2, keepdim=True).add_(hc_eps))
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        if norm is not None:
            collapsed = self.rms_norm(collapsed, norm[0], norm[1])
        return post, comb, collapsed

    def mhc_post(self, y: torch.Tensor | MoEPartials, streams: torch.Tensor, post: torch.Tensor,
                 comb: torch.Tensor) -> torch.Tensor:
        """X'[j] = post[j] * y + sum_i comb[i, j] X[i], in the model dtype (as HF does)."""
        if isinstance(y, MoEPartials):
            y = y.reduce()
        dt = streams.dtype
        return post.to(dt).unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.to(dt).transpose(-1, -2), streams)

    # ---- MoE ------------------------------------------------------------------------------
    def moe_route(self, x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int,
                  topk_group: int, norm_topk_prob: bool, scaling: float, *, append_expert: int | None = None):
        """Sigmoid router with correction bias and group limit -> (weights [N,k] f32, ids [N,k]).
        `append_expert`: a (k+1)-th column of that id with weight 1 for every token (a shared
        expert seated among the routed ones, glmrt.model.moe.SharedExpertSlot)."""
        scores = F.linear(x.float(), gate_w.float()).sigmoid()
        choice = scores + bias.float()
        n, e = choice.shape
        if n_group > 1:
            group_scores = choice.view(n, n_group, e // n_group).topk(2, dim=-1).values.sum(-1)
            keep = group_scores.topk(topk_group, dim=-1).indices
            gmask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            choice = choice.masked_fill(~gmask.repeat_interleave(e // n_group, dim=1), float("-inf"))
        ids = choice.topk(top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        weights = weights * scaling
        if append_expert is not None:
            ids = torch.cat([ids, torch.full_like(ids[:, :1], append_expert)], dim=1)
            weights = torch.cat([weights, torch.ones_like(weights[:, :1])], dim=1)
        return weights, ids

    def moe_experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w_gate: torch.Tensor,
                    w_up: torch.Tensor, w_down: torch.Tensor, limit: float | None,
                    scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                    block: tuple[int, int] = (128, 128), *, defer_sum: bool = False) -> torch.Tensor:
        """Routed experts: sum_k weights[:, k] * expert_{ids[:, k]}(x). Stacked [E, out, in] weights;
        picks of ids outside [0, E) (another rank's experts under expert parallelism) add nothing.
        `defer_sum`: the caller also takes MoEPartials (its consumer is mhc_post); the reference
        sums here anyway."""
        out = torch.zeros_like(x)
        w8a8 = scales is not None and self.uses_w8a8(x, w_gate, block)
        stacked = (w_gate, w_up, w_down)

        def proj(a, p, e):  # expert e's projection p (gate, up, down), in the model dtype
            w = stacked[p][e]
            if w8a8:  # the fp32 product, rounded where the w8a16 products round
                return w8a8_product(a, w, scales[p][e], block).to(x.dtype)
            if scales is not None:
                return F.linear(a, dequantize_block_fp8(w, scales[p][e], block, x.dtype))
            return F.linear(a, w.to(x.dtype))

        for e in torch.unique(ids.flatten()).tolist():
            if not 0 <= e < w_gate.shape[0]:  # another rank's expert (expert parallelism): dropped
                continue
            tok, kpos = torch.nonzero(ids == e, as_tuple=True)
            xe = x[tok]
            h = self.swiglu(proj(xe, 0, e), proj(xe, 1, e), limit)
            ye = proj(h, 2, e) * weights[tok, kpos, None]
            out.index_add_(0, tok, ye.to(out.dtype))
        return out

    # ---- KDA ------------------------------------------------------------------------------
    def causal_conv(self, x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                    meta: BatchMeta, planes: int = 1) -> torch.Tensor:
        """Depthwise causal conv + SiLU per request, reading/writing the conv state in place.

        x [N, C] pre-conv inputs, weight [C, K] (fp32), conv_state [slots, K-1, C]. Returns [N, C],
        or with `planes` P > 1 [P, N, C/P]: the P column groups (the KDA layer's q, k, v) each
        contiguous, so the recurrence reads them as dense [N, H, d] tensors without copies.
        """
        k = weight.shape[-1]
        out = torch.empty_like(x)
        w = weight.float().t().flip(0)  # [K, C]; row j multiplies the input j steps back
        rows = decode.short_runs(meta, x.device)
        if rows:
            decode.causal_conv(x, out, conv_state, w, rows)
        for r, s0, s1 in prefill_runs(meta, rows.reqs):
            slot = int(meta.slot_ids[r])
            hist = conv_state[slot].float() if meta.prefix_lens[r] > 0 else x.new_zeros(k - 1, x.shape[1], dtype=torch.float32)
            seq = torch.cat([hist, x[s0:s1].float()], dim=0)  # [K-1+S, C]
            n = s1 - s0
            acc = torch.zeros(n, x.shape[1], dtype=torch.float32, device=x.device)
            for j in range(k):
                acc += w[j] * seq[k - 1 - j: k - 1 - j + n]
            out[s0:s1] = F.silu(acc).to(x.dtype)
            if k > 1:
                conv_state[slot] = seq[-(k - 1):].to(conv_state.dtype)
        return column_planes(out, planes)

    def zero_fresh_slots(self, state: torch.Tensor, meta: BatchMeta) -> bool:
        """Zero the state slots of the batch's requests that start here (prefix_len 0) ahead of
        kda / kda_gated, whose kernels may then read every slot as it is (the caller passes their
        slots_zeroed): True where done. A layer runs it beside its conv. The reference's kda never
        reads those slots: nothing to do here."""
        return False

    def kda_gated(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, dt_bias: torch.Tensor,
                  a_log: torch.Tensor, lower_bound: float | None, beta: torch.Tensor, state: torch.Tensor,
                  meta: BatchMeta, *, slots_zeroed: bool = False) -> torch.Tensor:
        """kda with its forget gate from the gate projection's output f [N, H·dk] (kda_gate's inputs):
        one op, so that a kernel set may compute the gate inside its prefill kernels. Here: kda_gate,
        then kda with the bound as its gate_floor. slots_zeroed: zero_fresh_slots returned True."""
        g = self.kda_gate(f, dt_bias, a_log, lower_bound, q.shape[1])
        return self.kda(q, k, v, g, beta, state, meta, gate_floor=lower_bound, slots_zeroed=slots_zeroed)

    def kda(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor, meta: BatchMeta, chunk_size: int = 64, *,
            gate_floor: float | None = None, slots_zeroed: bool = False) -> torch.Tensor:
        """Kimi delta attention per request; q/k are l2-normalised and q scaled here (in fp32).

        q, k [N, H, dk]; v [N, H, dv]; g [N, H, dk] log-decay; beta [N, H]; state [slots, H, dk, dv].
        Single-token requests with history take the recurrent step, others the chunked form.
        gate_floor: a bound the caller guarantees, g >= gate_floor (the model's lower-bounded
        gate); kernels may take a faster prefill path on it, the result is the same math.
        slots_zeroed: zero_fresh_slots did this batch's new slots (kernels need not again).
        """
        dk = q.shape[-1]
        qf = q.float()
        kf = k.float()
        qf = qf / torch.sqrt((qf * qf).sum(-1, keepdim=True) + 1e-6) * dk ** -0.5
        kf = kf / torch.sqrt((kf * kf).sum(-1, keepdim=True) + 1e-6)
        vf, gf, bf = v.float(), g.float(), beta.float()
        out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
        rows = decode.short_runs(meta, q.device)
        if rows:
            decode.kda_steps(qf, kf, vf, gf, bf, out, state, rows)
        for r, s0, s1 in prefill_runs(meta, rows.reqs):
            if s1 == s0:
                continue
            slot = int(meta.slot_ids[r])
            s = state[slot].float() if meta.prefix_lens[r] > 0 else \
                torch.zeros(state.shape[1:], dtype=torch.float32, device=v.device)
            args = (qf[s0:s1], kf[s0:s1], vf[s0:s1], gf[s0:s1], bf[s0:s1], s)
            if s1 - s0 == 1 and meta.prefix_lens[r] > 0:
                o, s = kda_recurrent(*args)
            else:
                o, s = kda_chunked(*args, chunk_size=chunk_size)
            out[s0:s1] = o
            state[slot] = s.to(state.dtype)
        return out.to(v.dtype)

    # ---- state pool -----------------------------------------------------------------------
    def copy_slots(self, tensors: tuple[torch.Tensor, ...], src: torch.Tensor, dst: torch.Tensor,
                   into: tuple[torch.Tensor, ...] | None = None) -> None:
        """For each state-pool tensor t [L, slots, ...]: t[:, dst] = t[:, src] (or, with `into`, the
        matching tensor of `into` takes them), the slot ids on the device (graph-safe: no host
        values). Within one tensor no dst may be another pair's src."""
        for t, o in zip(tensors, into or tensors):
            o[:, dst] = t[:, src]

    def gather_rows(self, tensors: list[torch.Tensor], sel: torch.Tensor) -> list[torch.Tensor]:
        """[t[sel] for t in tensors]: new tensors (a speculative rollback's kept rows of the verify's
        op inputs)."""
        return [t[sel] for t in tensors]

    # ---- DSA indexer ----------------------------------------------------------------------
    def indexer_update(self, k: torch.Tensor, g: torch.Tensor, ape: torch.Tensor, pooled: torch.Tensor,
                       tail_k: torch.Tensor, tail_g: torch.Tensor, meta: BatchMeta, kpool: int) -> None:
        """Compute the pooled key of every pool completed by this batch (once) and keep the tail."""
        pools_per_page = meta.page_size // kpool
        ape32 = ape.float()
        rows = decode.short_runs(meta, k.device)
        if rows.decode_reqs:
            decode.indexer_update(k, g, ape32, pooled, tail_k, tail_g, kpool, rows)
        for r, s0, s1 in prefill_runs(meta, rows.decode_reqs):
            p0 = meta.prefix_lens[r]
            slot = meta.slot_ids[r:r + 1]  # a 1-element index: int() / a 0-dim index would wait for the GPU
            t0 = p0 % kpool
            base = p0 - t0
            ks = torch.cat([tail_k[slot, :t0][0].to(k.dtype), k[s0:s1]], dim=0)
            gs = torch.cat([tail_g[slot, :t0][0].to(g.dtype), g[s0:s1]], dim=0)
            n_done = ks.shape[0] // kpool
            if n_done:
                kk = ks[: n_done * kpool].view(n_done, kpool, -1)
                logits = gs[: n_done * kpool].view(n_done, kpool, -1).float() + ape32
                probs = torch.softmax(logits, dim=1).to(kk.dtype)
                keys = (probs * kk).sum(dim=1)  # [n_done, di], model dtype like HF
                pool_ids = torch.arange(base // kpool, base // kpool + n_done, device=k.device)
                pages = meta.page_table[r, pool_ids // pools_per_page]
                pooled[pages, pool_ids % pools_per_page] = keys.to(pooled.dtype)
            rest = ks.shape[0] - n_done * kpool
            if rest:
                tail_k[slot, :rest] = ks[None, n_done * kpool:].to(tail_k.dtype)
                tail_g[slot, :rest] = gs[None, n_done * kpool:].to(tail_g.dtype)

    def indexer_select(self, q: torch.Tensor, w: torch.Tensor, pooled: torch.Tensor, meta: BatchMeta,
                       kpool: int, topk_pools: int) -> torch.Tensor:
        """Top pools per query -> [N, topk_pools] pool indices (-1 = none), ties to the lower index.

        q [N, Hi, di]; w [N, Hi] head weights as the weights projection gives them (any float
        dtype; scaled here by Hi^-0.5 in fp32, only when pools are scored). A pool is eligible
        for the query at position t iff it is complete and its last token is <= t.
        """
        n = q.shape[0]
        sel = torch.full((n, topk_pools), -1, dtype=torch.long, device=q.device)
        pools_per_page = meta.page_size // kpool
        scale = q.shape[-1] ** -0.5
        rows = decode.short_runs(meta, q.device)
        if rows:
            decode.indexer_select(q, head_weights(w, q.shape[1]), pooled, sel, kpool, topk_pools, rows)
        for r, s0, s1 in prefill_runs(meta, rows.reqs):
            if s1 == s0:
                continue
            n_pools = (meta.prefix_lens[r] + s1 - s0) // kpool
            if n_pools == 0:
                continue
            pos = meta.positions[s0:s1]
            visible = (pos + 1) // kpool  # number of eligible pools per query
            pool_ids = torch.arange(n_pools, device=q.device)
            eligible = pool_ids[None, :] < visible[:, None]
            k_take = min(topk_pools, n_pools)
            if n_pools <= topk_pools:  # every eligible pool wins: no scoring needed
                sel[s0:s1, :n_pools] = torch.where(eligible, pool_ids[None, :], -1)
                continue
            keys = pooled[meta.page_table[r, pool_ids // pools_per_page], pool_ids % pools_per_page].float()
            scores = torch.relu(torch.einsum("shd,pd->shp", q[s0:s1].float(), keys) * scale)
            index = torch.einsum("sh,shp->sp", head_weights(w[s0:s1], q.shape[1]), scores)
            index = index.masked_fill(~eligible, float("-inf"))
            order = torch.sort(index, dim=-1, descending=True, stable=True).indices[:, :k_take]
            ok = torch.gather(eligible, 1, order)
            sel[s0:s1, :k_take] = torch.where(ok, order, -1)
        return sel

    # ---- sparse MLA -----------------------------------------------------------------------
    def write_latent(self, latent: torch.Tensor, cache: torch.Tensor, meta: BatchMeta) -> None:
        if kv_fp8.is_fp8_rows(cache, latent.shape[-1]):
            latent = kv_fp8.quantize_rows(latent)
        cache.view(-1, cache.shape[-1])[meta.out_loc] = latent.to(cache.dtype)

    def sparse_mla(self, q: torch.Tensor, cache: torch.Tensor, w_kc: torch.Tensor, w_vc: torch.Tensor,
                   sel: torch.Tensor | None, meta: BatchMeta, kpool: int, scale: float,
                   with_tail: bool = True) -> torch.Tensor:
        """Attention of each query over its selected tokens of the cached latent.

        q [N, H, dn]; w_kc [H, dn, R]; w_vc [H, dv, R]; sel [N, K] selected pools (None = dense
        causal). The token set of query t is the selected pools expanded to their tokens plus
        the tail of its incomplete pool. Decode (one query per request) uses the absorbed form
        (scores against the latent directly); longer runs expand K/V per head once per request.
        """
        n, h, _ = q.shape
        dv = w_vc.shape[1]
        out = torch.empty(n, h, dv, dtype=q.dtype, device=q.device)
        flat = cache.view(-1, cache.shape[-1])
        rows = decode.short_runs(meta, q.device)
        if rows:
            decode.sparse_mla(q, cache, w_kc, w_vc, sel, out, kpool, scale, with_tail, rows)
        for r, s0, s1 in prefill_runs(meta, rows.reqs):
            if s1 == s0:
                continue
            total = meta.prefix_lens[r] + s1 - s0
            pages = meta.page_table[r, : -(-total // meta.page_size)]
            locs = (pages[:, None] * meta.page_size + torch.arange(meta.page_size, device=q.device)).flatten()[:total]
            c = flat[locs]  # [T, R]
            c = kv_fp8.dequantize_rows(c, w_kc.shape[-1], q.dtype) if c.dtype == torch.uint8 else c.to(q.dtype)
            mask = self._token_mask(sel[s0:s1] if sel is not None else None, meta.positions[s0:s1], total, kpool,
                                    with_tail)
            qr = q[s0:s1]
            if s1 - s0 == 1:
                q_abs = torch.einsum("shd,hdr->hsr", qr, w_kc.to(q.dtype))
                scores = torch.einsum("hsr,tr->hst", q_abs, c) * scale
                p = self._masked_softmax(scores, mask).to(q.dtype)
                o_lat = torch.einsum("hst,tr->hsr", p, c)
                out[s0:s1] = torch.einsum("hsr,hvr->shv", o_lat, w_vc.to(q.dtype))
            else:
                k = torch.einsum("tr,hdr->htd", c, w_kc.to(q.dtype))
                v = torch.einsum("tr,hvr->htv", c, w_vc.to(q.dtype))
                scores = torch.einsum("shd,htd->hst", qr, k) * scale
                p = self._masked_softmax(scores, mask).to(q.dtype)
                out[s0:s1] = torch.einsum("hst,htv->shv", p, v)
        return out

    @staticmethod
    def _masked_softmax(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = scores.float().masked_fill(~mask[None], float("-inf"))
        return torch.softmax(scores, dim=-1)

    # [S, T] bool: the tokens each query sees (selected pools + its incomplete pool's tail)
    _token_mask = staticmethod(decode.token_mask)
