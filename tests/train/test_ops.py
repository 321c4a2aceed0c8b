"""The training-only pieces of TrainingOps: the indexer's KL objective and the expert counts."""

import torch

from glmrt.train.ops import IndexerTerm, _FLOOR, expert_counts, indexer_kl


def test_indexer_kl_is_zero_at_the_target_and_positive_elsewhere():
    target = torch.tensor([[[0.7, 0.3, 0.0], [0.2, 0.5, 0.3]]])
    eligible = target > 0
    rows = torch.tensor([[True, True]])
    exact = torch.log(target.clamp_min(1e-30)).masked_fill(~eligible, _FLOOR)
    assert indexer_kl([IndexerTerm(exact, target, rows)]).abs() < 1e-6
    flat = torch.zeros_like(target).masked_fill(~eligible, _FLOOR).requires_grad_()
    loss = indexer_kl([IndexerTerm(flat, target, rows)])
    assert loss > 0.01
    loss.backward()
    assert torch.isfinite(flat.grad).all() and flat.grad[0, 0, 2] == 0


def test_rows_without_eligible_pools_give_no_nan():
    logits = torch.full((1, 2, 3), _FLOOR, requires_grad=True)
    target = torch.zeros(1, 2, 3)
    loss = indexer_kl([IndexerTerm(logits, target, torch.tensor([[False, False]]))])
    loss.backward()
    assert loss == 0 and torch.isfinite(logits.grad).all()


def test_expert_counts_skip_padding_and_the_appended_shared_expert():
    ids = torch.tensor([[0, 2], [2, 3], [1, 1]])
    valid = torch.tensor([True, True, False])
    assert expert_counts(ids, 4, valid).tolist() == [1.0, 0.0, 2.0, 1.0]
    with_shared = torch.cat([ids, torch.full((3, 1), 4)], dim=1)
    assert expert_counts(with_shared, 4, None).tolist() == [1.0, 2.0, 2.0, 1.0]
