"""The `cuda-h200` kernel set: ReferenceOps with Triton kernels on the decode hot path.

Importing this module registers the backend (`registry.register("cuda-h200", CudaH200Ops)`);
`backends.registry` imports it lazily, only when resolving a name on SM90 hardware, so the
registry itself never imports Triton. If Triton is missing the import fails with ImportError
and the registry keeps the reference. Triton itself is imported on the first kernel call.

Overridden today (everything else is the reference):
  indexer_select  decode batches; prefill / mixed with prefill_kernels (default; one row per token):
                  Triton scores + tie-broken top-k
  indexer_update  decode batches: tail append / pooled key of a completed pool, one launch; batches
                  of short rows (speculative decoding's verify and rollback): one launch per token;
                  any other batch (prefill, decodes beside prefill chunks): two launches, pools then tails
  sparse_mla      decode batches, and with prefill_kernels prefill / mixed batches with a
                  selection (16-bit, or interpreted): Triton absorbed-MLA over the selected latent rows, one row
                  per query token (dense causal / fp32-on-GPU prefill: the reference)
  linear          FP8 weights every batch (w8a8 by default: fp8_activations; from 1024 rows on cuBLASLt's
                  block-scaled fp8 GEMM where torch has it); 16-bit weights up to 8 rows (decode) by skinny_linear
  rms_norm        every shape: one-pass Triton RMSNorm (HF cast order)
  add_rms_norm,   the draft layer's residual add with the next norm, and its two input norms
  rms_norm_pair   joined: one launch each
  stream_mean_rms_norm  the final norm of the mHC streams' mean: one launch
  swiglu          with fused_small_ops, every batch: the dense MLP's clamps, silu and product in one launch
  kda_gate        with fused_small_ops (default on), every batch: KDA's forget gate (bias, exp(A_log), sigmoid or softplus) in one
                  launch (decode batches compute it inside the recurrence instead: kda_gated)
  gated_rms_norm  with fused_small_ops, rows up to 1024: the KDA output norm x·rsqrt·w·sigmoid(gate) in one launch
  moe_route       with fused_small_ops (group-limited too): router logits (one launch, tiled over experts) + top-k selection
                  (+ the shared expert's column when it is seated among the routed experts)
  mhc_pre         every batch: fused RMS + mixing matmul + gates + Sinkhorn + collapse (bf16x3 products
                  from 1024 tokens); at decode sizes the sublayer's input RMSNorm inside the collapse
  mhc_post        every batch: fused post·y + Cᵀ·X in the model dtype; takes the MoE's unsummed
                  rows (MoEPartials) and does its top-k sum on the way in
  moe_experts     every batch: the fused MoE (fused_moe); defer_sum leaves the sum to mhc_post.
                  16-bit weights from GROUPED_MIN_TOKENS tokens: grouped GEMMs (grouped_moe), summed
  causal_conv     every batch: KDA conv + SiLU, conv state read/written in place (graph-safe decode)
  copy_slots      the state-pool slot copies of speculative decoding (snapshot, rollback): one launch
  gather_rows     the rollback's gather of the verify's kept rows: one launch per 8 tensors
  kda             every batch, with fla-core: fused_recurrent in place (decode; our launch shape,
                  kda.DECODE_LAUNCHES; and batches of short rows, speculative decoding's verify and
                  rollback), chunk_kda (prefill; its bounded-gate path where the model's gate has a lower
                  bound in [-5, 0), ops.kda's gate_floor)
  zero_fresh_slots  decode and short-row batches: the new requests' recurrent-state slots zeroed in one
                  launch, which the layer runs beside its conv (kda / kda_gated then skip theirs)
  kda_gated       batches of multi-token requests only, with a gate bound in [-5, 0): chunk_kda with the
                  forget gate computed in its cumsum kernel (no kda_gate launch, no fp32 gate tensor);
                  with fused_small_ops, batches of one-token or short rows: fla's recurrent kernel computes the gate
Kernels run on CUDA tensors, or on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1,
the tests); anything else takes the reference path.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from .meta import BatchMeta
from .reference import MoEPartials, ReferenceOps
from .registry import register
from .side_work import side_stream

try:
    _HAVE_TRITON = importlib.util.find_spec("triton") is not None
except ValueError:  # triton blocked in sys.modules
    _HAVE_TRITON = False
if not _HAVE_TRITON:
    raise ImportError("the cuda-h200 backend needs Triton (pip install triton)")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _device_ok(t: torch.Tensor) -> bool:
    return t.is_cuda or _interpreting()


def _kernel_ok(t: torch.Tensor, meta: BatchMeta) -> bool:
    """A kernel device and a decode batch (one new token per request)."""
    if not _device_ok(t):
        return False
    return meta.num_reqs > 0 and all(s == 1 for s in meta.seq_lens)


class CudaH200Ops(ReferenceOps):
    """ReferenceOps with the decode-path DSA indexer and sparse MLA on Triton kernels."""

    name = "cuda-h200"
    # Prefill / mixed batches on the per-token indexer + sparse-MLA kernels (the default since
    # their H200 validation, bench/RESULTS.md); --dsa-prefill-backend torch turns them off.
    prefill_kernels = True
    # The router, KDA forget-gate and gated-norm kernels (each replaces 6-10 small launches).
    # Their tests passed compiled on the H200 and the decode step got faster at every batch
    # (bench.decode_profile --fused-small-ops off,on), so they are on; False gives the torch compositions.
    fused_small_ops = True
    # The shared expert runs inside the fused MoE as expert E, the router's (k+1)-th pick
    # (glmrt.model.moe.SharedExpertSlot): at decode, two GEMVs and four small launches fewer
    # per MoE layer.
    fuse_shared_experts = True
    # 16-bit linears of up to fp8_linear.SKINNY_MAX_ROWS rows (decode) on the Triton weight-
    # streaming kernel instead of cuBLAS's GEMVs: "measured" = at the shapes where it measured
    # faster (fp8_linear.skinny_preferred), "all", or "off" (bench.decode_profile --skinny).
    skinny_linear = "measured"
    # FP8 weights: activations quantised too (w8a8, fp8 tensor-core products; ReferenceOps has the
    # same numerics under "dynamic"), in calls of any size (fp8_act_max_tokens, inherited: None).
    # H200, flash-4l decode step at batch 64: 7.37 ms w8a16 -> 5.94 ms; H100, 16K-token prefill:
    # 209 ms -> 112 ms (bench/RESULTS.md). `--fp8-activations none` keeps w8a16 everywhere.
    fp8_activations = "dynamic"
    # 16-bit experts from this many tokens on grouped GEMMs (kernels/grouped_moe.py: torch's
    # CUTLASS grouped GEMM over the pairs sorted by expert) instead of fused_moe's Triton GEMMs;
    # None keeps fused_moe at every size. H100, one MoE layer: 13.9-14.3 ms against 14.8-15.1 at
    # 16384 tokens (the 16K forward ~2% faster), a tie at 12288, slower from 8192 down (9.1 against
    # 8.9; 7.7 against 6.7 at 4096) (bench/RESULTS.md).
    GROUPED_MIN_TOKENS: int | None = 16384

    # Forwards of up to this many tokens run a layer's independent chains of small launches on two
    # CUDA streams (ops.fork, backends/side_work.py: the DSA indexer's keys beside the queries,
    # KDA's gate inputs beside the conv and its output gate beside the recurrence); 0: one stream.
    SIDE_STREAM_MAX_TOKENS = 16

    def fork(self, x: torch.Tensor):
        if not x.is_cuda or _interpreting() or x.shape[0] > self.SIDE_STREAM_MAX_TOKENS:
            return super().fork(x)
        return side_stream(x.device.index if x.device.index is not None else torch.cuda.current_device())

    def begin_forward(self, num_tokens: int) -> None:
        # PDL for the step's Triton kernels at batch 1 only (backends/kernels/pdl.py)
        if not _interpreting():
            from .kernels import pdl
            pdl.set_tokens(num_tokens)

    def apply_token_bitmask(self, logits: torch.Tensor, bits: torch.Tensor, rows: torch.Tensor) -> None:
        if not (_HAVE_TRITON and _device_ok(logits)) or logits.stride(1) != 1:
            return super().apply_token_bitmask(logits, bits, rows)
        from .kernels.token_bitmask import apply_token_bitmask
        apply_token_bitmask(logits, bits.contiguous(), rows)

    @property
    def decode_graph_safe(self) -> bool:
        """Every op of a decode step runs as a kernel that reads per-request values only from
        device tensors, with no host synchronisation: decode can be captured in CUDA graphs
        and overlapped with scheduling. KDA needs fla-core for that (the reference loops)."""
        try:
            return importlib.util.find_spec("fla") is not None
        except ValueError:
            return False

    # ---- row copies of speculative decoding (backends/kernels/row_copy.py) --------------------
    def copy_slots(self, tensors: tuple[torch.Tensor, ...], src: torch.Tensor, dst: torch.Tensor,
                   into: tuple[torch.Tensor, ...] | None = None) -> None:
        from .kernels import row_copy
        if _device_ok(src) and row_copy.supports_slots(tensors, into):
            return row_copy.copy_slots(tensors, src, dst, into)
        return super().copy_slots(tensors, src, dst, into)

    def gather_rows(self, tensors: list[torch.Tensor], sel: torch.Tensor) -> list[torch.Tensor]:
        from .kernels import row_copy
        if _device_ok(sel) and row_copy.supports_gather(tensors):
            return row_copy.gather_rows(tensors, sel)
        return super().gather_rows(tensors, sel)

    # ---- dense linear: FP8 weights (every batch) and 16-bit weights at decode sizes ----------
    # (backends/kernels/fp8_linear.py; larger 16-bit products stay on cuBLAS)
    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               scale_inv: torch.Tensor | None = None, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
        if x.is_cuda or _interpreting():
            from .kernels import fp8_linear as f8
            y = None
            if scale_inv is not None:
                if f8.supported(x, weight, scale_inv, block, bias):
                    y = f8.fp8_linear(x.reshape(-1, x.shape[-1]), weight, scale_inv, block, bias,
                                      act_fp8=self.uses_w8a8(x, weight, block))
            elif self.skinny_linear in ("measured", "all") and f8.skinny_supported(x, weight, bias) and (
                    self.skinny_linear == "all"
                    or f8.skinny_preferred(x.numel() // x.shape[-1], *weight.shape, f8.sm_count(x.device))):
                y = f8.skinny_linear(x.reshape(-1, x.shape[-1]), weight, bias)
            if y is not None:
                return y.view(*x.shape[:-1], weight.shape[0])
        return super().linear(x, weight, bias, scale_inv, block)

    def indexer_select(self, q: torch.Tensor, w: torch.Tensor, pooled: torch.Tensor, meta: BatchMeta,
                       kpool: int, topk_pools: int) -> torch.Tensor:
        # decode and (opt-in) prefill / mixed batches (one row per query token; the wrapper dispatches)
        if (not _device_ok(q) or meta.num_reqs == 0 or not pooled.is_contiguous()
                or not (self.prefill_kernels or _kernel_ok(q, meta))):
            return super().indexer_select(q, w, pooled, meta, kpool, topk_pools)
        from .kernels.indexer import indexer_select
        return indexer_select(q, w, pooled, meta, kpool, topk_pools)

    def indexer_update(self, k: torch.Tensor, g: torch.Tensor, ape: torch.Tensor, pooled: torch.Tensor,
                       tail_k: torch.Tensor, tail_g: torch.Tensor, meta: BatchMeta, kpool: int) -> None:
        if _device_ok(k):
            from .kernels import indexer
            if indexer.update_takes(meta, pooled, tail_k, tail_g):
                return indexer.indexer_update(k, g, ape, pooled, tail_k, tail_g, meta, kpool)
        return super().indexer_update(k, g, ape, pooled, tail_k, tail_g, meta, kpool)

    def sparse_mla(self, q: torch.Tensor, cache: torch.Tensor, w_kc: torch.Tensor, w_vc: torch.Tensor,
                   sel: torch.Tensor | None, meta: BatchMeta, kpool: int, scale: float,
                   with_tail: bool = True) -> torch.Tensor:
        # decode, and prefill / mixed batches with a selection in 16-bit math (or interpreted);
        # dense causal and fp32-on-GPU prefill go back to the reference inside the wrapper
        if (not _device_ok(q) or meta.num_reqs == 0 or not cache.is_contiguous()
                or not (self.prefill_kernels or _kernel_ok(q, meta))):
            return super().sparse_mla(q, cache, w_kc, w_vc, sel, meta, kpool, scale, with_tail)
        from .kernels.sparse_mla import sparse_mla
        return sparse_mla(q, cache, w_kc, w_vc, sel, meta, kpool, scale, with_tail, side=self.fork(q))

    # ---- norms and mHC (every batch shape; kernels in backends/kernels/{norms,mhc}.py) ------
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if (not (x.is_cuda or _interpreting()) or x.dim() == 0 or weight.dim() != 1
                or weight.shape[0] != x.shape[-1] or weight.device != x.device
                or x.dtype not in (torch.float32, torch.bfloat16, torch.float16)):
            return super().rms_norm(x, weight, eps)
        from .kernels.norms import rms_norm
        return rms_norm(x, weight, eps)

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
        if self.fused_small_ops and (gate.is_cuda or _interpreting()):
            from .kernels import swiglu
            if swiglu.supports(gate, up):
                return swiglu.swiglu(gate, up, limit)
        return super().swiglu(gate, up, limit)

    def _fused_norm_ok(self, x: torch.Tensor, *others: torch.Tensor) -> bool:
        from .kernels.norms import MAX_FUSED_D
        return ((x.is_cuda or _interpreting()) and x.dim() == 2 and x.shape[1] <= MAX_FUSED_D
                and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
                and all(t.dtype == x.dtype and t.shape == x.shape and t.device == x.device for t in others))

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if not (self._fused_norm_ok(x, residual) and weight.shape == (x.shape[1],)):
            return super().add_rms_norm(x, residual, weight, eps)
        from .kernels.norms import add_rms_norm
        return add_rms_norm(x, residual, weight, eps)

    def stream_mean_rms_norm(self, streams: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not (streams.dim() == 3 and self._fused_norm_ok(streams[:, 0]) and weight.shape == (streams.shape[2],)
                and weight.device == streams.device):
            return super().stream_mean_rms_norm(streams, weight, eps)
        from .kernels.norms import stream_mean_rms_norm
        return stream_mean_rms_norm(streams, weight, eps)

    def rms_norm_pair(self, a: torch.Tensor, wa: torch.Tensor, b: torch.Tensor, wb: torch.Tensor,
                      eps: float) -> torch.Tensor:
        if not (self._fused_norm_ok(a, b) and wa.shape == wb.shape == (a.shape[1],)):
            return super().rms_norm_pair(a, wa, b, wb, eps)
        from .kernels.norms import rms_norm_pair
        return rms_norm_pair(a, wa, b, wb, eps)

    def kda_gate(self, f: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor, lower_bound: float | None,
                 num_heads: int) -> torch.Tensor:
        if self.fused_small_ops and (f.is_cuda or _interpreting()):
            from .kernels import kda_gate as kg
            if kg.supported(f, dt_bias, a_log, num_heads):
                return kg.kda_gate(f, dt_bias, a_log, lower_bound, num_heads)
        return super().kda_gate(f, dt_bias, a_log, lower_bound, num_heads)

    def gated_rms_norm(self, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self.fused_small_ops and (x.is_cuda or _interpreting()):
            from .kernels import norms
            if norms.gated_supported(x, gate, weight):
                return norms.gated_rms_norm(x, gate, weight, eps)
        return super().gated_rms_norm(x, gate, weight, eps)

    @staticmethod
    def _mhc_pre_ok(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                    norm: tuple[torch.Tensor, float] | None) -> bool:
        m = streams.shape[1] if streams.dim() == 3 else 0
        return ((streams.is_cuda or _interpreting()) and 1 <= m <= 8
                and tuple(fn.shape) == ((2 + m) * m, m * streams.shape[2])
                and all(t.device == streams.device for t in (fn, base, scale))
                and (norm is None or (norm[0].shape == (streams.shape[2],) and norm[0].device == streams.device)))

    @staticmethod
    def _mhc_post_ok(y: torch.Tensor | MoEPartials, streams: torch.Tensor, post: torch.Tensor,
                     comb: torch.Tensor) -> bool:
        m = streams.shape[1] if streams.dim() == 3 else 0
        y2 = y.y[:, 0] if isinstance(y, MoEPartials) else y  # the [N, D] shape and dtype checked below
        return ((streams.is_cuda or _interpreting()) and 1 <= m <= 8 and y2.dtype == streams.dtype
                and tuple(y2.shape) == (streams.shape[0], streams.shape[2])
                and all(t.device == streams.device for t in (y2, post, comb)))

    def mhc_pre(self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                sinkhorn_iters: int, hc_eps: float, norm_eps: float,
                norm: tuple[torch.Tensor, float] | None = None):
        if not self._mhc_pre_ok(streams, fn, base, scale, norm):
            return super().mhc_pre(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, norm)
        from .kernels.mhc import mhc_pre
        return mhc_pre(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, norm=norm)

    def mhc_post(self, y: torch.Tensor | MoEPartials, streams: torch.Tensor, post: torch.Tensor,
                 comb: torch.Tensor) -> torch.Tensor:
        if not self._mhc_post_ok(y, streams, post, comb):
            return super().mhc_post(y, streams, post, comb)
        from .kernels.mhc_post import mhc_post
        if isinstance(y, MoEPartials):  # the MoE's top-k sum on the way in (no sum launch)
            return mhc_post(y.y, streams, post, comb, ids=y.ids, num_experts=y.num_experts)
        return mhc_post(y, streams, post, comb)

    # ---- KDA (every batch; in place on the state slots; backends/kernels/{conv,kda}.py) -------
    def causal_conv(self, x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                    meta: BatchMeta, planes: int = 1) -> torch.Tensor:
        if x.is_cuda or _interpreting():
            from .kernels import conv
            if conv.supports(x, conv_state, weight) and meta.num_tokens == x.shape[0]:
                return conv.causal_conv(x, conv_state, weight, meta, planes=planes)
        return super().causal_conv(x, conv_state, weight, meta, planes)

    _fla_kda = None  # backends.kernels.kda once imported; False when fla-core is missing

    def _fla(self, q: torch.Tensor):
        """backends.kernels.kda where fla-core is installed and q is on a kernel device, else None."""
        if not (q.is_cuda or _interpreting()):
            return None
        if CudaH200Ops._fla_kda is None:
            try:
                from .kernels import kda as fla_kda
            except ImportError:  # fla-core not installed: the reference
                fla_kda = False
            CudaH200Ops._fla_kda = fla_kda
        return CudaH200Ops._fla_kda or None

    def zero_fresh_slots(self, state: torch.Tensor, meta: BatchMeta) -> bool:
        # the batches whose recurrence reads the slots in place (decode, short rows); prefill's
        # chunk_kda starts new requests from zeros without reading their slots
        kk = self._fla(state)
        if kk and meta.num_tokens > 0 and kk.in_place_rows(meta):
            from .kernels.conv import device_lens
            kk.zero_new_slots(state, device_lens(meta, state.device)[0], meta.slot_ids)
            return True
        return False

    def kda_gated(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, dt_bias: torch.Tensor,
                  a_log: torch.Tensor, lower_bound: float | None, beta: torch.Tensor, state: torch.Tensor,
                  meta: BatchMeta, *, slots_zeroed: bool = False) -> torch.Tensor:
        kk = self._fla(q)
        if self.fused_small_ops and kk and kk.gate_in_recurrence(q, k, v, f, dt_bias, a_log, beta, state, meta):
            return kk.kda_gated_short(q, k, v, f, dt_bias, a_log, lower_bound, beta, state, meta,
                                      zero_new=not slots_zeroed)
        # Interpreted prefill runs fla's chunk_kda only when a test asks (it is slow there).
        if (kk and (q.is_cuda or kk.INTERPRET_CHUNK) and meta.num_tokens == q.shape[0]
                and kk.gate_in_kernel(q, k, v, f, dt_bias, a_log, lower_bound, beta, state, meta)):
            return kk.kda_gated(q, k, v, f, dt_bias, a_log, lower_bound, beta, state, meta)
        return super().kda_gated(q, k, v, f, dt_bias, a_log, lower_bound, beta, state, meta, slots_zeroed=slots_zeroed)

    def kda(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor, meta: BatchMeta, chunk_size: int = 64, *,
            gate_floor: float | None = None, slots_zeroed: bool = False) -> torch.Tensor:
        kk = self._fla(q)
        # Interpreted prefill runs fla's chunk_kda only when a test asks (it is slow there).
        if (kk and kk.supports(q, k, v, g, beta, state) and meta.num_tokens == q.shape[0]
                and (q.is_cuda or kk.INTERPRET_CHUNK or kk.short_rows(meta))):
            return kk.kda(q, k, v, g, beta, state, meta, gate_floor=gate_floor, zero_new=not slots_zeroed)
        return super().kda(q, k, v, g, beta, state, meta, chunk_size, slots_zeroed=slots_zeroed)

    # ---- the MoE router (backends/kernels/moe_route.py) ----------------------------
    def moe_route(self, x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int,
                  topk_group: int, norm_topk_prob: bool, scaling: float, *, append_expert: int | None = None):
        if self.fused_small_ops and (x.is_cuda or _interpreting()):
            from .kernels import moe_route as mr
            if mr.supported(x, gate_w, bias, top_k, n_group, topk_group):
                return mr.moe_route(x, gate_w, bias, top_k, norm_topk_prob, scaling, append_expert=append_expert,
                                    n_group=n_group, topk_group=topk_group)
        return super().moe_route(x, gate_w, bias, top_k, n_group, topk_group, norm_topk_prob, scaling,
                                 append_expert=append_expert)

    # ---- routed MoE experts (every batch; kernels in backends/kernels/fused_moe.py) ----------
    def moe_experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w_gate: torch.Tensor,
                    w_up: torch.Tensor, w_down: torch.Tensor, limit: float | None,
                    scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                    block: tuple[int, int] = (128, 128), *, defer_sum: bool = False) -> torch.Tensor:
        if x.is_cuda or _interpreting():
            from .kernels import fused_moe as fm
            from .kernels import grouped_moe as gm
            if (scales is None and self.GROUPED_MIN_TOKENS is not None and x.shape[0] >= self.GROUPED_MIN_TOKENS
                    and gm.supported(x, ids, weights, w_gate, w_up, w_down)):
                return gm.grouped_moe(x, ids, weights, w_gate, w_up, w_down, limit)  # summed: see its doc
            if fm.supported(x, ids, weights, w_gate, w_up, w_down, scales, block):
                return fm.fused_moe(x, ids, weights, w_gate, w_up, w_down, limit, scales, block,
                                    act_fp8=scales is not None and self.uses_w8a8(x, w_gate, block),
                                    reduce=not defer_sum)
        return super().moe_experts(x, ids, weights, w_gate, w_up, w_down, limit, scales, block)


register("cuda-h200", CudaH200Ops)
