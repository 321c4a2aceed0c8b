"""The per-row kernel of on-GPU sampling, `_select_kernel` (kernel 4), and the @triton.jit helpers
it shares with the launches over a (rows, splits) grid (kernels 1-3, sampling_split_kernels.py).
What they compute and how: backends.kernels.sampling's docstring; that module (the one other code
imports) holds the host side that launches them.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from .interpreter import np_sort_desc as _np_sort_desc
from .interpreter import patch_interpreter

patch_interpreter()

_KEY_LO_ALL = tl.constexpr(-2139095040)  # key(-inf) + 1: every finite z has a key >= this


# ---- elementwise helpers --------------------------------------------------------------------
@triton.jit
def _key(z):
    """Order-preserving int32 key of fp32 z (-0.0 and +0.0 share key 0)."""
    b = z.to(tl.int32, bitcast=True)
    k = tl.where(b < 0, b ^ 0x7FFFFFFF, b)
    return tl.where(k == -1, 0, k)


@triton.jit
def _unkey(k):
    b = tl.where(k < 0, k ^ 0x7FFFFFFF, k)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _div(x, t):
    """z = x / t, IEEE-rounded as torch divides (skipped when t == 1: then z = x exactly); a NaN
    logit becomes -inf, never kept, so that every pass counts and gathers the same ids."""
    if t == 1.0:
        z = x
    else:
        z = tl.math.div_rn(x, t)
    return tl.where(z == z, z, float("-inf"))


@triton.jit
def _log(v, INTERPRET: tl.constexpr):
    if INTERPRET:  # the interpreter has no libdevice
        return tl.log(v)
    else:
        return libdevice.log(v)


@triton.jit
def _params(PRM, r):
    base = PRM + r * 8
    t = tl.load(base + 0).to(tl.float32, bitcast=True)
    topp = tl.load(base + 1).to(tl.float32, bitcast=True)
    lmp = tl.load(base + 2).to(tl.float32, bitcast=True)
    k = tl.load(base + 3)
    nrow = tl.load(base + 4)
    return t, topp, lmp, k, nrow


@triton.jit
def _unfiltered(k, topp, lmp, V):
    return (k >= V) & (topp >= 1.0) & (lmp == float("-inf"))


@triton.jit
def _combine(PF, PI, r, NS, NSP: tl.constexpr):
    """Merge the per-split statistics of row r (same code, same order in every kernel)."""
    ss = tl.arange(0, NSP)
    ok = ss < NS
    base = (r * NS + ss) * 4
    ms = tl.load(PF + base, mask=ok, other=float("-inf"))
    ses = tl.load(PF + base + 1, mask=ok, other=0.0)
    bs = tl.load(PF + base + 2, mask=ok, other=float("-inf"))
    am = tl.load(PI + base, mask=ok, other=2147483647)
    nf = tl.load(PI + base + 1, mask=ok, other=0)
    bi = tl.load(PI + base + 2, mask=ok, other=2147483647)
    m = tl.max(ms, 0)
    S = tl.sum(ses * tl.exp(ms - tl.where(m == float("-inf"), 0.0, m)), 0)
    amax = tl.min(tl.where(ok & (ms == m), am, 2147483647), 0)
    nfin = tl.sum(nf, 0)
    best = tl.max(bs, 0)
    ridx = tl.min(tl.where(ok & (bs == best), bi, 2147483647), 0)
    return m, S, nfin, amax, ridx


@triton.jit
def _initial_pivots(DTAB, m, lmp, NP: tl.constexpr):
    jj = tl.arange(0, NP)
    piv = m - tl.load(DTAB + jj)
    piv = tl.where((jj == NP - 1) & (lmp > float("-inf")), m + lmp, piv)
    return _key(piv)


@triton.jit
def _count_pass(xrow, t, m, pk, c0, c1, NP: tl.constexpr, PBLOCK: tl.constexpr):
    """C[j] = #{z >= pk[j]}, M[j] = sum exp(z - m) over them, for ids in [c0, c1)."""
    C = tl.zeros([PBLOCK, NP], dtype=tl.int32)  # per lane; reduced once at the end
    M = tl.zeros([PBLOCK, NP], dtype=tl.float32)
    offs0 = tl.arange(0, PBLOCK)
    for start in range(c0, c1, PBLOCK):
        offs = start + offs0
        valid = offs < c1
        x = tl.load(xrow + offs, mask=valid, other=float("-inf"))
        z = _div(x, t)
        kz = _key(z)
        e = tl.exp(z - m)  # m is finite here: exp(-inf) = 0
        ge = kz[:, None] >= pk[None, :]
        C += ge.to(tl.int32)
        M += tl.where(ge, e[:, None], 0.0)
    return tl.sum(C, 0), tl.sum(M, 0)


