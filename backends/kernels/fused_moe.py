"""Fused routed-expert MoE (docs/MODEL.md §5, MoE) as Triton kernels: ReferenceOps.moe_experts, fast.

    out[t] = Σ_k w[t,k] · down_e( silu(clamp(gate_e x_t)) · clamp(up_e x_t) ),   e = ids[t,k]

Stacked weights gate/up [E, I, D], down [E, D, I] (bf16/fp16/fp32, or fp8 e4m3 with DeepSeek
128x128 block scales `scale_inv [E, out/bo, in/bi]`). Three launches at the smallest batches
(up to PAIR_BLOCKS_MAX_PAIRS pairs), four at the other decode sizes, six above; no host sync,
every size an upper bound computed from (N, top_k, E, BLOCK_M), so the whole op can be captured
in a CUDA graph:

0. Pair blocks (M = N·top_k <= PAIR_BLOCKS_MAX_PAIRS, e.g. batch <= 4 at top-8): no alignment.
   Block b is pair b alone (one real row of its BLOCK_M), its expert read straight from
   ids.flat[b] by the GEMMs (ids outside [0, E): the block is skipped), M blocks in all. An
   expert routed twice in the batch has its weights read twice: cheaper than the alignment
   launch only at these sizes (see PAIR_BLOCKS_MAX_PAIRS). Steps 2-4 as below.
1. Alignment (moe_align.py): the pairs grouped by expert, each expert's group padded to a
   multiple of BLOCK_M, so that every BLOCK_M-row block of the sorted list belongs to one
   expert; one launch up to ONE_LAUNCH_MAX_PAIRS pairs, three above.
2. _gate_up  grouped GEMM over (block, I-tile): both projections in one program (two weight
   pointers, two accumulators) with the clamped SwiGLU fused in the epilogue; writes the
   activation h [M, I] at the pair's flat index.
3. _down     grouped GEMM over (block, D-tile): y = h · W_downᵀ, times the routing weight,
   written to ybuf [M, D] = [N, top_k, D] at the pair's flat index (no atomics).
4. _sum      out[t] = Σ_k ybuf[t, k] in fp32, rounded once: deterministic.

Numerics follow ReferenceOps.moe_experts step by step, but for one thing: fp8 weight tiles are
converted exactly to the activation dtype (w8a16: activations stay in the model dtype), the
products accumulate in fp32 on the tensor cores, and the 128x128 block scale multiplies each K
tile's fp32 partial product (acc += dot(x, w)·s; one multiply per output element per K tile)
instead of each weight element before the dot, where the reference rounds w·s to the activation
dtype (dequantize_block_fp8). That is closer to the exact product, and differs from the
reference by about the reference's own error (bf16: a few 1e-3 relative). Tiles that straddle
scale blocks along K (BLOCK_K above the block), or a config's scale_acc=False, dequantise per
element exactly as the reference does. With `act_fp8` (w8a8, CudaH200Ops' default for fp8
weights) both GEMMs' inputs are quantised to e4m3 per row and K scale block (quant_act_e4m3: by
act_quant first, or by each GEMM program in its K loop; INKERNEL_QUANT_MAX_TOKENS) and the GEMMs
multiply e4m3 by e4m3 (an fp8 wgmma on the swapped decode tiles, FP8A8_CONFIGS); its
reference is ReferenceOps.moe_experts with fp8_activations="dynamic". Gate, up, silu(gate), the
activation, the down product and the weighted term are each rounded to the model dtype where the
reference rounds them; the final top-k sum is fp32 with one rounding here, a chain of bf16 adds
in the reference.

Tiles per token count come from fused_moe_configs.py: CONFIGS (16-bit weights), FP8_CONFIGS (fp8
weights: half the bytes per element, so wider tiles / deeper pipelines) and FP8A8_CONFIGS (w8a8)
(decode: BLOCK_M 16 and wide K tiles, memory-bound, every routed expert's weights read once per
step (once per pair that picks it with pair blocks); prefill: BLOCK_M 64/128
tensor-core tiles with a grouped launch order so that the blocks of one expert share its weight
tiles in L2). A config may also ask for SWAP_AB (the transposed product accᵀ = W·xᵀ, the weight
tile as the MMA's A operand).

Expert ids outside [0, E) (e.g. -1) are dropped: the pair contributes nothing, as in the
reference (expert parallelism marks another rank's experts -1: glmrt.model.moe.TokenDispatcher).
"""

