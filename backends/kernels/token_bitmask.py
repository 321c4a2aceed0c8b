"""Structured output's token mask as a Triton kernel: logits[rows[i], t] = -inf wherever bit t
of bitmask row i is 0 (32 tokens per int32 word, bit t % 32 of word t // 32), in place.

One program per (masked row, BLOCK tokens): it reads BLOCK / 32 words and writes only the
masked logits, so a row's cost is one pass over its words plus the stores of what it drops.
ReferenceOps.apply_token_bitmask is the torch oracle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .interpreter import patch_interpreter

patch_interpreter()

BLOCK = 4096


@triton.jit
def _apply_bitmask_kernel(LOGITS, BITS, ROWS, stride_logits, stride_bits, vocab, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(ROWS + i).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < vocab
    words = tl.load(BITS + i * stride_bits + offs // 32, mask=ok, other=-1)
    allowed = ((words >> (offs % 32)) & 1) != 0
    neg_inf = tl.full([BLOCK], float("-inf"), tl.float32)  # stored in the logits' dtype
    tl.store(LOGITS + row * stride_logits + offs, neg_inf.to(LOGITS.dtype.element_ty), mask=ok & ~allowed)


def apply_token_bitmask(logits: torch.Tensor, bits: torch.Tensor, rows: torch.Tensor) -> None:
    """Mask `logits` [B, V] in place; `bits` [len(rows), ceil(V / 32)] int32, `rows` long, on one device."""
    if rows.numel() == 0:
        return
    assert logits.stride(1) == 1 and bits.is_contiguous() and bits.dtype == torch.int32
    vocab = logits.shape[1]
    grid = (rows.numel(), triton.cdiv(vocab, BLOCK))
    _apply_bitmask_kernel[grid](logits, bits, rows, logits.stride(0), bits.stride(0), vocab, BLOCK=BLOCK)
