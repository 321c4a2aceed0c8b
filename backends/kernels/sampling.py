"""On-GPU sampling for glmrt.engine.sampler: greedy, temperature, top-k, top-p, min-p and the
exponential race, without sorting the vocabulary.

What it computes (the torch sampler's `_filter` + race, row by row, all in fp32):

    z = x / T                                  (IEEE division as torch's: `div_rn`; z = x at T = 1)
    keep the first k of the stable descending order of z (ties: lower id first), then
    the shortest prefix of that order whose top-k-renormalised mass reaches top_p
    (position i is dropped iff cumsum(p)_i - p_i >= top_p; position 0 never), then
    drop z < max(z) + log(min_p);
    token = argmax over the kept ids of z - log(max(E, tiny))    (first maximum on ties)

and for greedy rows (noise_row < 0) the first argmax of x. Same kept set as the sort-based
sampler (exactly for top-k and min-p, whose cuts are on exact counts and values; top-p up to
the rounding of the two mass sums, which already differs between torch's CPU and GPU), same
noise, same score arithmetic (`libdevice.log` on the GPU is CUDA's `logf`, what torch uses),
so given the same exponentials the token is the same. A NaN logit is read as -inf (never kept).

Noise: the exponentials come in as a tensor E [NE, V] drawn by the caller exactly as the
torch sampler draws them (one batched `exponential_()` for unseeded rows, V draws from each
seeded row's own generator), and `noise_row` maps a row to its E row. That keeps the
sampler's contract unchanged: a seeded row consumes exactly V exponentials of its generator
and its token depends only on its logits row and its generator, so the same seed gives the
same tokens in any batch, on either sampler path. (An in-kernel Philox keyed by seed and
step would save the 4*B*V-byte noise write and the per-seeded-row launches, but would change
which token a given seed produces; not done.)

How, per row, with no sort of V:

1. `_stats_kernel`, grid (B, NS), NS = cdiv(V, chunk) splits of a row: per split the max of
   z, its first id, sum exp(z - max), the number of finite z, and, for rows with no filter
   at all, the partial race winner (they are done after this pass).
2. `_pivot_kernel`, grid (B, NS): NP = 16 thresholds t_j = max - d_j (d: PIVOT_OFFSETS, in
   nats; the last one is max + log(min_p) when min-p is on) and, per split, the count
   C(t) = #{z >= t} and mass M(t) = sum_{z >= t} exp(z - max) at each.
3. `_split_gather_kernel`, grid (B, NS): when the pivots alone bracket the row's first cut to
   at most CAP ids (no refinement pass; the usual decode settings), each split writes its ids
   of that bracket into the row's buffer, at the offset its predecessors' pivot counts give.
4. `_select_kernel`, one program per row. Thresholds are compared as order-preserving int32
   keys of z (-0 folded onto +0). A bracket [lo, hi) is kept: everything >= hi is surely
   kept (count cA, mass sA), everything < lo surely dropped; from the pivots it takes the
   narrowest bracket, then, while the bracket holds more than CAP elements, full-row passes
   with NP pivots spread over the key interval narrow it (at most 8 with 16 pivots: 2^32
   keys / 17^8 < 1). The bracket's elements are gathered (by kernel 3 when it could, else
   here by a pass over the row) into a per-row scratch buffer as int64 (key << 32 |
   (2^31 - 1 - id)) and sorted there (`tl.sort` of CAP elements, or of SMALL_SORT when the
   bracket holds no more), which is exactly the stable order; the exact cuts are taken on
   them. If everything kept lies in the buffer the race runs there (E gathered at the kept
   ids); otherwise a last full pass races over {key > v} plus the first q ids (in id order)
   of the tie group at v.
   With top-k and top-p both on, top-p needs the top-k mass S_k first: a count-only
   bracket for position k is resolved the same way (and when it already holds all of the
   top k, as for the usual small k, the top-p cut is taken in that same buffer).
   A tie group larger than CAP at a boundary is cut by arithmetic (counts and masses) and
   resolved in id order by the last pass. Every pivot is "sure" or "cut" (the two tests
   are complements), so each pass shrinks the key interval 17-fold and the bracket always
   converges; top-p decisions near the boundary differ from torch's only by the rounding
   of the mass sums (pivot sums vs the buffer's cumsum vs torch's cumsum).

The streaming loops keep per-lane accumulators and reduce across the program once at the
end (no cross-thread reduction per tile). Path taken per row is reported in `info`.

Batch independence: every reduction is row-local, the split boundaries depend on V only
(never on B), and the launch configuration is fixed, so a row's token does not depend on
the other rows (the split gather's offsets come from counts, not from arrival order). No host
synchronisation: four launches and device-side loops only.

Cost: three full reads of x in (B, NS) programs (stats, pivots, the gather), then, in one
program per row, a sort of the buffer, plus a full-row pass per refinement, a gather pass when
the pivots did not bracket the cut, and a final race pass when the kept set outgrows the buffer
(typical decode settings: the sort only), plus E read at kept ids only. One program reading a
whole 154880-id row was latency-bound at ~250 us, whatever the batch; the split gather reads it
in NS programs.
The floor for B=128, V=154880 is 79 MB of logits read once, 19 us at 4.09 TB/s; the
exponentials that the sampler contract draws add a 79 MB write before the kernels.

The kernels are in backends/kernels/sampling_split_kernels.py (1-3) and sampling_kernels.py (4,
and the helpers); this module holds the host side.
"""

