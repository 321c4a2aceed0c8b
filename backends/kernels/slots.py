"""State-pool slot copies in one launch: for each of up to five pool tensors [L, slots, ...],
`t[:, dst[b]] = t[:, src[b]]` for every request b.

A speculative verify snapshots each drafting request's state (the KDA conv window and recurrent
state, the indexer tails, the kept hidden state) into its rollback slot, and a rollback copies it
back. torch's indexing does that as a gather and a scatter per tensor: ten launches, each byte
read twice and written twice. Here one launch reads and writes each byte once. The tensors are
moved as 32-bit words (every slot row of the pool is a multiple of 4 bytes), so one kernel serves
every dtype; a program copies one BLOCK of one layer's slot row of one tensor.

Pairs with src == dst (pad rows: the pad slot onto itself) write what they read. Distinct pairs
must not chain (no dst that is another pair's src): the copies run in parallel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .pdl import pdl_enter

MAX_TENSORS = 5
BLOCK = 2048  # words (8 KiB) per program


@triton.jit
def _copy_unit(T, W, S, NB, u, s, d, BLOCK: tl.constexpr):
    """Block u % NB of layer u // NB: T[layer, d] = T[layer, s], rows of W words."""
    layer = (u // NB).to(tl.int64)
    offs = (u % NB) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < W
    row = layer * S * W
    x = tl.load(T + row + s * W + offs, mask=mask)
    tl.store(T + row + d * W + offs, x, mask=mask)


@triton.jit(do_not_specialize=["S"])
def _copy_slots_kernel(SRC, DST, T0, T1, T2, T3, T4, W0, W1, W2, W3, W4, NB0, NB1, NB2, NB3, NB4,
                       U1, U2, U3, U4, S, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Program (b, u): unit u of the units of every tensor in order (tensor i owns [U_i, U_i+1),
    L_i * NB_i units), for request b. Absent tensors own no units (their U is the total)."""
    pdl_enter(PDL)
    b = tl.program_id(0)
    u = tl.program_id(1)
    s = tl.load(SRC + b).to(tl.int64)
    d = tl.load(DST + b).to(tl.int64)
    if u < U1:
        _copy_unit(T0, W0, S, NB0, u, s, d, BLOCK)
    elif u < U2:
        _copy_unit(T1, W1, S, NB1, u - U1, s, d, BLOCK)
    elif u < U3:
        _copy_unit(T2, W2, S, NB2, u - U2, s, d, BLOCK)
    elif u < U4:
        _copy_unit(T3, W3, S, NB3, u - U3, s, d, BLOCK)
    else:
        _copy_unit(T4, W4, S, NB4, u - U4, s, d, BLOCK)


def _words(t: torch.Tensor) -> torch.Tensor | None:
    """t as int32 words [L, slots, W], or None when a slot row is not whole words or t is not dense."""
    if not t.is_contiguous() or t.dim() < 2 or (t[0, 0].numel() * t.element_size()) % 4 \
            or t.data_ptr() % 4:
        return None
    return t.view(torch.uint8).view(torch.int32).view(t.shape[0], t.shape[1], -1)


def supports(tensors: tuple[torch.Tensor, ...]) -> bool:
    return (0 < len(tensors) <= MAX_TENSORS and all(_words(t) is not None for t in tensors)
            and len({t.shape[1] for t in tensors}) == 1)


def copy_slots(tensors: tuple[torch.Tensor, ...], src: torch.Tensor, dst: torch.Tensor) -> None:
    """For every tensor t (all [L, slots, ...] over the same slots): t[:, dst] = t[:, src]."""
    words = [_words(t) for t in tensors]
    b = src.shape[0]
    if not b:
        return
    ws = [w.shape[2] for w in words]
    nbs = [triton.cdiv(w, BLOCK) for w in ws]
    ends, at = [], 0
    for w, nb in zip(words, nbs):
        at += w.shape[0] * nb
        ends.append(at)
    pad = MAX_TENSORS - len(words)
    words += [words[0]] * pad
    ws += [0] * pad
    nbs += [1] * pad
    ends += [at] * pad
    _copy_slots_kernel[(b, at)](src, dst, *words, *ws, *nbs, *ends[:4], words[0].shape[1], BLOCK=BLOCK,
                                num_warps=4, **pdl.launch(src.device))
