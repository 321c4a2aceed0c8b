"""Row copies across many tensors in one launch: the state-pool slot copies of speculative decoding
and the rollback's gather of the verify's kept rows.

    copy_slots(tensors, src, dst)  each pool tensor [L, slots, ...]: t[:, dst[b]] = t[:, src[b]]
                                   (or into another tensor's slots: the draft chain's tails)
    gather_rows(tensors, sel)      each tensor [rows, ...] (rows may be strided): t[sel] as a new
                                   contiguous tensor

A speculative verify snapshots each drafting request's state (the KDA conv window and recurrent
state, the indexer tails, the kept hidden state) into its rollback slot, and a rollback copies it
back; the rollback then gathers the kept rows of every stateful op's inputs (six tensors per KDA
layer, two per indexer). With torch's indexing each tensor is a launch or two (a slot copy is a
gather and a scatter, every byte moved twice): on a small model those launches, not the bytes,
are the cost. Here up to MAX_TENSORS tensors of any dtypes go in one launch; a program copies one
BLOCK of one row (of one layer) of one tensor, each byte once.

Pairs with src == dst (pad rows: the pad slot onto itself) write what they read. Distinct pairs
must not chain (no dst that is another pair's src): the copies run in parallel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .pdl import pdl_enter

MAX_TENSORS = 8
BLOCK = 2048  # elements per program


@triton.jit
def _copy_unit(S, D, W, RS, RD, LS, LD, NB, u, s, d, BLOCK: tl.constexpr):
    """Block u % NB of layer u // NB: D[layer, d, :W] = S[layer, s, :W] (row strides RS / RD,
    layer strides LS / LD, in elements)."""
    layer = (u // NB).to(tl.int64)
    offs = (u % NB) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < W
    x = tl.load(S + layer * LS + s * RS + offs, mask=mask)
    tl.store(D + layer * LD + d * RD + offs, x, mask=mask)


@triton.jit
def _copy_rows_kernel(SRC_ROWS, DST_ROWS,
                      S0, D0, W0, RS0, RD0, LS0, LD0, NB0, S1, D1, W1, RS1, RD1, LS1, LD1, NB1,
                      S2, D2, W2, RS2, RD2, LS2, LD2, NB2, S3, D3, W3, RS3, RD3, LS3, LD3, NB3,
                      S4, D4, W4, RS4, RD4, LS4, LD4, NB4, S5, D5, W5, RS5, RD5, LS5, LD5, NB5,
                      S6, D6, W6, RS6, RD6, LS6, LD6, NB6, S7, D7, W7, RS7, RD7, LS7, LD7, NB7,
                      U1, U2, U3, U4, U5, U6, U7,
                      HAS_DST_ROWS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Program (b, u): pair b (source row SRC_ROWS[b], destination row DST_ROWS[b] or b), unit u
    of every tensor's units in order (tensor i owns [U_i, U_i+1)). Absent tensors own none."""
    pdl_enter(PDL)
    b = tl.program_id(0)
    u = tl.program_id(1)
    s = tl.load(SRC_ROWS + b).to(tl.int64)
    if HAS_DST_ROWS:
        d = tl.load(DST_ROWS + b).to(tl.int64)
    else:
        d = b.to(tl.int64)
    if u < U1:
        _copy_unit(S0, D0, W0, RS0, RD0, LS0, LD0, NB0, u, s, d, BLOCK)
    elif u < U2:
        _copy_unit(S1, D1, W1, RS1, RD1, LS1, LD1, NB1, u - U1, s, d, BLOCK)
    elif u < U3:
        _copy_unit(S2, D2, W2, RS2, RD2, LS2, LD2, NB2, u - U2, s, d, BLOCK)
    elif u < U4:
        _copy_unit(S3, D3, W3, RS3, RD3, LS3, LD3, NB3, u - U3, s, d, BLOCK)
    elif u < U5:
        _copy_unit(S4, D4, W4, RS4, RD4, LS4, LD4, NB4, u - U4, s, d, BLOCK)
    elif u < U6:
        _copy_unit(S5, D5, W5, RS5, RD5, LS5, LD5, NB5, u - U5, s, d, BLOCK)
    elif u < U7:
        _copy_unit(S6, D6, W6, RS6, RD6, LS6, LD6, NB6, u - U6, s, d, BLOCK)
    else:
        _copy_unit(S7, D7, W7, RS7, RD7, LS7, LD7, NB7, u - U7, s, d, BLOCK)


