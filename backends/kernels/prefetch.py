"""Weights pulled into the L2 while a chain of small kernels runs (decode steps of a few rows).

A batch-1 decode step spends long stretches in kernels that touch a few KB each (norms, gates,
the mHC mix, the router, the attention's row lists): the HBM idles there, and the next weight
GEMV then streams its megabytes from HBM alone. `prefetch_l2(w)` launched at the head of such a
stretch asks the memory system for the first `max_bytes` of `w` (`prefetch.global.L2` requests,
or bulk prefetches: MODE; no register or shared-memory destination) and returns: the lines
arrive while the small kernels run, and the GEMV then reads them from the L2.

Ordering under programmatic dependent launch (pdl.py): the kernel triggers its successor first,
issues its prefetches, and only then waits for its predecessor. Weights are written by no kernel
of a step, so reading them early is safe; the successor's own wait covers this kernel, and this
kernel can only finish after its predecessor has, so the chain stays ordered transitively.
Without PDL it is an ordinary launch: one launch gap for the same overlap.

A hint only: nothing reads the prefetched lines but the later kernel's own loads, so the result
of a step does not depend on it. Not launched under the interpreter or off the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from . import pdl
from .interpreter import interpreting

# How the requests are made (bench.l2_prefetch compares them): "line", one `prefetch.global.L2`
# per 128-byte line; "sector", one per 32-byte sector; "bulk", one `cp.async.bulk.prefetch.L2`
# of PROGRAM_BYTES / threads contiguous bytes per thread (the copy engine splits it).
MODE = DEFAULT_MODE = "line"
_STEP = {"line": 128, "sector": 32}
PROGRAM_BYTES = 256 << 10  # per program (4 warps): 2048 lines, 16 line requests a thread
NUM_WARPS = 4
# At most this many bytes per call: the H200's L2 is 50 MB and the small kernels between the
# prefetch and its GEMV still use it; lines evicted before the GEMV reads them cost a second read.
MAX_BYTES = DEFAULT_MAX_BYTES = 32 << 20


@triton.jit
def _request(ptr, size, BULK: tl.constexpr):
    """One prefetch request per element: a line/sector at ptr if size > 0, or `size` bytes (BULK)."""
    if BULK:
        r = tl.inline_asm_elementwise(
            "{\n .reg .pred p;\n setp.gt.s32 p, $2, 0;\n @p cp.async.bulk.prefetch.L2.global [$1], $2;\n"
            " mov.u32 $0, 0;\n}", "=r,l,r", [ptr, size], dtype=tl.int32, is_pure=False, pack=1)
    else:
        r = tl.inline_asm_elementwise(
            "{\n .reg .pred p;\n setp.gt.s32 p, $2, 0;\n @p prefetch.global.L2 [$1];\n mov.u32 $0, 0;\n}",
            "=r,l,r", [ptr, size], dtype=tl.int32, is_pure=False, pack=1)
    return r


@triton.jit
def _segment(PTR, NBYTES, first, pid, BYTES: tl.constexpr, STEP: tl.constexpr, BULK: tl.constexpr):
    """Program pid's requests in one segment whose programs start at `first` (none outside it)."""
    offs = (pid - first).to(tl.int64) * BYTES + tl.arange(0, BYTES // STEP) * STEP
    left = tl.where(pid >= first, NBYTES - offs, 0)
    size = tl.minimum(tl.maximum(left, 0), STEP) // 16 * 16  # bulk sizes are multiples of 16
    _request(PTR + tl.where(size > 0, offs, 0), size.to(tl.int32), BULK)


@triton.jit
def _prefetch_l2_kernel(P0, N0, P1, N1, P2, N2, F1, F2, BYTES: tl.constexpr, STEP: tl.constexpr,
                        BULK: tl.constexpr, PDL: tl.constexpr = False):
    """Programs [0, F1) prefetch segment 0, [F1, F2) segment 1, [F2, grid) segment 2."""
    if PDL:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    if pid < F1:
        _segment(P0, N0, 0, pid, BYTES, STEP, BULK)
    elif pid < F2:
        _segment(P1, N1, F1, pid, BYTES, STEP, BULK)
    else:
        _segment(P2, N2, F2, pid, BYTES, STEP, BULK)
    if PDL:
        gdc_wait()


def plan(sizes: list[int], max_bytes: int | None = None) -> tuple[list[int], list[int]]:
    """Bytes per segment (the tensors' sizes, in order, within min(max_bytes, MAX_BYTES) in all)
    and the first program of each of the three segments plus the grid size: ([n0, n1, n2],
    [0, F1, F2, grid]); unused segments have 0 bytes and no programs."""
    budget = min(MAX_BYTES, MAX_BYTES if max_bytes is None else max_bytes)
    got = []
    for n in sizes:
        take = max(0, min(n, budget))
        got.append(take)
        budget -= take
    got += [0] * (3 - len(got))
    firsts = [0]
    for n in got:
        firsts.append(firsts[-1] + triton.cdiv(n, PROGRAM_BYTES))
    return got, firsts


def prefetch_l2(tensors, max_bytes: int | None = None) -> None:
    """Ask the L2 for the first bytes of up to three contiguous tensors, in order, at most
    min(max_bytes, MAX_BYTES) bytes in all (the later ones get what the earlier leave); one
    launch. A no-op off the GPU."""
    tensors = [t for t in tensors if t is not None and t.numel()]
    if not tensors or not tensors[0].is_cuda or interpreting():
        return
    assert len(tensors) <= 3, "prefetch_l2 takes at most three tensors a launch"
    assert all(t.is_contiguous() for t in tensors), "prefetch_l2 takes contiguous tensors"
    nbytes, firsts = plan([t.numel() * t.element_size() for t in tensors], max_bytes)
    if firsts[3] == 0:
        return
    ptrs = [t.view(torch.uint8) if t.dtype != torch.uint8 else t for t in tensors]
    ptrs += [ptrs[0]] * (3 - len(ptrs))
    bulk = MODE == "bulk"
    step = PROGRAM_BYTES // (32 * NUM_WARPS) if bulk else _STEP[MODE]
    _prefetch_l2_kernel[(firsts[3],)](ptrs[0], nbytes[0], ptrs[1], nbytes[1], ptrs[2], nbytes[2],
                                      firsts[1], firsts[2], BYTES=PROGRAM_BYTES, STEP=step, BULK=bulk,
                                      **pdl.launch(tensors[0].device), num_warps=NUM_WARPS)