from __future__ import annotations

import torch
import triton

from .interpreter import INTERPRET as _INTERPRET
from .sampling_kernels import _select_kernel
from .sampling_split_kernels import _pivot_kernel, _split_gather_kernel, _stats_kernel

NUM_PIVOTS = 16
# Offsets below the row maximum, in nats of z = x / T, of the first pass's thresholds.
PIVOT_OFFSETS = (0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0, 12.0, 16.0, 24.0, 32.0)
DEFAULT_CAPACITY = 4096  # elements sorted in registers per row
DEFAULT_CHUNK = 8192  # split size of the two batched passes (a function of V only)
SMALL_SORT = 512  # brackets of at most this many ids take a sort this wide (>= the capacity: never)
NUM_PARAMS = 8  # int32 words per row in the packed parameter tensor
_MAX_REFINE = 12
# The first bracket gathered by (B, NS) programs before the select kernel (a fourth launch), or,
# False, by the select kernel's one program per row reading the whole row (benches time both).
SPLIT_GATHER = True


# ---- host side -------------------------------------------------------------------------------
_DTAB_CACHE: dict[torch.device, torch.Tensor] = {}


def _pivot_table(device: torch.device) -> torch.Tensor:
    tab = _DTAB_CACHE.get(device)
    if tab is None:
        tab = torch.tensor(PIVOT_OFFSETS, dtype=torch.float32).to(device)
        _DTAB_CACHE[device] = tab
    return tab


def pack_params(temperature: list[float], top_k: list[int], top_p: list[float], min_p: list[float],
                noise_row: list[int], vocab: int) -> torch.Tensor:
    """The per-row parameters as one CPU int32 tensor [B, 8] (floats bit-cast), for one upload.

    Values as the torch sampler uses them: temperature max(T, 1e-5) in fp32; top_k k if
    0 < k < V else V (off); top_p p if p < 1 else 2 (off); log(min_p) in fp32, -inf when off;
    noise_row the row of E holding this row's exponentials, -1 for a greedy row (whose
    temperature should be 1 so that z = x: greedy takes the first argmax of x).
    """
    import math

    f = torch.tensor([[t, p if p < 1.0 else 2.0, math.log(mp) if mp > 0 else float("-inf")]
                      for t, p, mp in zip(temperature, top_p, min_p)], dtype=torch.float32).reshape(-1, 3)
    i = torch.tensor([[k if 0 < k < vocab else vocab, nr, 0, 0, 0] for k, nr in zip(top_k, noise_row)],
                     dtype=torch.int32).reshape(-1, 5)
    return torch.cat([f.view(torch.int32), i], dim=1)


def default_tiles(vocab: int, chunk: int, interpreted: bool = _INTERPRET) -> dict:
    """`sample`'s tile sizes and warps: the GPU's, or under Triton's interpreter (numpy per op)
    fewer, larger tiles. The tests run the GPU's tiles in the interpreter too, so that the suite's
    compile check builds the variants a GPU launches."""
    if interpreted:
        return dict(dict.fromkeys(("block", "pblock", "sblock", "spblock"),
                                  max(16, min(8192, triton.next_power_of_2(vocab)))), warps=4,
                    split_gather=SPLIT_GATHER, small_sort=SMALL_SORT)
    return dict(block=1024, pblock=256, sblock=min(1024, triton.next_power_of_2(chunk)),
                spblock=min(256, triton.next_power_of_2(chunk)), warps=8,
                split_gather=SPLIT_GATHER, small_sort=SMALL_SORT)


