"""The fused MoE's expert alignment (backends/kernels/fused_moe.py, step 1): the M = N·top_k
(token, slot) pairs grouped by expert, each expert's group padded to a multiple of BLOCK_M, so
that every BLOCK_M-row block of the sorted list belongs to one expert and the grouped GEMMs can
take one expert's weights per block.

Up to ONE_LAUNCH_MAX_PAIRS pairs (decode) it is one launch of cdiv(E, ALIGN_EXPERTS_PER_PROGRAM)
programs: every program histograms all M ids itself (M is small), so it knows every expert's
padded start without waiting on another program, and places the pairs and blocks of its own few
experts (a cumsum over the ids per expert gives each pair's rank). Above, three launches:

    COUNT     per chunk of CHUNK pairs: a histogram over experts       -> counts [C, EB]
    SCAN      one program: totals, padded exclusive prefix over experts, per-(chunk, expert)
              base offsets, and the block table: expert of each block (-1 past the end) and
              its number of real rows (padding rows are never read or written)
    SCATTER   per chunk: rank of each pair among the same expert's pairs of the chunk (a
              CHUNK x CHUNK comparison), sorted[base + rank] = flat pair index

The order inside an expert is the token order, so the layout is deterministic (and a row's
result does not depend on the other rows of its block anyway). Blocks: at most M // BLOCK_M +
min(M, E) (each non-empty expert wastes < one block), which for decode (N=1, top-8) is 8 blocks
rather than the usual (M + E·(BLOCK_M-1)) / BLOCK_M. Every size is an upper bound computed from
(M, E, BLOCK_M): no host sync, so the alignment can be captured in a CUDA graph. Expert ids
outside [0, E) are dropped (never placed).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .interpreter import patch_interpreter
from .pdl import pdl_enter

patch_interpreter()

CHUNK = 128                  # pairs per alignment chunk (the rank step compares CHUNK x CHUNK)
ONE_LAUNCH_MAX_PAIRS = 1024  # up to this many (token, slot) pairs the alignment is one launch
# Experts per program of the one-launch alignment: 36 programs at E = 288. (The previous
# one-launch form ran the three steps in ONE program with barriers between: 132 µs of the fp8
# batch-64 step on the H200, 4 MoE layers; kept as mode "one-program" for the side-by-side bench.)
ALIGN_EXPERTS_PER_PROGRAM = 8
ALIGN_MODES = ("parallel", "one-program", "three-launch")
SMALL_ALIGN_MODE = "parallel"  # the one-launch form up to ONE_LAUNCH_MAX_PAIRS (benches flip it)


def max_blocks(m: int, num_experts: int, block_m: int) -> int:
    """Upper bound on the BLOCK_M blocks of the aligned list for m pairs (no data needed)."""
    return max(1, min(m // block_m + min(m, num_experts), triton.cdiv(m + num_experts * (block_m - 1), block_m)))


@triton.jit
def _store_blocks(BLOCK_EXPERT, BLOCK_ROWS, bstart, nblk, jmax, expert, count, BLOCK_M: tl.constexpr):
    """Block table entries of some experts: expert i's blocks are bstart[i] .. + nblk[i], each with
    its real rows (the last one partial). jmax = max(nblk), reduced by the caller (the interpreter
    cannot run reductions inside a nested helper; see _align_kernel)."""
    for j in range(0, jmax):
        has = j < nblk
        tl.store(BLOCK_EXPERT + bstart + j, expert, mask=has)
        tl.store(BLOCK_ROWS + bstart + j, tl.minimum(count - j * BLOCK_M, BLOCK_M), mask=has)


# Sizes that change with the batch are not specialised on (no recompile per token count).
@triton.jit(do_not_specialize=["M", "C", "NUM_BLOCKS"])
def _align_kernel(IDS, COUNTS, BASE, SORTED, BLOCK_EXPERT, BLOCK_ROWS, M, C, E, NUM_BLOCKS,
                  BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, EB: tl.constexpr, CB: tl.constexpr,
                  BB: tl.constexpr, COUNT: tl.constexpr, SCAN: tl.constexpr, SCATTER: tl.constexpr,
                  PDL: tl.constexpr = False):
    """The alignment steps selected by COUNT / SCAN / SCATTER. Alone, COUNT and SCATTER take one
    chunk per program; with SCAN (one program) they loop over every chunk, and the scratch one
    step writes is read by other threads of the block in the next: a barrier between.
    (One kernel with flags rather than @jit helpers: Triton's interpreter cannot run nested
    helpers that call tl.sum & co when triton was imported before TRITON_INTERPRET was set.)"""
    pdl_enter(PDL)
    if SCAN:
        c_lo = 0
        c_hi = C
    else:
        c_lo = tl.program_id(0)
        c_hi = c_lo + 1
    loc = tl.arange(0, CHUNK)
    offs_e = tl.arange(0, EB)
    if COUNT:  # per chunk: histogram over experts (dropped ids and padding -> dummy bin E < EB)
        for c in range(c_lo, c_hi):
            offs = c * CHUNK + loc
            ids = tl.load(IDS + offs, mask=offs < M, other=-1).to(tl.int32)
            ids = tl.where((ids >= 0) & (ids < E), ids, E)
            tl.store(COUNTS + c * EB + offs_e, tl.histogram(ids, EB))
    if COUNT and SCAN:
        tl.debug_barrier()
    if SCAN:
        e_ok = offs_e < E
        offs_c = tl.arange(0, CB)
        totals = tl.full([EB], 0, dtype=tl.int32)
        for c0 in range(0, C, CB):
            cc = c0 + offs_c
            ok = (cc < C)[:, None] & e_ok[None, :]
            t = tl.load(COUNTS + cc[:, None] * EB + offs_e[None, :], mask=ok, other=0)
            totals += tl.sum(t, axis=0)
        padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        pend = tl.cumsum(padded, axis=0)
        pstart = pend - padded
        # base[c, e] = start of expert e + pairs of e in chunks before c
        carry = pstart
        for c0 in range(0, C, CB):
            cc = c0 + offs_c
            ok = (cc < C)[:, None] & e_ok[None, :]
            t = tl.load(COUNTS + cc[:, None] * EB + offs_e[None, :], mask=ok, other=0)
            tl.store(BASE + cc[:, None] * EB + offs_e[None, :], carry[None, :] + tl.cumsum(t, axis=0) - t, mask=ok)
            carry += tl.sum(t, axis=0)
        # block table, expert-major: the j-th block of every expert in one store per j (j up to
        # the largest expert's block count: 1-2 at decode), then the unused tail. (Testing every
        # block against every expert took NUM_BLOCKS/BB dependent [BB, EB] passes, ~290 blocks
        # worst case at decode: 13-71 µs a call on the H200.)
        nblk = tl.where(e_ok, padded // BLOCK_M, 0)
        _store_blocks(BLOCK_EXPERT, BLOCK_ROWS, pstart // BLOCK_M, nblk, tl.max(nblk, axis=0), offs_e, totals,
                      BLOCK_M)
        offs_b = tl.arange(0, BB)
        for b0 in range(tl.sum(nblk, axis=0), NUM_BLOCKS, BB):
            bb = b0 + offs_b
            b_ok = bb < NUM_BLOCKS
            tl.store(BLOCK_EXPERT + bb, tl.full([BB], -1, dtype=tl.int32), mask=b_ok)
            tl.store(BLOCK_ROWS + bb, tl.zeros([BB], dtype=tl.int32), mask=b_ok)
    if SCAN and SCATTER:
        tl.debug_barrier()
    if SCATTER:  # per chunk: rank among the chunk's earlier pairs of the same expert
        for c in range(c_lo, c_hi):
            offs = c * CHUNK + loc
            ok = offs < M
            ids = tl.load(IDS + offs, mask=ok, other=-1).to(tl.int32)
            ok = ok & (ids >= 0) & (ids < E)
            ids = tl.where(ok, ids, E)
            same = (ids[:, None] == ids[None, :]) & (loc[None, :] < loc[:, None])
            rank = tl.sum(same.to(tl.int32), axis=1)
            base = tl.load(BASE + c * EB + ids, mask=ok, other=0)
            tl.store(SORTED + base + rank, offs, mask=ok)


@triton.jit(do_not_specialize=["M", "E", "NUM_BLOCKS", "G"])
def _align_parallel_kernel(IDS, SORTED, BLOCK_EXPERT, BLOCK_ROWS, M, E, NUM_BLOCKS, G,
                           BLOCK_M: tl.constexpr, MB: tl.constexpr, EB: tl.constexpr, EPP: tl.constexpr,
                           BB: tl.constexpr, PDL: tl.constexpr = False):
    """The whole alignment of M <= MB pairs in one launch: program p places experts
    [p·EPP, (p+1)·EPP). Each program histograms all ids (the same answer in every program), so
    expert e's start, the padded sizes of the experts before it, needs no other program; a
    pair's rank in its expert is the cumsum of (ids == e) up to it: token order, as the
    three-launch path gives. Blocks past the last used one are cleared grid-stride."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    offs = tl.arange(0, MB)
    ids = tl.load(IDS + offs, mask=offs < M, other=-1).to(tl.int32)
    ids = tl.where((ids >= 0) & (ids < E), ids, E)  # dropped ids and padding -> bin E (not an expert)
    offs_e = tl.arange(0, EB)
    totals = tl.where(offs_e < E, tl.histogram(ids, EB), 0)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    used = tl.sum(padded, axis=0) // BLOCK_M
    mine = pid * EPP + tl.arange(0, EPP)
    start = tl.sum(tl.where(offs_e[None, :] < mine[:, None], padded[None, :], 0), axis=1)
    count = tl.sum(tl.where(offs_e[None, :] == mine[:, None], totals[None, :], 0), axis=1)  # 0 past E
    match = (ids[None, :] == mine[:, None]) & (mine < E)[:, None]
    rank = tl.cumsum(match.to(tl.int32), axis=1) - 1
    tl.store(SORTED + start[:, None] + rank, offs[None, :], mask=match)
    nblk = (count + BLOCK_M - 1) // BLOCK_M
    _store_blocks(BLOCK_EXPERT, BLOCK_ROWS, start // BLOCK_M, nblk, tl.max(nblk, axis=0), mine, count, BLOCK_M)
    offs_b = tl.arange(0, BB)
    for b0 in range(pid * BB, NUM_BLOCKS, G * BB):
        bb = b0 + offs_b
        tail = (bb >= used) & (bb < NUM_BLOCKS)
        tl.store(BLOCK_EXPERT + bb, tl.full([BB], -1, dtype=tl.int32), mask=tail)
        tl.store(BLOCK_ROWS + bb, tl.zeros([BB], dtype=tl.int32), mask=tail)


def moe_align(ids: torch.Tensor, num_experts: int, block_m: int, *, mode: str | None = None):
    """Group the (token, slot) pairs of ids [N, k] by expert in BLOCK_M blocks, on the device.

    Returns (sorted [num_blocks·BLOCK_M] int32 flat pair indices, block_expert [num_blocks]
    int32 (-1: unused block), block_rows [num_blocks] int32 real rows per block). Entries of
    `sorted` past a block's real rows are never written (nor read by the GEMMs). Up to
    ONE_LAUNCH_MAX_PAIRS pairs (decode) the mode is SMALL_ALIGN_MODE (one launch), else
    "three-launch"; `mode` forces one of ALIGN_MODES (all three give the same layout)."""
    flat = ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    m = flat.numel()
    dev = ids.device
    eb = triton.next_power_of_2(num_experts + 1)
    c = triton.cdiv(m, CHUNK)
    nb = max_blocks(m, num_experts, block_m)
    sorted_ids = torch.empty(nb * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(nb, dtype=torch.int32, device=dev)
    block_rows = torch.empty(nb, dtype=torch.int32, device=dev)
    if mode is None:
        mode = SMALL_ALIGN_MODE if m <= ONE_LAUNCH_MAX_PAIRS else "three-launch"
    if mode not in ALIGN_MODES or (mode != "three-launch" and m > ONE_LAUNCH_MAX_PAIRS):
        raise ValueError(f"alignment mode {mode!r} for {m} pairs (modes {ALIGN_MODES}, "
                         f"one launch up to {ONE_LAUNCH_MAX_PAIRS} pairs)")
    if mode == "parallel":
        g = triton.cdiv(num_experts, ALIGN_EXPERTS_PER_PROGRAM)
        _align_parallel_kernel[(g,)](flat, sorted_ids, block_expert, block_rows, m, num_experts, nb, g,
                                     BLOCK_M=block_m, MB=max(16, triton.next_power_of_2(m)), EB=eb,
                                     EPP=ALIGN_EXPERTS_PER_PROGRAM, BB=16, **pdl.launch(dev), num_warps=4)
        return sorted_ids, block_expert, block_rows
    counts = torch.empty(c, eb, dtype=torch.int32, device=dev)
    base = torch.empty(c, eb, dtype=torch.int32, device=dev)
    tile = max(1, min(32, 8192 // eb))  # rows of the [tile, EB] int32 tiles of the scan
    args = (flat, counts, base, sorted_ids, block_expert, block_rows, m, c, num_experts, nb)
    meta = dict(BLOCK_M=block_m, CHUNK=CHUNK, EB=eb, CB=tile, BB=1024, **pdl.launch(dev))
    if mode == "one-program":
        _align_kernel[(1,)](*args, **meta, COUNT=True, SCAN=True, SCATTER=True, num_warps=8)
    else:
        _align_kernel[(c,)](*args, **meta, COUNT=True, SCAN=False, SCATTER=False, num_warps=4)
        _align_kernel[(1,)](*args, **meta, COUNT=False, SCAN=True, SCATTER=False, num_warps=8)
        _align_kernel[(c,)](*args, **meta, COUNT=False, SCAN=False, SCATTER=True, num_warps=4)
    return sorted_ids, block_expert, block_rows
