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
so given the same exponentials the token is the same.

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
3. `_select_kernel`, one program per row. Thresholds are compared as order-preserving int32
   keys of z (-0 folded onto +0). A bracket [lo, hi) is kept: everything >= hi is surely
   kept (count cA, mass sA), everything < lo surely dropped; from the pivots it takes the
   narrowest bracket, then, while the bracket holds more than CAP elements, full-row passes
   with NP pivots spread over the key interval narrow it (at most 8 with 16 pivots: 2^32
   keys / 17^8 < 1). The bracket's elements are gathered into a per-row scratch buffer as
   int64 (key << 32 | (2^31 - 1 - id)) and sorted there (`tl.sort`, CAP elements), which is
   exactly the stable order; the exact cuts are taken on them. If everything kept lies in
   the buffer the race runs there (E gathered at the kept ids); otherwise a last full pass
   races over {key > v} plus the first q ids (in id order) of the tie group at v.
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
the other rows. No host synchronisation: three launches and device-side loops only.

Cost: two full reads of x in (B, NS) programs (stats, pivots), then, in one program per
row, one gather pass plus one per refinement and a final race pass when the kept set
outgrows the buffer (typical decode settings: gather only), plus E read at kept ids only.
The floor for B=128, V=154880 is 79 MB of logits read once, 19 us at 4.09 TB/s; the
exponentials that the sampler contract draws add a 79 MB write before the kernels.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from . import patch_triton_interpreter

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def patch_interpreter_bool_ops() -> None:
    """Under TRITON_INTERPRET=1 only: let `&`, `|`, `^` combine float comparisons.

    Triton 3.6's interpreter stores a comparison's result in the dtype of its operands (a
    float compare gives 0.0/1.0 float32 data under an int1 type), so `valid & (z > t)` hits
    numpy's bitwise_and on float32 and raises. When either side holds float data the operands
    are booleans: combine them logically. Only such calls, which fail today, change.
    Idempotent; compiled (GPU) runs are untouched.
    """
    if not _INTERPRET:
        return
    try:
        from triton.runtime import interpreter as _interp
    except ImportError:  # pragma: no cover
        return
    import numpy as np

    builder = getattr(_interp, "InterpreterBuilder", None)
    for name, logical in (("create_and", np.logical_and), ("create_or", np.logical_or),
                          ("create_xor", np.logical_xor)):
        orig = getattr(builder, name, None)
        if orig is None or getattr(orig, "_glmrt_bool", False):
            continue

        def op(self, lhs, rhs, _orig=orig, _logical=logical):
            if lhs.data.dtype.kind == "f" or rhs.data.dtype.kind == "f":
                return _interp.TensorHandle(_logical(lhs.data != 0, rhs.data != 0), tl.int1)
            return _orig(self, lhs, rhs)

        op._glmrt_bool = True  # type: ignore[attr-defined]
        setattr(builder, name, op)


def patch_interpreter_device_calls() -> None:
    """Under TRITON_INTERPRET=1 only: skip re-patching triton.language on every device call.

    The interpreter re-patches every builtin of the callee's language modules at each call
    of a @triton.jit helper (~5 ms each, dominating these kernels' interpreted run time).
    When those modules are already patched (the enclosing launch or an earlier call did it,
    with the same stateless builder) the call goes straight to the rewritten function.
    Idempotent; compiled (GPU) runs are untouched.
    """
    if not _INTERPRET:
        return
    try:
        import inspect

        from triton.runtime import interpreter as _interp
    except ImportError:  # pragma: no cover
        return
    cls = getattr(_interp, "InterpretedFunction", None)
    orig = getattr(cls, "__call__", None)
    if orig is None or getattr(orig, "_glmrt_fast", False) or not hasattr(cls, "rewrite"):
        return

    def __call__(self, *args, **kwargs):
        langs = [v for v in self.fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)]
        if langs and all(not tl.core.is_builtin(getattr(lang, "where", None)) for lang in langs):
            fn = self.rewrite()
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                raise _interp.InterpreterError(repr(e)) from e
        return orig(self, *args, **kwargs)

    __call__._glmrt_fast = True  # type: ignore[attr-defined]
    cls.__call__ = __call__