from __future__ import annotations

import torch
import triton

# the tile tables live in fused_moe_configs; re-exported here for tests and benches (fm.CONFIGS, ...)
from .fused_moe_configs import CONFIGS, FP8_CONFIGS, FP8A8_CONFIGS, FP8_DTYPES, FP32_CONFIG, get_config  # noqa: F401
from . import pdl
from .act_quant import act_fp8_supported, act_quant
from .fused_moe_kernels import _down_kernel, _gate_up_kernel, _sum_kernel
from .moe_align import moe_align
from ..reference import MoEPartials

ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
WEIGHT_DTYPES = ACT_DTYPES + FP8_DTYPES

# Up to this many (token, slot) pairs every pair is its own BLOCK_M block (no alignment launch).
# The price: an expert picked by two pairs of the batch has its weights read twice. Uniform
# top-8 routing of B tokens over 288 experts reaches 288·(1-(1-8/288)^B) distinct experts, so the
# duplicate reads add ~1.4% bytes at B=2, ~4% at B=4, ~10% at B=8, against the ~9 µs per layer the
# alignment costs on an H200 out of an MoE layer of ~100 µs (B=1) .. ~150 µs (B=8): a win up to
# B=4 at top-8, i.e. 32 pairs. Measured on an H200 (D 4096, I 2048, fp8, CUDA graph, random
# routing): pair minus aligned -8 µs at B=1 and B=2, -7 µs at B=4, +6 .. +57 µs at B=8.
PAIR_BLOCKS_MAX_PAIRS = 32
# w8a8 (act_fp8): up to this many tokens each GEMM program quantises its own activation tiles in
# its K loop; above, act_quant quantises x and h once first. 0: act_quant at every size. At one
# token (H100, the flash-4l decode step, bench/RESULTS.md) the two act_quant launches cost less
# than the in-loop quantisation on the critical path of the 144 gate/up programs (x's 32 blocks
# each) and 288 down programs (h's 16 each): 1.261 against 1.296 ms a step; from 16 tokens the two
# are alike. At BLOCK_M 128 the in-GEMM quantisation of a 128x128 tile spills on sm_90.
INKERNEL_QUANT_MAX_TOKENS = 0
# 16-bit weights on pair blocks: gate/up in 32-column tiles, 3 stages (the table's 64 / 4 left
# the last of ~2.2 waves mostly empty at batch 1 with the shared expert seated, 9 pairs). H200,
# one MoE layer call in a CUDA graph: 128.8 -> 119.6 µs, the same output.
PAIR_GATE_UP_16BIT = dict(BLOCK_N=32, num_stages=3)


# ---------------------------------------------------------------------------------------
# entry points
# ---------------------------------------------------------------------------------------
def supported(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w_gate: torch.Tensor,
              w_up: torch.Tensor, w_down: torch.Tensor,
              scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
              block: tuple[int, int] = (128, 128)) -> bool:
    """Whether fused_moe takes these arguments (shapes, dtypes, layouts); else use the reference."""
    if x.dim() != 2 or ids.dim() != 2 or weights.shape != ids.shape or ids.shape[0] != x.shape[0]:
        return False
    if x.dtype not in ACT_DTYPES or ids.dtype not in (torch.int32, torch.int64) or not weights.is_floating_point():
        return False
    if w_gate.dim() != 3 or w_gate.shape != w_up.shape or w_down.dim() != 3:
        return False
    e, i, d = w_gate.shape
    if x.shape[1] != d or tuple(w_down.shape) != (e, d, i) or e < 1 or ids.shape[1] < 1:
        return False
    ws = (w_gate, w_up, w_down)
    if any(w.stride(-1) != 1 for w in ws) or len({w.dtype for w in ws}) != 1 or w_gate.dtype not in WEIGHT_DTYPES:
        return False
    tensors = [x, ids, weights, *ws]
    if (scales is None) != (w_gate.dtype not in FP8_DTYPES):
        return False
    if scales is not None:
        if len(scales) != 3 or len(block) != 2:
            return False
        bo, bi = int(block[0]), int(block[1])
        if bo < 16 or bi < 16 or bo & (bo - 1) or bi & (bi - 1):
            return False
        want = ((e, triton.cdiv(i, bo), triton.cdiv(d, bi)),) * 2 + ((e, triton.cdiv(d, bo), triton.cdiv(i, bi)),)
        if any(tuple(s.shape) != w or not s.is_floating_point() for s, w in zip(scales, want)):
            return False
        tensors += list(scales)
    return all(t.device == x.device for t in tensors)