def sample(x: torch.Tensor, params: torch.Tensor, noise: torch.Tensor | None, *,
           capacity: int = DEFAULT_CAPACITY, chunk: int = DEFAULT_CHUNK, out: torch.Tensor | None = None,
           info: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """Tokens [B] (int64, on x's device) for fp32 logits x [B, V] (unit stride along V).

    `params`: int32 [B, 8] from `pack_params`, on x's device. `noise`: fp32 [NE, V] Exp(1)
    draws (contiguous; row `noise_row` of each sampled row), or None when every row is
    greedy. `capacity` (a power of two: the sort size per row) and `chunk` (split size of
    the batched passes) are tuning knobs that change nothing but top-p's rounding; `config`
    overrides the tile sizes and warps ({"block", "pblock", "sblock", "spblock", "warps"}) and
    "split_gather" (bool, default SPLIT_GATHER: the fourth launch, kernel 3) and "small_sort"
    (default SMALL_SORT: the width of the sort of small brackets; >= capacity: none).
    `out` (int64 [B]) receives the tokens; `info` (int32 [B, 2]), if given, the number of
    ids each row kept and the paths its select program took (bits: see `_select_kernel`).
    Four launches, no host synchronisation.
    """
    if x.dim() != 2 or x.dtype != torch.float32 or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError("x must be fp32 [B, V] with unit stride along V")
    B, V = x.shape
    if out is None:
        out = torch.empty(B, dtype=torch.long, device=x.device)
    if B == 0:
        return out
    if capacity & (capacity - 1) or capacity < 16:
        raise ValueError("capacity must be a power of two >= 16")
    if noise is not None and (noise.dtype != torch.float32 or not noise.is_contiguous() or noise.shape[1] != V):
        raise ValueError("noise must be a contiguous fp32 [NE, V] tensor")
    ns = triton.cdiv(V, chunk)
    nsp = triton.next_power_of_2(ns)
    dev = x.device
    pf = torch.empty(B, ns, 4, dtype=torch.float32, device=dev)
    pi = torch.empty(B, ns, 4, dtype=torch.int32, device=dev)
    pc = torch.empty(B, ns, NUM_PIVOTS, dtype=torch.int32, device=dev)
    pm = torch.empty(B, ns, NUM_PIVOTS, dtype=torch.float32, device=dev)
    buf = torch.empty(B, capacity, dtype=torch.int64, device=dev)
    got = torch.empty(B, 4, dtype=torch.int32, device=dev)
    if info is None:
        info = torch.empty(B, 2, dtype=torch.int32, device=dev)
    e = noise if noise is not None else x
    dtab = _pivot_table(dev)
    stride_x = x.stride(0)
    cfg = {**default_tiles(V, chunk), **(config or {})}
    _stats_kernel[(B, ns)](x, stride_x, params, e, pf, pi, V, chunk,
                           BLOCK=cfg["sblock"], INTERPRET=_INTERPRET, num_warps=cfg["warps"])
    _pivot_kernel[(B, ns)](x, stride_x, params, pf, pi, dtab, pc, pm, V, chunk,
                           NSP=nsp, NP=NUM_PIVOTS, PBLOCK=cfg["spblock"], num_warps=cfg["warps"])
    split_gather = bool(cfg["split_gather"])
    if split_gather:
        _split_gather_kernel[(B, ns)](x, stride_x, params, pf, pi, dtab, pc, pm, buf, got, V, chunk,
                                      NSP=nsp, NP=NUM_PIVOTS, CAP=capacity, BLOCK=cfg["sblock"],
                                      num_warps=cfg["warps"])
    _select_kernel[(B,)](x, stride_x, params, e, pf, pi, dtab, pc, pm, buf, got, out, info, V, ns,
                         NSP=nsp, NP=NUM_PIVOTS, CAP=capacity, BLOCK=cfg["block"], PBLOCK=cfg["pblock"],
                         MAXIT=_MAX_REFINE, INTERPRET=_INTERPRET, SPLIT_GATHER=split_gather,
                         SMALL=triton.next_power_of_2(max(1, min(int(cfg["small_sort"]), capacity))),
                         num_warps=cfg["warps"])
    return out