def _np_sort_desc(keys):
    """Interpreter stand-in for tl.sort(keys, descending=True) (numpy; same result)."""
    import numpy as np
    from triton.runtime import interpreter as _interp

    data = np.sort(keys.handle.data)[::-1].copy()
    return tl.tensor(_interp.TensorHandle(data, keys.handle.dtype), keys.type)


# Referenced only under `if INTERPRET:` (a constexpr branch the compiler never visits); the
# flag keeps Triton's dependency scan from rejecting a plain Python function.
_np_sort_desc.__triton_builtin__ = True  # type: ignore[attr-defined]


def patch_interpreter_overflow_checks() -> None:
    """Under TRITON_INTERPRET=1 without TRITON_DEBUG: skip the int overflow sanitiser's work.

    The interpreter computes every int32 add/sub/mul a second time in int64 for an overflow
    assert that it then drops unless debug is on (~1.7 ms per op, a third of these kernels'
    interpreted time). With debug off that work has no effect, so turn it off; with
    TRITON_DEBUG=1 the checks stay. Compiled (GPU) runs are untouched.
    """
    if not _INTERPRET:
        return
    try:
        import dataclasses

        from triton.runtime import interpreter as _interp
    except ImportError:  # pragma: no cover
        return
    builder = getattr(_interp, "interpreter_builder", None)
    opts = getattr(builder, "options", None)
    if opts is not None and not opts.debug and getattr(opts, "sanitize_overflow", False):
        builder.options = dataclasses.replace(opts, sanitize_overflow=False)


patch_triton_interpreter()
patch_interpreter_bool_ops()
patch_interpreter_device_calls()
patch_interpreter_overflow_checks()

NUM_PIVOTS = 16
# Offsets below the row maximum, in nats of z = x / T, of the first pass's thresholds.
PIVOT_OFFSETS = (0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0, 12.0, 16.0, 24.0, 32.0)
DEFAULT_CAPACITY = 4096  # elements sorted in registers per row
DEFAULT_CHUNK = 8192  # split size of the two batched passes (a function of V only)
NUM_PARAMS = 8  # int32 words per row in the packed parameter tensor

_KEY_LO_ALL = tl.constexpr(-2139095040)  # key(-inf) + 1: every finite z has a key >= this
_MAX_REFINE = 12


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
    """z = x / t, IEEE-rounded as torch divides (skipped when t == 1: then z = x exactly)."""
    if t == 1.0:
        z = x
    else:
        z = tl.math.div_rn(x, t)
    return z


@triton.jit
def _log(v, EXACT_LOG: tl.constexpr):
    if EXACT_LOG:
        return libdevice.log(v)
    else:
        return tl.log(v)


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