# Tiles that a table or a caller asks for but whose shared memory the device lacks (the per-element
# dequant keeps a converted weight tile per stage): fewer stages first, then a narrower K tile,
# once per (kernel, tile, K); the shrunk tile is remembered. Triton compiles at the first launch,
# so the OutOfResources comes before anything runs.
_FITTED: dict[tuple, tuple[int, int]] = {}


def _launch_fitting(kernel, grid, args: tuple, meta: dict, c: dict, k_dim: int, scale_acc: bool) -> None:
    key = (id(kernel), c["BLOCK_N"], c["BLOCK_K"], c["num_warps"], c["num_stages"], scale_acc,
           k_dim % c["BLOCK_K"] == 0, meta["FP8"], meta["SWAP_AB"], meta.get("ACT_FP8", False),
           meta.get("X_FP8", False))
    bk, stages = _FITTED.get(key, (c["BLOCK_K"], c["num_stages"]))
    while True:
        try:
            kernel[grid(c)](*args, **meta, BLOCK_N=c["BLOCK_N"], BLOCK_K=bk, EVEN_K=k_dim % bk == 0,
                            SCALE_ACC=scale_acc and bk <= meta["SCALE_BK"],
                            num_warps=c["num_warps"], num_stages=stages)
            _FITTED[key] = (bk, stages)
            return
        except triton.runtime.errors.OutOfResources:
            if stages > 1:
                stages -= 1
            elif bk > 16 and not meta.get("ACT_FP8"):  # w8a8 quantises groups of the scale's K block
                bk, stages = bk // 2, c["num_stages"]
            else:
                raise


