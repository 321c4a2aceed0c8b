"""Weights pulled into the L2 while a chain of small kernels runs (decode steps of a few rows).

A batch-1 decode step spends long stretches in kernels that touch a few KB each (norms, gates,
the mHC mix, the router, the attention's row lists): the HBM idles there, and the next weight
GEMV then streams its megabytes from HBM alone. `prefetch_l2(w)` launched at the head of such a
stretch asks the memory system for the first `max_bytes` of `w` (`prefetch.global.L2`, one
128-byte line per request, no register or shared-memory destination) and returns: the lines
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

LINE = 128            # bytes per prefetch request (an L2 line)
LINES_PER_PROGRAM = 2048  # 256 KiB per program: 16 requests per thread at 4 warps
# At most this many bytes per call: the H200's L2 is 50 MB and the small kernels between the
# prefetch and its GEMV still use it; lines evicted before the GEMV reads them cost a second read.
MAX_BYTES = 32 << 20


@triton.jit
def _prefetch_line(ptr, ok):
    return tl.inline_asm_elementwise(
        "{\n .reg .pred p;\n setp.ne.b32 p, $2, 0;\n @p prefetch.global.L2 [$1];\n mov.u32 $0, 0;\n}",
        "=r,l,r", [ptr, ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _segment(PTR, NBYTES, first, pid, LINES: tl.constexpr):
    """Program pid's lines of one segment whose programs start at `first` (none if outside it)."""
    offs = ((pid - first).to(tl.int64) * LINES + tl.arange(0, LINES)) * 128
    _prefetch_line(PTR + offs, (pid >= first) & (offs >= 0) & (offs < NBYTES))


@triton.jit
def _prefetch_l2_kernel(P0, N0, P1, N1, P2, N2, F1, F2, LINES: tl.constexpr, PDL: tl.constexpr = False):
    """Programs [0, F1) prefetch segment 0, [F1, F2) segment 1, [F2, grid) segment 2."""
    if PDL:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    if pid < F1:
        _segment(P0, N0, 0, pid, LINES)
    elif pid < F2:
        _segment(P1, N1, F1, pid, LINES)
    else:
        _segment(P2, N2, F2, pid, LINES)
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
    per = LINE * LINES_PER_PROGRAM
    firsts = [0]
    for n in got:
        firsts.append(firsts[-1] + triton.cdiv(n, per))
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
    _prefetch_l2_kernel[(firsts[3],)](ptrs[0], nbytes[0], ptrs[1], nbytes[1], ptrs[2], nbytes[2],
                                      firsts[1], firsts[2], LINES=LINES_PER_PROGRAM,
                                      **pdl.launch(tensors[0].device), num_warps=4)
