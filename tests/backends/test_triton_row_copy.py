"""The one-launch row copies (backends/kernels/row_copy.py) against ReferenceOps (torch indexing),
bit for bit: the state pool's slot copies over five tensors of mixed dtypes and row sizes (rows
longer than one program's block, a pad pair copied onto itself, every other slot untouched), and
the rollback's gather of kept rows from tensors with strided rows, more tensors than one launch
takes."""

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


@pytest.mark.parametrize("big", [8, 300])  # 300: a recurrent row of 4800 elements, three programs' blocks
def test_copy_slots_matches_the_reference(device, big):
    from backends.kernels import row_copy
    g = gen("slots", big)
    want = pool(g, 9, big)
    got = tuple(t.clone().to(device) for t in want)
    src, dst = torch.tensor([1, 5, 0, 8]), torch.tensor([6, 2, 0, 3])  # 0 -> 0: a pad row onto itself
    assert row_copy.supports_slots(got)
    ReferenceOps().copy_slots(want, src, dst)
    row_copy.copy_slots(got, src.to(device), dst.to(device))
    for w, t in zip(want, got):
        assert torch.equal(t.cpu(), w)
    assert torch.equal(want[1][:, 6], want[1][:, 1]) and not torch.equal(want[1][:, 6], want[1][:, 7])
    # into other tensors' slots (the draft chain's tails from the draft layer's), the sources untouched
    into = tuple(torch.zeros_like(t) for t in want[2:4])
    got_into = tuple(torch.zeros_like(t).to(device) for t in want[2:4])
    ReferenceOps().copy_slots(want[2:4], src, src, into=into)
    assert row_copy.supports_slots(got[2:4], got_into)
    row_copy.copy_slots(got[2:4], src.to(device), src.to(device), into=got_into)
    for w, t in zip(into, got_into):
        assert torch.equal(t.cpu(), w)
    assert torch.equal(into[0][:, 5], want[2][:, 5]) and not into[0][:, 7].any()


def kept_inputs(device: torch.device | str) -> list[torch.Tensor]:
    """What a verify keeps of a KDA layer, three times over (12 tensors: two launches)."""
    g = gen("gather")
    wide = torch.randn(12, 40, generator=g).bfloat16().to(device)
    return [wide[:, 8:32],                                                  # a column slice: strided rows
            torch.randn(12, 3, 16, generator=g).bfloat16().to(device),      # q, k, v like
            torch.randn(12, 3, 16, generator=g).to(device),                 # g like (fp32)
            torch.randn(12, 3, generator=g).bfloat16().to(device)] * 3      # beta like


def test_gather_rows_matches_the_reference(device):
    from backends.kernels import row_copy
    sel = torch.tensor([4, 5, 6, 0, 11, 4])
    want = ReferenceOps().gather_rows(kept_inputs("cpu"), sel)
    tensors = kept_inputs(device)
    assert tensors[0].stride(0) == 40 and row_copy.supports_gather(tensors)
    got = row_copy.gather_rows(tensors, sel.to(device))
    for w, t in zip(want, got):
        assert t.is_contiguous() and t.shape == w.shape and torch.equal(t.cpu(), w)


def test_what_the_row_copies_do_not_take():
    from backends.kernels import row_copy
    assert not row_copy.supports_slots((torch.zeros(2, 4, 8), torch.zeros(2, 5, 8)))  # not the same slots
    assert not row_copy.supports_slots((torch.zeros(2, 4, 8).transpose(1, 2),))
    assert not row_copy.supports_gather([torch.zeros(4, 6).t()])  # rows not dense