def fused_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w_gate: torch.Tensor,
              w_up: torch.Tensor, w_down: torch.Tensor, limit: float | None,
              scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
              block: tuple[int, int] = (128, 128), *, out: torch.Tensor | None = None,
              config: dict | None = None, pair_blocks: bool | None = None, act_fp8: bool = False,
              reduce: bool = True) -> torch.Tensor | MoEPartials:
    """ReferenceOps.moe_experts: x [N, D], ids/weights [N, k], gate/up [E, I, D], down [E, D, I].

    `act_fp8` (where act_fp8_supported): w8a8, i.e. both GEMMs' inputs quantised per row and
    scale block along K (inside the GEMMs up to INKERNEL_QUANT_MAX_TOKENS tokens, else once by
    act_quant: at every size by default) and fp8 x fp8 products; ReferenceOps.moe_experts with
    fp8_activations="dynamic" is its reference. Otherwise (and for other weights) w8a16.

    `out` [N, D] (x.dtype, contiguous) is written in place when given; `config` overrides the
    tile table entry (same layout as get_config's result); `pair_blocks` forces one block per
    (token, slot) pair without alignment (True) or the aligned blocks (False); None: pair blocks
    up to PAIR_BLOCKS_MAX_PAIRS pairs. `reduce=False`: no sum launch, MoEPartials (the weighted
    per-pair rows) for a consumer that sums them itself (mhc_post.mhc_post)."""
    n, d = x.shape
    top_k = ids.shape[1]
    e, i, _ = w_gate.shape
    if out is None and (reduce or n == 0):  # unreduced, the pair rows are the result
        out = torch.empty(n, d, dtype=x.dtype, device=x.device)
    assert out is None or (out.shape == (n, d) and out.dtype == x.dtype and out.stride(-1) == 1)
    if n == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    m = n * top_k
    fp8 = scales is not None
    act_fp8 = act_fp8_supported(act_fp8, x.dtype, w_gate.dtype, block)
    cfg = get_config(n, x.dtype, w_gate.dtype, act_fp8)
    if pair_blocks is None:
        pair_blocks = m <= PAIR_BLOCKS_MAX_PAIRS
    if pair_blocks and not fp8 and x.dtype != torch.float32:
        cfg["gate_up"].update(PAIR_GATE_UP_16BIT)
    if config:
        cfg.update({k: v for k, v in config.items() if k == "BLOCK_M"})
        for part in ("gate_up", "down"):
            cfg[part].update(config.get(part, {}))
    bm = cfg["BLOCK_M"]
    gu, dn = dict(cfg["gate_up"]), dict(cfg["down"])
    bo, bi = (int(block[0]), int(block[1])) if fp8 else (1 << 30, 1 << 30)
    flags = {}
    for part, c in (("gate_up", gu), ("down", dn)):
        if fp8 and x.dtype == torch.float32:
            c["BLOCK_K"] = min(c["BLOCK_K"], 32)  # fp32 + dequant at K 64 spills (parity path)
        if act_fp8:  # one K tile = one activation group = the weight's scale block
            c["BLOCK_K"], c["scale_acc"] = bi, True
        # the scale may multiply the K tile's partial product when the tile is inside one scale
        # block along K (powers of two: BLOCK_K <= bi means it divides it); else per element
        flags[part] = dict(SCALE_ACC=bool(fp8 and c.get("scale_acc", True) and c["BLOCK_K"] <= bi),
                           SWAP_AB=bool(c.get("SWAP_AB", False)))
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # tf32 is moot for 16-bit operands

    flat_ids = ids.reshape(-1).contiguous()
    rw = weights.reshape(-1).contiguous()
    if pair_blocks:  # block b = pair b, expert ids.flat[b]: no alignment launch, no buffers
        sorted_ids = block_expert = block_rows = flat_ids  # unused (PAIR_BLOCKS)
        nb = m
    else:
        sorted_ids, block_expert, block_rows = moe_align(ids, e, bm)
        nb = block_expert.shape[0]
    h = torch.empty(m, i, dtype=x.dtype, device=x.device)
    y = torch.empty(m, d, dtype=x.dtype, device=x.device)
    if fp8:
        sg, su, sd = scales
    else:
        sg = su = sd = w_gate  # unused (FP8=False)
    sstr = (lambda s: (s.stride(0), s.stride(1), s.stride(2))) if fp8 else (lambda s: (0, 0, 0))
    launch = pdl.launch(x.device)
    # w8a8 above INKERNEL_QUANT_MAX_TOKENS: x (and below, h) quantised once by act_quant, not once
    # per N tile inside the GEMMs
    pre = act_fp8 and n > INKERNEL_QUANT_MAX_TOKENS
    x_in, xs = act_quant(x, bi) if pre else (x, x)  # xs unused unless X_FP8

    _launch_fitting(
        _gate_up_kernel, lambda c: (nb * triton.cdiv(i, c["BLOCK_N"]),),
        (x_in, w_gate, w_up, sg, su, h, sorted_ids, block_expert, block_rows, flat_ids,
         d, i, e, top_k, nb, float(limit) if limit is not None else 0.0,
         x_in.stride(0),
         w_gate.stride(0), w_gate.stride(1), w_up.stride(0), w_up.stride(1),
         *sstr(sg), *sstr(su),
         h.stride(0), xs, xs.stride(0)),
        dict(BLOCK_M=bm, GROUP_M=gu["GROUP_M"], FP8=fp8, SCALE_BN=bo, SCALE_BK=bi, HAS_LIMIT=limit is not None,
             PRECISION=precision, SWAP_AB=flags["gate_up"]["SWAP_AB"], PAIR_BLOCKS=pair_blocks, ACT_FP8=act_fp8,
             X_FP8=pre, **launch),
        gu, d, flags["gate_up"]["SCALE_ACC"])
    h_in, hs = act_quant(h, bi) if pre else (h, h)
    _launch_fitting(
        _down_kernel, lambda c: (nb * triton.cdiv(d, c["BLOCK_N"]),),
        (h_in, w_down, sd, rw, y, sorted_ids, block_expert, block_rows, flat_ids,
         d, i, e, nb,
         h_in.stride(0), w_down.stride(0), w_down.stride(1), *sstr(sd), y.stride(0), hs, hs.stride(0)),
        dict(BLOCK_M=bm, GROUP_M=dn["GROUP_M"], FP8=fp8, SCALE_BN=bo, SCALE_BK=bi, PRECISION=precision,
             SWAP_AB=flags["down"]["SWAP_AB"], PAIR_BLOCKS=pair_blocks, ACT_FP8=act_fp8, X_FP8=pre, **launch),
        dn, i, flags["down"]["SCALE_ACC"])
    if not reduce:
        return MoEPartials(y.view(n, top_k, d), ids, e)
    block_d = min(1024, triton.next_power_of_2(d))
    _sum_kernel[(n, triton.cdiv(d, block_d))](y, flat_ids, out, d, e, top_k, y.stride(0), out.stride(0), y, y,
                                              BLOCK_D=block_d, **launch, num_warps=4)
    return out
