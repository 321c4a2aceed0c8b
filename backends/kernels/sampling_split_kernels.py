"""The sampler's launches over a (rows, splits) grid: `_stats_kernel` (kernel 1), `_pivot_kernel`
(kernel 2) and `_split_gather_kernel` (kernel 3). Their @triton.jit helpers, shared with the
per-row `_select_kernel`, are in sampling_kernels.py; what they compute and how:
backends.kernels.sampling's docstring.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .interpreter import patch_interpreter
from .sampling_kernels import (_KEY_LO_ALL, _bracket_record, _combine, _count_pass, _cut_params, _div,
                               _first_bracket, _first_phase, _gather_range, _initial_pivots, _key, _log,
                               _params, _pivot_table_of, _unfiltered)

patch_interpreter()


# ---- kernel 1: per-split statistics (+ the whole race for unfiltered rows) -------------------
@triton.jit
def _stats_kernel(X, stride_x, PRM, E, PF, PI, V, CHUNK,
                  BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    r = tl.program_id(0)
    s = tl.program_id(1)
    NS = tl.num_programs(1)
    t, topp, lmp, k, nrow = _params(PRM, r)
    race = (nrow >= 0) & _unfiltered(k, topp, lmp, V)
    xrow = X + r.to(tl.int64) * stride_x
    erow = E + tl.maximum(nrow, 0).to(tl.int64) * V
    c0 = s * CHUNK
    c1 = tl.minimum(c0 + CHUNK, V)
    offs0 = tl.arange(0, BLOCK)
    # per lane: running max, sum exp(z - max), first id of the max, finite count, race winner
    mv = tl.full([BLOCK], float("-inf"), tl.float32)
    sev = tl.zeros([BLOCK], dtype=tl.float32)
    iv = tl.full([BLOCK], 2147483647, tl.int32)
    nv = tl.zeros([BLOCK], dtype=tl.int32)
    bv = tl.full([BLOCK], float("-inf"), tl.float32)
    biv = tl.full([BLOCK], 2147483647, tl.int32)
    for start in range(c0, c1, BLOCK):
        offs = start + offs0
        valid = offs < c1
        x = tl.load(xrow + offs, mask=valid, other=float("-inf"))
        z = _div(x, t)
        iv = tl.where((z > mv) | (valid & (iv == 2147483647)), offs, iv)  # earlier tiles win ties
        hi = tl.maximum(mv, z)
        lo = tl.minimum(mv, z)
        d = tl.exp(lo - tl.where(hi == float("-inf"), 0.0, hi))  # exp(-|z - m|), 0 for -inf
        sev = tl.where(z > mv, sev * d + 1.0, sev + d)
        mv = hi
        nv += (z > float("-inf")).to(tl.int32)
        if race:
            eg = tl.load(erow + offs, mask=valid, other=1.0)
            sc = tl.where(valid, z - _log(tl.maximum(eg, 1.1754943508222875e-38), INTERPRET), float("-inf"))
            biv = tl.where((sc > bv) | (valid & (biv == 2147483647)), offs, biv)
            bv = tl.maximum(bv, sc)
    m = tl.max(mv, 0)
    se = tl.sum(sev * tl.exp(mv - tl.where(m == float("-inf"), 0.0, m)), 0)
    amax = tl.min(tl.where(mv == m, iv, 2147483647), 0)
    nfin = tl.sum(nv, 0)
    best = tl.max(bv, 0)
    bidx = tl.min(tl.where(bv == best, biv, 2147483647), 0)
    base = (r * NS + s) * 4
    tl.store(PF + base, m)
    tl.store(PF + base + 1, se)
    tl.store(PF + base + 2, best)
    tl.store(PI + base, amax)
    tl.store(PI + base + 1, nfin)
    tl.store(PI + base + 2, bidx)


# ---- kernel 2: counts and masses at the first pivots, per split ------------------------------
@triton.jit
def _split_row(PRM, PF, PI, V, NSP: tl.constexpr):
    """Program (r, s) of a (B, NS) launch after the stats: (r, s, NS, t, topp, lmp, k, m, S,
    nfin, go), go when row r is sampled with a cut and has a finite logit."""
    r = tl.program_id(0)
    s = tl.program_id(1)
    NS = tl.num_programs(1)
    t, topp, lmp, k, nrow = _params(PRM, r)
    m, S, nfin, amax, ridx = _combine(PF, PI, r, NS, NSP)
    go = (nrow >= 0) & (_unfiltered(k, topp, lmp, V) == 0) & (nfin > 0)
    return r, s, NS, t, topp, lmp, k, m, S, nfin, go


@triton.jit
def _pivot_kernel(X, stride_x, PRM, PF, PI, DTAB, PC, PM, V, CHUNK,
                  NSP: tl.constexpr, NP: tl.constexpr, PBLOCK: tl.constexpr):
    r, s, NS, t, topp, lmp, k, m, S, nfin, go = _split_row(PRM, PF, PI, V, NSP)
    if go:
        pk = _initial_pivots(DTAB, m, lmp, NP)
        c0 = s * CHUNK
        C, M = _count_pass(X + r.to(tl.int64) * stride_x, t, m, pk, c0, tl.minimum(c0 + CHUNK, V), NP, PBLOCK)
        jj = tl.arange(0, NP)
        tl.store(PC + (r * NS + s) * NP + jj, C)
        tl.store(PM + (r * NS + s) * NP + jj, M)


# ---- kernel 3: the first bracket gathered split by split ------------------------------------
@triton.jit
def _split_gather_kernel(X, stride_x, PRM, PF, PI, DTAB, PC, PM, BUF, GOT, V, CHUNK,
                         NSP: tl.constexpr, NP: tl.constexpr, CAP: tl.constexpr, BLOCK: tl.constexpr):
    """Split s of row r writes its ids of the row's first bracket into the row's buffer, at the
    position the splits before it fill up to (their counts at the bracket's two pivots), when
    that bracket needs no refinement: the select kernel then sorts the buffer instead of
    reading the whole row in one program. Split 0 records (gathered, lo, hi, n) in GOT[r]: the
    select kernel reads the buffer only for the very bracket it finds itself (its sums of the
    same pivot masses are another kernel's reductions)."""
    r, s, NS, t, topp, lmp, k, m, S, nfin, go = _split_row(PRM, PF, PI, V, NSP)
    zero = tl.zeros((), dtype=tl.int32)
    ready, lo, hi, n = zero, zero, zero, zero - 1
    if go:
        k_eff, has_k, has_p, has_m, tmin, kmin = _cut_params(k, topp, lmp, m, nfin)
        pk0 = _initial_pivots(DTAB, m, lmp, NP)
        Cs, C0, M0 = _pivot_table_of(PC, PM, r, NS, NSP, NP)
        fits, lo, hi, n = _first_bracket(pk0, C0, M0, m, S, nfin, k_eff, has_k, has_p, has_m, kmin, topp,
                                         _first_phase(has_k, has_p, has_m), CAP)
        ready = fits.to(tl.int32)
        if fits:
            # lo is a pivot or below every finite z; hi a pivot or above the maximum: each
            # split's count in [lo, hi) is its count at lo less its count at hi
            ss = tl.arange(0, NSP)
            nf = tl.load(PI + (r * NS + ss) * 4 + 1, mask=ss < NS, other=0)
            at_lo = tl.max(tl.where(pk0[None, :] == lo, Cs, 0), 1)
            at_hi = tl.max(tl.where(pk0[None, :] == hi, Cs, 0), 1)
            cnt = tl.where(lo == _KEY_LO_ALL, nf, at_lo) - tl.where(hi == _key(m) + 1, 0, at_hi)
            pos0 = tl.sum(tl.where(ss < s, cnt, 0), 0)
            c0 = s * CHUNK
            _gather_range(X + r.to(tl.int64) * stride_x, t, lo, hi, BUF + r.to(tl.int64) * CAP, pos0,
                          c0, tl.minimum(c0 + CHUNK, V), BLOCK, CAP)
    if s == 0:
        tl.store(GOT + r * 4 + tl.arange(0, 4), _bracket_record(ready, lo, hi, n))