@triton.jit
def _cut_params(k, topp, lmp, m, nfin):
    """The row's cuts as the select kernel applies them: (k_eff, has_k, has_p, has_m, tmin, kmin)."""
    k_eff = tl.minimum(k, nfin)
    tmin = m + lmp
    return k_eff, k_eff < nfin, topp < 1.0, lmp > float("-inf"), tmin, _key(tmin)


@triton.jit
def _pivot_table_of(PC, PM, r, NS, NSP: tl.constexpr, NP: tl.constexpr):
    """Row r's per-split pivot counts [NSP, NP] (0 past NS) and their row sums C0, M0 [NP]."""
    ss = tl.arange(0, NSP)
    jj = tl.arange(0, NP)
    pidx = (r * NS + ss)[:, None] * NP + jj[None, :]
    pok = (ss < NS)[:, None] & (jj < NP)[None, :]
    Cs = tl.load(PC + pidx, mask=pok, other=0)
    return Cs, tl.sum(Cs, 0), tl.sum(tl.load(PM + pidx, mask=pok, other=0.0), 0)


@triton.jit
def _first_phase(has_k, has_p, has_m):
    """0: the bracket of position k (for S_k, when top-k and top-p are both on); 1: the cut's
    bracket; 2: no cut at all."""
    return tl.where(has_k & has_p, 0, 1) + tl.where(has_k | has_p | has_m, 0, 2)


# ---- kernel 3 helpers ------------------------------------------------------------------------
@triton.jit
def _narrow(pk, C, M, lo, cLo, hi, cA, sA, k_eff, has_k, has_p, has_m, kmin, p_thr, count_only):
    """Shrink [lo, hi) with pivot keys pk whose counts/masses are C/M (both monotone in pk)."""
    # count_only: the bracket of position k_eff (sure = inside the top k, cut = beyond it);
    # else that of the cut. Every pivot is sure or cut (or both), so each pass narrows.
    sure = (C <= k_eff) & (count_only | (((has_p == 0) | (M < p_thr)) & ((has_m == 0) | (pk >= kmin))))
    cut = (C >= k_eff) & (count_only | has_k)
    cut = cut | ((count_only == 0) & ((has_p & (M >= p_thr)) | (has_m & (pk <= kmin))))
    cand_hi = tl.min(tl.where(sure, pk, 2147483647), 0)
    at_hi = sure & (pk == cand_hi)
    better_hi = cand_hi < hi
    new_cA = tl.where(better_hi, tl.max(tl.where(at_hi, C, 0), 0), cA)
    new_sA = tl.where(better_hi, tl.max(tl.where(at_hi, M, 0.0), 0), sA)
    new_hi = tl.where(better_hi, cand_hi, hi)
    cand_lo = tl.max(tl.where(cut, pk, -2147483647 - 1), 0)
    at_lo = cut & (pk == cand_lo)
    better_lo = cand_lo > lo
    new_cLo = tl.where(better_lo, tl.max(tl.where(at_lo, C, 0), 0), cLo)
    new_lo = tl.where(better_lo, cand_lo, lo)
    return new_lo, new_cLo, new_hi, new_cA, new_sA


