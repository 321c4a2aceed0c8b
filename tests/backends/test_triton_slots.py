"""The one-launch state-pool slot copy against ReferenceOps.copy_slots (torch indexing): the pool's
five tensors of mixed dtypes and row sizes, rows longer than one program's block, a pad pair
copied onto itself; every other slot untouched, bit for bit."""

from __future__ import annotations

import pytest
import torch

from backends.reference import ReferenceOps

from .conftest import gen


def pool(g: torch.Generator, slots: int, big: int) -> tuple[torch.Tensor, ...]:
    """Shaped like a StatePool: conv [L, S, 3, C] bf16, recurrent [L, S, H, dk, dv] fp32, two
    indexer tails [L, S, kpool, di] bf16, the kept hidden state [1, S, D] bf16."""
    return (torch.randn(3, slots, 3, 24, generator=g).bfloat16(),
            torch.randn(3, slots, 2, 8, big, generator=g),
            torch.randn(2, slots, 4, 16, generator=g).bfloat16(),
            torch.randn(2, slots, 4, 16, generator=g).bfloat16(),
            torch.randn(1, slots, 40, generator=g).bfloat16())


@pytest.mark.parametrize("big", [8, 300])  # 300: a recurrent row of 4800 words, three programs' blocks
def test_copy_slots_matches_the_reference(device, big):
    from backends.kernels import slots
    g = gen("slots", big)
    want = pool(g, 9, big)
    got = tuple(t.clone().to(device) for t in want)
    src, dst = torch.tensor([1, 5, 0, 8]), torch.tensor([6, 2, 0, 3])  # 0 -> 0: a pad row onto itself
    assert slots.supports(got)
    ReferenceOps().copy_slots(want, src, dst)
    slots.copy_slots(got, src.to(device), dst.to(device))
    for w, t in zip(want, got):
        assert torch.equal(t.cpu(), w)
    assert torch.equal(want[1][:, 6], want[1][:, 1]) and not torch.equal(want[1][:, 6], want[1][:, 7])


def test_rows_that_are_not_whole_words_are_not_taken():
    from backends.kernels import slots
    odd = torch.zeros(2, 4, 3, dtype=torch.float8_e4m3fn)  # 3-byte rows
    assert not slots.supports((odd,))
    assert not slots.supports((torch.zeros(2, 4, 8), torch.zeros(2, 5, 8)))  # not the same slots