def _launch(pairs: int, src_rows: torch.Tensor, dst_rows: torch.Tensor | None,
            parts: list[tuple[torch.Tensor, torch.Tensor, int, int, int, int, int, int]]) -> None:
    """parts: (src, dst, row width, src row stride, dst row stride, src layer stride, dst layer
    stride, layers) per tensor, at most MAX_TENSORS."""
    args, ends, at = [], [], 0
    for s, d, w, rs, rd, ls, ld, layers in parts:
        nb = triton.cdiv(w, BLOCK)
        args += [s, d, w, rs, rd, ls, ld, nb]
        at += layers * nb
        ends.append(at)
    for _ in range(MAX_TENSORS - len(parts)):  # absent tensors: the first one's pointers, no units
        args += [parts[0][0], parts[0][1], 0, 0, 0, 0, 0, 1]
        ends.append(at)
    _copy_rows_kernel[(pairs, at)](src_rows, src_rows if dst_rows is None else dst_rows, *args, *ends[:MAX_TENSORS - 1],
                                   HAS_DST_ROWS=dst_rows is not None, BLOCK=BLOCK, num_warps=4,
                                   **pdl.launch(src_rows.device))


def supports_slots(tensors: tuple[torch.Tensor, ...], into: tuple[torch.Tensor, ...] | None = None) -> bool:
    """copy_slots takes contiguous [L, slots, ...] tensors over the same slots (`into`: of the same
    shapes and dtypes)."""
    return (0 < len(tensors) and all(t.dim() >= 2 and t.is_contiguous() for t in tensors)
            and len({t.shape[1] for t in tensors}) == 1
            and (into is None or (len(into) == len(tensors) and all(
                o.is_contiguous() and o.shape == t.shape and o.dtype == t.dtype for o, t in zip(into, tensors)))))


def supports_gather(tensors: list[torch.Tensor]) -> bool:
    """gather_rows takes tensors whose rows are each dense (the row stride may be anything)."""
    return all(t.dim() >= 1 and t.shape[0] > 0 and (t.dim() == 1 or t[0].is_contiguous()) for t in tensors)


def copy_slots(tensors: tuple[torch.Tensor, ...], src: torch.Tensor, dst: torch.Tensor,
               into: tuple[torch.Tensor, ...] | None = None) -> None:
    """For every tensor t (all [L, slots, ...] over the same slots, contiguous): t[:, dst] = t[:, src],
    or into the matching tensor of `into`."""
    if not src.shape[0]:
        return
    parts = []
    for t, o in zip(tensors, into or tensors):
        w = t[0, 0].numel()
        parts.append((t, o, w, w, w, t.stride(0), o.stride(0), t.shape[0]))
    for i in range(0, len(parts), MAX_TENSORS):
        _launch(src.shape[0], src, dst, parts[i: i + MAX_TENSORS])


def gather_rows(tensors: list[torch.Tensor], sel: torch.Tensor) -> list[torch.Tensor]:
    """[t[sel] for t in tensors], each a new contiguous tensor; a tensor's rows may be strided
    (a column slice of a wider matrix), each row itself dense."""
    rows = sel.shape[0]
    out = [torch.empty((rows, *t.shape[1:]), dtype=t.dtype, device=t.device) for t in tensors]
    if not rows:
        return out
    parts = []
    for t, o in zip(tensors, out):
        w = o[0].numel() if o.dim() > 1 else 1
        parts.append((t, o, w, t.stride(0), w, 0, 0, 1))
    for i in range(0, len(parts), MAX_TENSORS):
        _launch(rows, sel, None, parts[i: i + MAX_TENSORS])
    return out
