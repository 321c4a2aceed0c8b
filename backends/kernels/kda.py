"""KDA delta rule (docs/MODEL.md §4 steps 5-6) on fla-core 0.6.0, reading and writing the state pool.

ReferenceOps.kda's contract: q, k [N, H, dk] and v [N, H, dv] in the model dtype, g [N, H, dk]
fp32 log-decay, beta [N, H]; state [slots, H, dk, dv] (fp32, or bf16/fp16) is one layer's view
of the pool; request r starts from state[slot_ids[r]] (zeros when prefix_len is 0: slots are
not zeroed) and leaves its final state there. q/k are l2-normalised inside fla's kernels with
x / sqrt(Σx² + 1e-6) (fused_recurrent: in registers, fp32; chunk: fla's l2norm_fwd, rounded
to the input dtype), and q scaled by dk^-0.5: the reference's formula.

Decode (one token per request): fla's fused_recurrent_kda_fwd with ssm_state_indices=slot_ids
and inplace_final_state=True reads and writes each slot in place (one pass over 4 MiB per
request and layer at full size: the floor). Slots of requests with prefix_len 0 are zeroed first
by a masked-store kernel that reads prefix_lens_t on the device (no host sync, no gather), so
the step is graph-capturable: its grids depend on B only, and it never reads meta's Python
lists (a captured graph's lists are placeholders; cuda_graphs.py).

Prefill / mixed: fla's chunk_kda has no slot indices, so the states of the batch's multi-token
requests are gathered (index_select, zeros for new requests: no read at all when every one is
new), passed as initial_state, and the final states scattered back (index_copy_). That is 3
state passes per request (gather read+write, chunk read, chunk write, scatter read+write counted
as 6 half-passes) against a prefill's T·H·dk·dv·O(1) FLOPs: noise for T in the hundreds. For the
single-token rows of a mixed batch (decode requests riding along with a prefill chunk) the same
gather/scatter would triple their state traffic, which dominates their cost (4 MiB moved per
~0.1 MFLOP token), so by default they take fused_recurrent in place, on their gathered token
rows (`split_decode=False` runs everything through chunk_kda; bench/kda_h200.py times both).
fused_recurrent cannot take the multi-token rows in place: with 1-D ssm_state_indices its
kernel stores the state after token i_t at indices[i_n + i_t] (a 2-D per-token index layout
for speculative decoding), i.e. into the next request's slot.

Short rows (speculative decoding's verify and rollback: every request 1..RECURRENT_MAX_TOKENS new
tokens): fused_recurrent again, in place, with a 2-D [B, max_len] index whose every column is the
request's slot, so the state after each token lands in the slot and the last one stays there (the
kernel's own varlen loop over the request's tokens, cu_seqlens_t on the device). One launch and
one state read per request instead of chunk_kda's gather, chunk kernels and scatter (and its
blocking copy of chunk indices); the numerics are the decode step's, token by token, and the
launch is graph-safe like the decode one. Its cost is one state store per token.

fla's kernels run under TRITON_INTERPRET=1 (CPU tensors): fused_recurrent with the repo's
interpreter patches; chunk_kda only after `enable_interpreted_chunk()` (three more interpreter
fixes, all in backends/kernels/interpreter.py) and slowly (~10 s a call at toy sizes), so
CudaH200Ops keeps the reference for interpreted prefill unless INTERPRET_CHUNK is set
(tests/backends/test_triton_kda.py sets it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from fla.ops.kda import chunk_kda
from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd_kernel

from ..meta import BatchMeta, host_to_device
from .conv import device_lens
from . import pdl
from .pdl import pdl_enter
from .interpreter import interpreting, patch_interpreter
from .norms import l2norm

patch_interpreter()

INTERPRET_CHUNK = False  # see enable_interpreted_chunk()
# fla's decode kernel with our launch shape: a program holds the [dk, BV] fp32 state tile of one
# (request, head) and updates it in place. fla's own wrapper fixes BV 32, 4 warps, 2 stages;
# the fp32-state pass at batch 64 ran at ~71% of the copy rate with those (bench.decode_profile's
# kernel table), so the shape is ours to choose. The numerics do not depend on it: every
# state column is updated on its own, the sums over dk stay inside one program.
# H200, `bench.kda_h200 --decode-sweep` (µs per layer call, full-size heads; bench/RESULTS.md):
# B=64: fla's 32x4x2 174-177, 32x2x2 160, 64x2x2 153 (87% of the copy rate); B=128: 365-388,
# 313, 296 (90%). Fewer warps per program = more programs resident per SM = more state bytes in
# flight. Below 64 rows that bench is bound by the host, so those keep fla's shape (unmeasured).
DECODE_LAUNCHES: list[tuple[int, dict]] = [   # (up to this many rows, launch)
    (63, dict(BV=32, num_warps=4, num_stages=2)),
    (1 << 62, dict(BV=64, num_warps=2, num_stages=2)),
]
DECODE_LAUNCH: dict | None = None  # a fixed launch for every batch (benches set it), else the table
# chunk_kda's `safe_gate` path where the layer's gates are bounded below (the model's
# linear_lower_bound, ops.kda's gate_floor) by at most SAFE_GATE_FLOOR in magnitude: its 16-token
# diagonal blocks of the intra-chunk factors are tensor-core products (exp of bounded gate
# differences stays in fp32 range) instead of the token-parallel kernel's scalar loops. False
# keeps the general path for every gate (bench.kda_h200 --safe-gate times both).
SAFE_GATE = True
SAFE_GATE_FLOOR = -5.0  # fla's stated range for it: lower_bound in [-5, 0)
# ops.kda_gated on prefill batches (every request more than one token) with a bounded gate:
# chunk_kda computes lower_bound * sigmoid(exp(A_log) * (f + dt_bias)) inside its chunk-cumsum
# kernel (use_gate_in_kernel) from the bf16 projection f, instead of our kda_gate writing an fp32
# g that its cumsum then reads (bench.kda_h200 --gate-in-kernel times both). False: kda_gate + kda.
GATE_IN_KERNEL = True
# ops.kda_gated on batches of short rows (decode, and speculative decoding's verify): fla's
# recurrent kernel computes the same gate from the projection f (its USE_GATE_IN_KERNEL), so the
# gate is not a launch of its own between the conv and the recurrence, where at one token each
# launch waits for the one before (bench.decode_profile --kda-decode-gate). False: kda_gate + kda.
DECODE_GATE_IN_KERNEL = True
# Batches whose requests all have 1..RECURRENT_MAX_TOKENS new tokens run fused_recurrent in place
# (the verify and rollback of speculative decoding); 0 sends multi-token rows to chunk_kda.
RECURRENT_MAX_TOKENS = 8


def decode_launch(rows: int) -> dict:
    return dict(DECODE_LAUNCH or next(c for lim, c in DECODE_LAUNCHES if rows <= lim))


@triton.jit
def _zero_new_slots_kernel(STATE, PREFIX, SLOTS, S, stride_s, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """state[slot_ids[b]] = 0 where prefix_lens[b] == 0: masked stores only, no state reads."""
    pdl_enter(PDL)
    b = tl.program_id(0)
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    new = tl.load(PREFIX + b) == 0
    base = STATE + tl.load(SLOTS + b).to(tl.int64) * stride_s
    tl.store(base + offs, tl.zeros([BLOCK], dtype=STATE.dtype.element_ty), mask=(offs < S) & new)


def zero_new_slots(state: torch.Tensor, prefix_lens_t: torch.Tensor, slot_ids: torch.Tensor,
                   block: int = 8192) -> None:
    b = slot_ids.shape[0]
    size = state[0].numel()
    if b:
        _zero_new_slots_kernel[(b, triton.cdiv(size, block))](state, prefix_lens_t, slot_ids, size, state.stride(0),
                                                              BLOCK=block, **pdl.launch(state.device), num_warps=4)


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             state: torch.Tensor) -> bool:
    """What the fla paths take: [N, H, d] inputs, K <= 256, a state whose slots are dense
    [H, dk, dv] blocks (fla indexes a slot by its stride, then assumes the inner layout)."""
    fl = (torch.float32, torch.bfloat16, torch.float16)
    if q.dim() != 3 or state.dim() != 4 or q.shape != k.shape or g.shape != q.shape:
        return False
    n, h, dk = q.shape
    dv = v.shape[-1]
    return (tuple(v.shape) == (n, h, dv) and tuple(beta.shape) == (n, h) and dk <= 256
            and tuple(state.shape[1:]) == (h, dk, dv) and state.stride()[1:] == (dk * dv, dv, 1)
            and all(t.dtype in fl for t in (q, k, v, g, beta, state)) and q.dtype == k.dtype == v.dtype
            and all(t.device == q.device for t in (k, v, g, beta, state)))


def kda_decode(q, k, v, g, beta, state, slot_ids, prefix_lens_t, cu_seqlens_t, out=None,
               max_len: int = 1, index: torch.Tensor | None = None, gate: tuple | None = None,
               zero_new: bool = True) -> torch.Tensor:
    """Up to `max_len` tokens per request (cu_seqlens_t), in place on state[slot_ids]; returns
    [N, H, dv] in v.dtype. `index`: recurrent_decode's [B, max_len] slot index, when the caller
    keeps one for every layer of a forward. `gate`: see recurrent_decode. `zero_new=False`: the
    new requests' slots are zero already (ops.zero_fresh_slots)."""
    if zero_new:
        zero_new_slots(state, prefix_lens_t, slot_ids)
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device) if out is None else out
    recurrent_decode(q, k, v, g, beta, state, slot_ids, cu_seqlens_t, o, max_len=max_len, index=index, gate=gate)
    return o