@triton.jit
def _bracket(xrow, t, m, V, pk0, C0, M0, lo, cLo, hi, cA, sA, k_eff, has_k, has_p, has_m, kmin,
             p_thr, count_only, NP: tl.constexpr, PBLOCK: tl.constexpr,
             CAP: tl.constexpr, MAXIT: tl.constexpr):
    lo, cLo, hi, cA, sA = _narrow(pk0, C0, M0, lo, cLo, hi, cA, sA, k_eff, has_k, has_p, has_m,
                                  kmin, p_thr, count_only)
    jj = tl.arange(0, NP).to(tl.int64)
    it = 0
    while (cLo - cA > CAP) & (hi.to(tl.int64) - lo.to(tl.int64) > 1) & (it < MAXIT):
        span = hi.to(tl.int64) - lo.to(tl.int64)
        pk = (lo.to(tl.int64) + (span * (jj + 1)) // (NP + 1)).to(tl.int32)
        C, M = _count_pass(xrow, t, m, pk, 0, V, NP, PBLOCK)
        lo, cLo, hi, cA, sA = _narrow(pk, C, M, lo, cLo, hi, cA, sA, k_eff, has_k, has_p, has_m,
                                      kmin, p_thr, count_only)
        it += 1
    return lo, cLo, hi, cA, sA, it


@triton.jit
def _load_sorted(BUFROW, n, SIZE: tl.constexpr, INTERPRET: tl.constexpr):
    """The buffer's first n entries (n <= SIZE) sorted descending, padded with the lowest key."""
    jj = tl.arange(0, SIZE)
    keys = tl.load(BUFROW + jj, mask=jj < n, other=-9223372036854775807 - 1)
    if INTERPRET:
        return _np_sort_desc(keys)
    else:
        return tl.sort(keys, descending=True)


@triton.jit
def _sorted_buffer(BUFROW, cnt, CAP: tl.constexpr, SMALL: tl.constexpr, INTERPRET: tl.constexpr):
    """The first min(cnt, CAP) entries of a row's buffer in stable descending order: (z, key,
    id, n). Up to SMALL entries (SMALL < CAP; a decode cut's usual bracket) a SMALL-wide sort
    orders them in the buffer first: the CAP-wide sort network costs ~10x more."""
    n = tl.minimum(cnt, CAP)
    if SMALL < CAP:
        if n <= SMALL:
            few = _load_sorted(BUFROW, n, SMALL, INTERPRET)
            jj = tl.arange(0, SMALL)
            tl.debug_barrier()  # every lane has read the buffer before any writes it back
            tl.store(BUFROW + jj, few, mask=jj < n)
            tl.debug_barrier()
            ii = tl.arange(0, CAP)
            keys = tl.load(BUFROW + ii, mask=ii < n, other=-9223372036854775807 - 1)
        else:
            keys = _load_sorted(BUFROW, n, CAP, INTERPRET)
    else:
        keys = _load_sorted(BUFROW, n, CAP, INTERPRET)
    kz = (keys >> 32).to(tl.int32)
    ids = 2147483647 - keys.to(tl.int32)
    return _unkey(kz), kz, ids, n


@triton.jit
def _gather_range(xrow, t, lo, hi, BUFROW, pos0, c0, c1, BLOCK: tl.constexpr, CAP: tl.constexpr):
    """Ids in [c0, c1) with lo <= key(z) < hi into the buffer from position pos0, as int64
    (key << 32 | (2^31 - 1 - id)): sorting those descending gives the stable order. -> count."""
    offs0 = tl.arange(0, BLOCK)
    cnt = 0
    for start in range(c0, c1, BLOCK):
        offs = start + offs0
        valid = offs < c1
        x = tl.load(xrow + offs, mask=valid, other=float("-inf"))
        kz = _key(_div(x, t))
        inb = valid & (kz >= lo) & (kz < hi)
        hits = tl.sum(inb.to(tl.int32), 0)
        if hits > 0:  # most tiles hold none of a decode cut's few hundred ids: no scan there
            pos = pos0 + cnt + tl.cumsum(inb.to(tl.int32), 0) - 1
            key64 = (kz.to(tl.int64) << 32) | (2147483647 - offs).to(tl.int64)
            tl.store(BUFROW + pos, key64, mask=inb & (pos < CAP))
        cnt += hits
    return cnt


@triton.jit
def _keep_sorted(zs, n, cA, sA, Sk, m, k_eff, has_k, has_p, has_m, topp, tmin, CAP: tl.constexpr):
    """The sampler's cuts on a sorted bracket whose first element sits at position cA."""
    ii = tl.arange(0, CAP)
    valid = ii < n
    pos = cA + ii
    keep = valid & ((has_k == 0) | (pos < k_eff)) & ((has_m == 0) | (zs >= tmin))
    if has_p:
        e = tl.where(valid, tl.exp(zs - m), 0.0)
        p = e / Sk
        c = sA / Sk + tl.cumsum(p, 0)
        keep = keep & ~(((c - p) >= topp) & (pos > 0))
    return keep


@triton.jit
def _race_sorted(zs, ids, keep, erow, INTERPRET: tl.constexpr):
    eg = tl.load(erow + ids, mask=keep, other=1.0)
    sc = tl.where(keep, zs - _log(tl.maximum(eg, 1.1754943508222875e-38), INTERPRET), float("-inf"))
    best = tl.max(sc, 0)
    return tl.min(tl.where(keep & (sc == best), ids, 2147483647), 0)


@triton.jit
def _race_pass(xrow, erow, t, vkey, q, V, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    """Race over {key(z) > vkey} and the first q ids (in id order) with key(z) == vkey."""
    offs0 = tl.arange(0, BLOCK)
    bv = tl.full([BLOCK], float("-inf"), tl.float32)  # per lane; reduced once at the end
    biv = tl.full([BLOCK], 2147483647, tl.int32)
    run = 0
    for start in range(0, V, BLOCK):
        offs = start + offs0
        valid = offs < V
        x = tl.load(xrow + offs, mask=valid, other=float("-inf"))
        z = _div(x, t)
        kz = _key(z)
        kept = valid & (kz > vkey)
        if q > 0:  # the first q ids of the tie group at vkey, in id order
            eq = valid & (kz == vkey)
            rank = run + tl.cumsum(eq.to(tl.int32), 0) - 1
            kept = kept | (eq & (rank < q))
            run += tl.sum(eq.to(tl.int32), 0)
        eg = tl.load(erow + offs, mask=kept, other=1.0)
        sc = tl.where(kept, z - _log(tl.maximum(eg, 1.1754943508222875e-38), INTERPRET), float("-inf"))
        biv = tl.where(sc > bv, offs, biv)  # strictly greater: earlier tiles win ties
        bv = tl.maximum(bv, sc)
    best = tl.max(bv, 0)
    bidx = tl.min(tl.where(bv == best, biv, 2147483647), 0)
    return bidx


@triton.jit
def _threshold(kzs, keep, hi, CAP: tl.constexpr):
    """(v, q) such that {key > v} + first q of key == v is the kept prefix (bracket below hi)."""
    ii = tl.arange(0, CAP)
    last = tl.max(tl.where(keep, ii, -1), 0)
    v = tl.max(tl.where(ii == last, kzs, -2147483647 - 1), 0)
    q = tl.sum((keep & (kzs == v)).to(tl.int32), 0)
    v = tl.where(last < 0, hi - 1, v)
    q = tl.where(last < 0, 0, q)
    return v, q


# ---- the first bracket, as kernels 3 and 4 both find it -------------------------------------
@triton.jit
def _first_bracket(pk0, C0, M0, m, S, nfin, k_eff, has_k, has_p, has_m, kmin, topp, phase,
                   CAP: tl.constexpr):
    """The select kernel's first bracket as its pivots give it, before any refinement pass:
    (ready, lo, hi, n). ready: it holds at most CAP ids (the select kernel gathers it as it
    stands, from the top when everything down to lo fits), n of them in [lo, hi)."""
    top = _key(m) + 1
    zero = tl.zeros((), dtype=tl.int32)
    lo, cLo, hi, cA, sA = _narrow(pk0, C0, M0, zero + _KEY_LO_ALL, nfin, top, zero, S * 0.0, k_eff, has_k,
                                  has_p, has_m, kmin, topp * S, phase == 0)
    ready = (phase < 2) & (cLo - cA <= CAP)
    hi = tl.where(cLo <= CAP, top, hi)
    cA = tl.where(cLo <= CAP, 0, cA)
    return ready, lo, hi, cLo - cA


@triton.jit
def _bracket_record(ready, lo, hi, n):
    """The 4 int32 words the split gather leaves a row and the select kernel compares."""
    w = tl.arange(0, 4)
    return tl.where(w == 0, ready, tl.where(w == 1, lo, tl.where(w == 2, hi, n)))


# ---- kernel 4: one program per row -----------------------------------------------------------
@triton.jit
def _select_kernel(X, stride_x, PRM, E, PF, PI, DTAB, PC, PM, BUF, GOT, OUT, INFO, V, NS,
                   NSP: tl.constexpr, NP: tl.constexpr, CAP: tl.constexpr, BLOCK: tl.constexpr,
                   PBLOCK: tl.constexpr, MAXIT: tl.constexpr, INTERPRET: tl.constexpr,
                   SPLIT_GATHER: tl.constexpr, SMALL: tl.constexpr):
    """Row r's token to OUT[r]; INFO[r] = (ids kept, path bits): 1 race done by the stats
    kernel (no filter), 2 no cut (top-k at or above the finite count), 4 S_k from a gathered
    bracket, 8 S_k from a tie group larger than CAP, 16 race in the buffer, 32 final race
    pass, 64 cut inside a tie group larger than CAP, 128 the first bracket came gathered by
    `_split_gather_kernel` (SPLIT_GATHER: it ran before); bits 8-15 and 16-23 count the
    refinement passes of the top-k bracket and of the cut's bracket."""
    r = tl.program_id(0)
    t, topp, lmp, k, nrow = _params(PRM, r)
    m, S, nfin, amax, ridx = _combine(PF, PI, r, NS, NSP)
    tok = amax
    nkept = tl.minimum(nfin, 1)
    path = tl.zeros((), dtype=tl.int32)
    if (nrow >= 0) & (nfin > 0):
        if _unfiltered(k, topp, lmp, V):
            tok = ridx
            nkept = nfin
            path = path + 1
        else:
            xrow = X + r.to(tl.int64) * stride_x
            erow = E + nrow.to(tl.int64) * V
            BUFROW = BUF + r.to(tl.int64) * CAP
            k_eff, has_k, has_p, has_m, tmin, kmin = _cut_params(k, topp, lmp, m, nfin)
            pk0 = _initial_pivots(DTAB, m, lmp, NP)
            Cs, C0, M0 = _pivot_table_of(PC, PM, r, NS, NSP, NP)
            top = _key(m) + 1
            zero = tl.zeros((), dtype=tl.int32)
            Sk = S
            done = zero
            vkey = zero + (_KEY_LO_ALL - 1)  # no cut at all: race over every finite z
            q = zero
            nkept = nfin
            # phase 0: the bracket of position k_eff, for S_k (only when top-p needs it);
            # phase 1: the bracket of the cut itself. One code site each for the count passes,
            # the gather and sort, and the races (the kernel stays small to compile).
            phase = _first_phase(has_k, has_p, has_m)
            path = path | tl.where(phase >= 2, 2, 0)
            first = zero + 1
            while phase < 2:
                lo, cLo, hi, cA, sA, it = _bracket(xrow, t, m, V, pk0, C0, M0, zero + _KEY_LO_ALL, nfin,
                                                   top, zero, S * 0.0, k_eff, has_k, has_p, has_m, kmin,
                                                   topp * Sk, phase == 0, NP, PBLOCK, CAP, MAXIT)
                path = path | (it << (8 + 8 * phase))
                if cLo <= CAP:  # everything from the top fits: gather it all
                    hi = top
                    cA = zero
                    sA = S * 0.0
                if (cLo - cA <= CAP) | (hi.to(tl.int64) - lo.to(tl.int64) > 1):
                    pre = zero > 0
                    if SPLIT_GATHER:  # the first bracket, unrefined: the split kernel's, if it is the same
                        if (first == 1) & (it == 0):
                            got = tl.load(GOT + r * 4 + tl.arange(0, 4))
                            pre = tl.sum((got == _bracket_record(zero + 1, lo, hi, cLo - cA)).to(tl.int32), 0) == 4
                    if pre:
                        cnt = cLo - cA
                        path = path | 128
                    else:
                        tl.debug_barrier()  # earlier reads of the buffer (a previous gather) come first
                        cnt = _gather_range(xrow, t, lo, hi, BUFROW, 0, 0, V, BLOCK, CAP)
                        tl.debug_barrier()
                    zs, kzs, ids, n = _sorted_buffer(BUFROW, cnt, CAP, SMALL, INTERPRET)
                    if phase == 0:
                        ii = tl.arange(0, CAP)
                        e = tl.where(ii < n, tl.exp(zs - m), 0.0)
                        Sk = sA + tl.sum(tl.where(cA + ii < k_eff, e, 0.0), 0)
                        path = path | 4
                        if cA == 0:  # the whole top k is in the buffer: take the cut there too
                            phase = zero + 1
                    if phase == 1:
                        keep = _keep_sorted(zs, n, cA, sA, Sk, m, k_eff, has_k, has_p, has_m, topp, tmin, CAP)
                        nkept = cA + tl.sum(keep.to(tl.int32), 0)
                        if cA == 0:
                            tok = _race_sorted(zs, ids, keep, erow, INTERPRET)
                            path = path | 16
                            done = zero + 1
                        else:
                            vkey, q = _threshold(kzs, keep, hi, CAP)
                else:  # a tie group of more than CAP ids at the boundary: resolve it by arithmetic
                    ev = tl.exp(_unkey(lo) - m)
                    if phase == 0:
                        Sk = sA + (k_eff - cA).to(tl.float32) * ev
                        path = path | 8
                    else:
                        vkey = lo
                        q = cLo - cA
                        if has_k:
                            q = tl.minimum(q, k_eff - cA)
                        if has_p:
                            need = tl.minimum(tl.maximum((topp * Sk - sA) / ev, 0.0), 1e9)
                            first_drop = tl.math.ceil(need).to(tl.int32)
                            if cA == 0:
                                first_drop = tl.maximum(first_drop, 1)
                            q = tl.minimum(q, first_drop)
                        if has_m & (_unkey(lo) < tmin):
                            q = zero
                        nkept = cA + q
                        path = path | 64
                phase += 1
                first = zero
            if done == 0:
                tok = _race_pass(xrow, erow, t, vkey, q, V, BLOCK, INTERPRET)
                path = path | 32
    tl.store(OUT + r, tok.to(tl.int64))
    tl.store(INFO + r * 2, nkept)
    tl.store(INFO + r * 2 + 1, path)