# ---- kernel 1: per-split statistics (+ the whole race for unfiltered rows) -------------------
@triton.jit
def _stats_kernel(X, stride_x, PRM, E, PF, PI, V, CHUNK,
                  BLOCK: tl.constexpr, EXACT_LOG: tl.constexpr):
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
            sc = tl.where(valid, z - _log(tl.maximum(eg, 1.1754943508222875e-38), EXACT_LOG), float("-inf"))
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
def _pivot_kernel(X, stride_x, PRM, PF, PI, DTAB, PC, PM, V, CHUNK,
                  NSP: tl.constexpr, NP: tl.constexpr, PBLOCK: tl.constexpr):
    r = tl.program_id(0)
    s = tl.program_id(1)
    NS = tl.num_programs(1)
    t, topp, lmp, k, nrow = _params(PRM, r)
    if (nrow >= 0) & (_unfiltered(k, topp, lmp, V) == 0):
        m, S, nfin, amax, ridx = _combine(PF, PI, r, NS, NSP)
        if nfin > 0:
            pk = _initial_pivots(DTAB, m, lmp, NP)
            xrow = X + r.to(tl.int64) * stride_x
            c0 = s * CHUNK
            c1 = tl.minimum(c0 + CHUNK, V)
            C, M = _count_pass(xrow, t, m, pk, c0, c1, NP, PBLOCK)
            jj = tl.arange(0, NP)
            tl.store(PC + (r * NS + s) * NP + jj, C)
            tl.store(PM + (r * NS + s) * NP + jj, M)


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
def _gather_sorted(xrow, t, lo, hi, BUFROW, V, BLOCK: tl.constexpr, CAP: tl.constexpr,
                   INTERPRET: tl.constexpr):
    """Ids with lo <= key(z) < hi, as (z, id) in stable descending order; n of them (<= CAP)."""
    tl.debug_barrier()  # earlier reads of the buffer (a previous gather) come first
    offs0 = tl.arange(0, BLOCK)
    cnt = 0
    for start in range(0, V, BLOCK):
        offs = start + offs0
        valid = offs < V
        x = tl.load(xrow + offs, mask=valid, other=float("-inf"))
        kz = _key(_div(x, t))
        inb = valid & (kz >= lo) & (kz < hi)
        pos = cnt + tl.cumsum(inb.to(tl.int32), 0) - 1
        key64 = (kz.to(tl.int64) << 32) | (2147483647 - offs).to(tl.int64)
        tl.store(BUFROW + pos, key64, mask=inb & (pos < CAP))
        cnt += tl.sum(inb.to(tl.int32), 0)
    tl.debug_barrier()
    n = tl.minimum(cnt, CAP)
    ii = tl.arange(0, CAP)
    keys = tl.load(BUFROW + ii, mask=ii < n, other=-9223372036854775807 - 1)
    if INTERPRET:
        keys = _np_sort_desc(keys)
    else:
        keys = tl.sort(keys, descending=True)
    kz = (keys >> 32).to(tl.int32)
    ids = 2147483647 - keys.to(tl.int32)
    return _unkey(kz), kz, ids, n


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
def _race_sorted(zs, ids, keep, erow, EXACT_LOG: tl.constexpr):
    eg = tl.load(erow + ids, mask=keep, other=1.0)
    sc = tl.where(keep, zs - _log(tl.maximum(eg, 1.1754943508222875e-38), EXACT_LOG), float("-inf"))
    best = tl.max(sc, 0)
    return tl.min(tl.where(keep & (sc == best), ids, 2147483647), 0)


@triton.jit
def _race_pass(xrow, erow, t, vkey, q, V, BLOCK: tl.constexpr, EXACT_LOG: tl.constexpr):
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
        sc = tl.where(kept, z - _log(tl.maximum(eg, 1.1754943508222875e-38), EXACT_LOG), float("-inf"))
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


