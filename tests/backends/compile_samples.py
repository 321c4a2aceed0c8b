"""Two kernels for the compile check's test: one the compiler takes (with programmatic dependent
launch too, which the interpreter never runs), and one that runs in Triton's interpreter but that
the compiler refuses (a name bound with one shape before a loop and rebound with another inside it)."""

import triton
import triton.language as tl

from backends.kernels.pdl import pdl_enter


@triton.jit
def row_max_kernel(X, OUT, n, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    cols = tl.arange(0, BLOCK)
    x = tl.load(X + cols, mask=cols < n, other=float("-inf"))
    tl.store(OUT, tl.max(x, 0))


@triton.jit
def loop_reshaped_kernel(X, OUT, n, BLOCK: tl.constexpr, SMALL: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    x = tl.load(X + cols, mask=cols < n, other=0.0)
    hit = tl.arange(0, SMALL) == 0
    total = tl.sum(tl.where(hit, 1.0, 0.0), 0)
    for j in range(2):
        hit = cols == j
        total += tl.sum(tl.where(hit, x, 0.0), 0)
    tl.store(OUT, total)