def short_rows_index(slot_ids: torch.Tensor, max_len: int) -> torch.Tensor:
    """[B, max_len], every column the request's slot: fla's kernel stores the state after token t
    at index[r, t] (it reads the index with unit stride per token, so no expanded view)."""
    return slot_ids[:, None].expand(slot_ids.shape[0], max_len).contiguous()


def recurrent_decode(q, k, v, g, beta, state, slot_ids, cu_seqlens_t, out, launch: dict | None = None,
                     max_len: int = 1, index: torch.Tensor | None = None, gate: tuple | None = None) -> None:
    """fla's fused_recurrent_kda_fwd_kernel, in place on state[slot_ids], q/k l2-normalised inside
    (what fla's fused_recurrent_kda_fwd(..., inplace_final_state=True, ssm_state_indices=...,
    use_qk_l2norm_in_kernel=True) launches), with decode_launch's tile (or `launch`) instead of
    fla's fixed one. One token per request, or up to `max_len`: the kernel then stores the state
    after token t at index[r, t], and every column of the index is the slot. `gate` (dt_bias,
    A_log, lower_bound): g is the gate projection's output f [N, H, dk] and the kernel computes
    kda_gate's g from it (use_gate_in_kernel)."""
    _, h, dk = q.shape
    n = slot_ids.shape[0]
    cfg = dict(decode_launch(n), **(launch or {}))
    dv = v.shape[-1]
    bv = min(cfg["BV"], triton.next_power_of_2(dv))
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    if index is None:
        index = slot_ids if max_len == 1 else short_rows_index(slot_ids, max_len)
    grid = (triton.cdiv(dv, bv) * n * h,)
    dt_bias, a_log, lower_bound = gate if gate is not None else (None, None, None)
    fused_recurrent_kda_fwd_kernel[grid](
        q=q, k=k, v=v, g=g, beta=beta, A_log=a_log, dt_bias=dt_bias, o=out, h0=state, ht=state,
        cu_seqlens=cu_seqlens_t, ssm_state_indices=index, num_accepted_tokens=None,
        lower_bound=None if lower_bound is None else float(lower_bound),
        scale=dk ** -0.5, N=n, T=q.shape[0], H=h, HV=h, K=dk, V=dv, BK=triton.next_power_of_2(dk), BV=bv,
        stride_init_state_token=state.stride(0), stride_final_state_token=state.stride(0),
        stride_indices_seq=index.stride(0), stride_indices_tok=1,
        IS_BETA_HEADWISE=False, USE_QK_L2NORM_IN_KERNEL=True, INPLACE_FINAL_STATE=True,
        USE_GATE_IN_KERNEL=gate is not None, APPLY_BETA_SIGMOID=False, ALLOW_NEG_EIGVAL=False, STATE_V_FIRST=False,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def safe_gate(gate_floor: float | None) -> bool:
    """Whether chunk_kda may take its bounded-gate path for gates >= gate_floor."""
    return SAFE_GATE and gate_floor is not None and SAFE_GATE_FLOOR <= gate_floor < 0


def kda_chunked(q, k, v, g, beta, state, slots: torch.Tensor, has_hist: list[bool], keep: torch.Tensor | None,
                cu: tuple[torch.Tensor, torch.Tensor], gate_floor: float | None = None,
                gate_params: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The multi-token requests (their tokens are q.. in order) through chunk_kda, their states
    gathered from and scattered back to `slots`. `keep`: has_hist on the device (where a request
    continues from its slot), needed only when some do and some do not. `cu`: cu_seqlens on the
    device and on the host; the same two tensors in every KDA layer of a forward let fla's
    identity cache keep its chunk indices (their own blocking copy) after the first layer.
    `gate_floor`: g >= it (see SAFE_GATE). `gate_params` (dt_bias, A_log): g is the gate
    projection's output [N, H, dk] and chunk_kda computes the gate, with gate_floor as its bound."""
    cu_dev, cu_cpu = cu
    init = None
    if any(has_hist):
        init = state.index_select(0, slots).float()
        if not all(has_hist):  # where, not a multiply: a stale slot may hold anything (NaN too)
            init = torch.where(keep[:, None, None, None], init, 0.0)
    # q, k normalised by our l2norm (fla's formula): fla's in-kernel option autotunes its l2norm
    # per multiple of 1024 batch tokens (backends/kernels/norms.py, l2norm), a stall each
    q, k = l2norm(q), l2norm(k)
    gate = {}
    if gate_params is not None:
        gate = dict(use_gate_in_kernel=True, dt_bias=gate_params[0], A_log=gate_params[1], lower_bound=gate_floor)
    o, final = chunk_kda(q[None], k[None], v[None], g[None], beta[None], scale=q.shape[-1] ** -0.5,
                         initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=False,
                         cu_seqlens=cu_dev, cu_seqlens_cpu=cu_cpu, safe_gate=safe_gate(gate_floor), **gate)
    state.index_copy_(0, slots, final.to(state.dtype))
    return o[0]


def short_rows(meta: BatchMeta) -> bool:
    """Every request of the batch has 1..RECURRENT_MAX_TOKENS new tokens (the in-place path)."""
    return meta.num_reqs > 0 and all(1 <= s <= RECURRENT_MAX_TOKENS for s in meta.seq_lens)


def in_place_rows(meta: BatchMeta) -> bool:
    """A batch the recurrent kernel takes in place: one new token a request, or short_rows."""
    return meta.num_reqs > 0 and (all(s == 1 for s in meta.seq_lens) or short_rows(meta))


class _Split:
    """A prefill or mixed batch split for KDA: one-token rows (decodes riding along, when split)
    and multi-token requests. Built once per forward and kept on the meta, so every KDA layer
    shares its index tensors, which reach the device in one pinned copy: a tensor built from a
    Python list on the device is a copy from pageable memory, which waits for the GPU's queue
    to drain, each one a host stall of the forward."""

    def __init__(self, meta: BatchMeta, device: torch.device, split_decode: bool):
        seq, cu = meta.seq_lens, meta.cu_seqlens
        self.ones = [r for r, s in enumerate(seq) if s == 1] if split_decode else []
        self.many = [r for r, s in enumerate(seq) if s > 1 or (s == 1 and not split_decode)]
        self.has_hist = [meta.prefix_lens[r] > 0 for r in self.many]
        self.whole = len(self.many) == meta.num_reqs  # the multi-token rows are the batch's
        host = {}
        if self.ones:
            host["ones_rows"] = torch.tensor([cu[r] for r in self.ones], dtype=torch.long)
            host["ones_reqs"] = torch.tensor(self.ones, dtype=torch.long)
            host["ones_cu"] = torch.arange(len(self.ones) + 1)
        if self.many and not self.whole:
            host["many_rows"] = torch.cat([torch.arange(cu[r], cu[r + 1]) for r in self.many])
            host["many_reqs"] = torch.tensor(self.many, dtype=torch.long)
            many_cu = torch.zeros(len(self.many) + 1, dtype=torch.long)
            torch.cumsum(torch.tensor([seq[r] for r in self.many], dtype=torch.long), 0, out=many_cu[1:])
            host["many_cu"] = many_cu
        if any(self.has_hist) and not all(self.has_hist):
            host["keep"] = torch.tensor(self.has_hist, dtype=torch.long)
        dev = dict(zip(host, host_to_device(device, *host.values()))) if host else {}
        self.ones_rows, self.ones_reqs, self.ones_cu = (dev.get(x) for x in ("ones_rows", "ones_reqs", "ones_cu"))
        self.many_rows = dev.get("many_rows")
        self.keep = dev["keep"].bool() if "keep" in dev else None
        if self.whole:
            cu_cpu = meta.cu_seqlens_cpu if meta.cu_seqlens_cpu is not None else torch.tensor(cu, dtype=torch.long)
            self.many_slots, self.many_cu = meta.slot_ids, (device_lens(meta, device)[1], cu_cpu)
        elif self.many:
            self.many_slots, self.many_cu = meta.slot_ids[dev["many_reqs"]], (dev["many_cu"], host["many_cu"])

    @classmethod
    def of(cls, meta: BatchMeta, device: torch.device, split_decode: bool) -> "_Split":
        key = ("kda_split", split_decode)
        if key not in meta.derived:
            meta.derived[key] = cls(meta, device, split_decode)
        return meta.derived[key]


def kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
        state: torch.Tensor, meta: BatchMeta, *, split_decode: bool = True,
        gate_floor: float | None = None, zero_new: bool = True) -> torch.Tensor:
    """ReferenceOps.kda (state updated in place); returns [N, H, dv] in v.dtype. `zero_new=False`:
    the in-place rows' new slots are zero already (ops.zero_fresh_slots)."""
    if in_place_rows(meta):
        return _short_rows(q, k, v, g, beta, state, meta, zero_new=zero_new)
    sp = _Split.of(meta, q.device, split_decode)
    if sp.whole:
        # every request is a multi-token one: chunk_kda's rows are the batch's, its output is ours
        # (no [N, H, dv] copy), and meta's cu_seqlens (device and host) are chunk_kda's
        o = kda_chunked(q, k, v, g, beta, state, sp.many_slots, sp.has_hist, sp.keep, sp.many_cu, gate_floor)
        return o if o.dtype == v.dtype else o.to(v.dtype)
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    # Requests with no new token keep their state untouched (as the reference does).
    if sp.ones:
        pre_t = device_lens(meta, q.device)[0]
        idx, rt = sp.ones_rows, sp.ones_reqs
        out[idx] = kda_decode(q[idx], k[idx], v[idx], g[idx], beta[idx], state, meta.slot_ids[rt], pre_t[rt],
                              sp.ones_cu)
    if sp.many:  # gather the multi-token rows (q, k, v are copied to contiguous anyway)
        args = tuple(t[sp.many_rows] for t in (q, k, v, g, beta))
        o = kda_chunked(*args, state, sp.many_slots, sp.has_hist, sp.keep, sp.many_cu, gate_floor)
        out[sp.many_rows] = o.to(out.dtype)
    return out


def _short_rows(q, k, v, g, beta, state, meta: BatchMeta, gate: tuple | None = None,
                zero_new: bool = True) -> torch.Tensor:
    """A batch of short rows in place through the recurrent kernel (`gate`: recurrent_decode's,
    `zero_new`: kda_decode's)."""
    pre_t, cu_t = device_lens(meta, q.device)
    n = max(meta.seq_lens)
    if n == 1:
        return kda_decode(q, k, v, g, beta, state, meta.slot_ids, pre_t, cu_t, gate=gate, zero_new=zero_new)
    key = ("kda_short_rows_index", n)  # the slot index built once per forward, shared by its KDA layers
    if key not in meta.derived:
        meta.derived[key] = short_rows_index(meta.slot_ids, n)
    return kda_decode(q, k, v, g, beta, state, meta.slot_ids, pre_t, cu_t, max_len=n, index=meta.derived[key],
                      gate=gate, zero_new=zero_new)


def _gate_inputs_ok(q, f, dt_bias, a_log) -> bool:
    """fla's in-kernel gate takes f [N, H·dk] contiguous in bf16 or fp32, dt_bias [H·dk] and A_log
    [H] in fp32."""
    n, h, dk = q.shape
    return (tuple(f.shape) == (n, h * dk) and f.is_contiguous() and f.dtype in (torch.bfloat16, torch.float32)
            and tuple(dt_bias.shape) == (h * dk,) and tuple(a_log.shape) == (h,)
            and dt_bias.dtype == a_log.dtype == torch.float32 and dt_bias.is_contiguous() and a_log.is_contiguous()
            and dt_bias.device == a_log.device == f.device == q.device)


def gate_in_recurrence(q, k, v, f, dt_bias, a_log, beta, state, meta: BatchMeta) -> bool:
    """Whether kda_gated takes the batch with the gate inside the recurrent kernel:
    DECODE_GATE_IN_KERNEL, a batch of in_place_rows and inputs the kernel takes."""
    return (DECODE_GATE_IN_KERNEL and in_place_rows(meta) and meta.num_tokens == q.shape[0]
            and _gate_inputs_ok(q, f, dt_bias, a_log) and supports(q, k, v, q, beta, state))  # q: the gate's shape


def kda_gated_short(q, k, v, f, dt_bias, a_log, lower_bound: float | None, beta, state,
                    meta: BatchMeta, zero_new: bool = True) -> torch.Tensor:
    """ops.kda_gated on a batch of short rows (gate_in_recurrence): kda_gate's g computed inside
    the recurrent kernel from f. Returns [N, H, dv] in v.dtype."""
    return _short_rows(q, k, v, f.view(q.shape), beta, state, meta, gate=(dt_bias, a_log, lower_bound),
                       zero_new=zero_new)


def gate_in_kernel(q, k, v, f, dt_bias, a_log, lower_bound, beta, state, meta: BatchMeta) -> bool:
    """Whether kda_gated takes the batch: GATE_IN_KERNEL, a bounded gate on the safe-gate path, every
    request more than one new token and not all of them short rows (the batches kda sends through
    chunk_kda whole) and inputs fla takes (dt_bias [H·dk] and A_log [H] in fp32, f [N, H·dk]
    contiguous)."""
    return (GATE_IN_KERNEL and safe_gate(lower_bound) and meta.num_reqs > 0 and all(s > 1 for s in meta.seq_lens)
            and not short_rows(meta) and _gate_inputs_ok(q, f, dt_bias, a_log)
            and supports(q, k, v, q, beta, state))  # q stands in for the gate made inside


def kda_gated(q, k, v, f, dt_bias, a_log, lower_bound: float, beta, state, meta: BatchMeta) -> torch.Tensor:
    """ops.kda_gated on a prefill batch (gate_in_kernel): the whole batch through chunk_kda, the
    forget gate computed in its cumsum kernel. Returns [N, H, dv] in v.dtype."""
    sp = _Split.of(meta, q.device, True)
    assert sp.whole, "kda_gated takes batches of multi-token requests only"
    o = kda_chunked(q, k, v, f.view(q.shape), beta, state, sp.many_slots, sp.has_hist, sp.keep, sp.many_cu,
                    lower_bound, gate_params=(dt_bias, a_log))
    return o if o.dtype == v.dtype else o.to(v.dtype)


# ---- Triton interpreter support for chunk_kda (CPU tests only) --------------------------------
def enable_interpreted_chunk() -> None:
    """Let fla's chunk_kda run under TRITON_INTERPRET=1 and route interpreted prefill to it.

    Three fixes to Triton 3.6's interpreter, process-wide (compiled runs are untouched): tensor
    loop variables, no autotune benchmarking, bf16 elementwise math; see
    `backends.kernels.interpreter.patch_interpreter(fla_chunk=True)`. And one to fla: its safe-gate
    intra kernel calls `tl.gather` through a module alias taken outside any kernel, which the
    interpreter cannot run; without it the kernel loads the same gate row from memory.
    """
    global INTERPRET_CHUNK
    if not interpreting():
        return  # compiled Triton needs none of the fixes
    patch_interpreter(fla_chunk=True)
    from fla.ops.kda import chunk_intra
    chunk_intra.IS_GATHER_SUPPORTED = False
    INTERPRET_CHUNK = True