# ---- kernel 3: one program per row -----------------------------------------------------------
@triton.jit
def _select_kernel(X, stride_x, PRM, E, PF, PI, DTAB, PC, PM, BUF, OUT, INFO, V, NS,
                   NSP: tl.constexpr, NP: tl.constexpr, CAP: tl.constexpr, BLOCK: tl.constexpr,
                   PBLOCK: tl.constexpr, MAXIT: tl.constexpr, EXACT_LOG: tl.constexpr,
                   INTERPRET: tl.constexpr):
    """Row r's token to OUT[r]; INFO[r] = (ids kept, path bits): 1 race done by the stats
    kernel (no filter), 2 no cut (top-k at or above the finite count), 4 S_k from a gathered
    bracket, 8 S_k from a tie group larger than CAP, 16 race in the buffer, 32 final race
    pass, 64 cut inside a tie group larger than CAP; bits 8-15 and 16-23 count the refinement
    passes of the top-k bracket and of the cut's bracket."""
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
            k_eff = tl.minimum(k, nfin)
            has_k = k_eff < nfin
            has_p = topp < 1.0
            has_m = lmp > float("-inf")
            tmin = m + lmp
            kmin = _key(tmin)
            pk0 = _initial_pivots(DTAB, m, lmp, NP)
            ss = tl.arange(0, NSP)
            jj = tl.arange(0, NP)
            pidx = (r * NS + ss)[:, None] * NP + jj[None, :]
            pok = (ss < NS)[:, None] & (jj < NP)[None, :]
            C0 = tl.sum(tl.load(PC + pidx, mask=pok, other=0), 0)
            M0 = tl.sum(tl.load(PM + pidx, mask=pok, other=0.0), 0)
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
            phase = tl.where(has_k & has_p, 0, 1) + tl.where(has_k | has_p | has_m, 0, 2)
            path = path | tl.where(phase >= 2, 2, 0)
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
                    zs, kzs, ids, n = _gather_sorted(xrow, t, lo, hi, BUFROW, V, BLOCK, CAP, INTERPRET)
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
                            tok = _race_sorted(zs, ids, keep, erow, EXACT_LOG)
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
            if done == 0:
                tok = _race_pass(xrow, erow, t, vkey, q, V, BLOCK, EXACT_LOG)
                path = path | 32
    tl.store(OUT + r, tok.to(tl.int64))
    tl.store(INFO + r * 2, nkept)
    tl.store(INFO + r * 2 + 1, path)


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


def sample(x: torch.Tensor, params: torch.Tensor, noise: torch.Tensor | None, *,
           capacity: int = DEFAULT_CAPACITY, chunk: int = DEFAULT_CHUNK, out: torch.Tensor | None = None,
           info: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """Tokens [B] (int64, on x's device) for fp32 logits x [B, V] (unit stride along V).

    `params`: int32 [B, 8] from `pack_params`, on x's device. `noise`: fp32 [NE, V] Exp(1)
    draws (contiguous; row `noise_row` of each sampled row), or None when every row is
    greedy. `capacity` (a power of two: the sort size per row) and `chunk` (split size of
    the batched passes) are tuning knobs that change nothing but top-p's rounding; `config`
    overrides the tile sizes and warps ({"block", "pblock", "sblock", "spblock", "warps"}).
    `out` (int64 [B]) receives the tokens; `info` (int32 [B, 2]), if given, the number of
    ids each row kept and the paths its select program took (bits: see `_select_kernel`).
    Three launches, no host synchronisation.
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
    if info is None:
        info = torch.empty(B, 2, dtype=torch.int32, device=dev)
    e = noise if noise is not None else x
    exact_log = dev.type == "cuda" and not _INTERPRET
    dtab = _pivot_table(dev)
    stride_x = x.stride(0)
    if _INTERPRET:  # numpy per op: fewer, larger tiles
        cfg = dict.fromkeys(("block", "pblock", "sblock", "spblock"), max(16, min(8192, triton.next_power_of_2(V))))
        cfg["warps"] = 4
    else:
        cfg = dict(block=1024, pblock=256, sblock=min(1024, triton.next_power_of_2(chunk)),
                   spblock=min(256, triton.next_power_of_2(chunk)), warps=8)
    cfg.update(config or {})
    _stats_kernel[(B, ns)](x, stride_x, params, e, pf, pi, V, chunk,
                           BLOCK=cfg["sblock"], EXACT_LOG=exact_log, num_warps=cfg["warps"])
    _pivot_kernel[(B, ns)](x, stride_x, params, pf, pi, dtab, pc, pm, V, chunk,
                           NSP=nsp, NP=NUM_PIVOTS, PBLOCK=cfg["spblock"], num_warps=cfg["warps"])
    _select_kernel[(B,)](x, stride_x, params, e, pf, pi, dtab, pc, pm, buf, out, info, V, ns,
                         NSP=nsp, NP=NUM_PIVOTS, CAP=capacity, BLOCK=cfg["block"], PBLOCK=cfg["pblock"],
                         MAXIT=_MAX_REFINE, EXACT_LOG=exact_log, INTERPRET=_INTERPRET, num_warps=cfg["warps"])
    return out
