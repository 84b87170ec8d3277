"""The public losses of :mod:`tzrec_gr.losses`, against direct computations."""

from __future__ import annotations

import pytest
import torch

from tzrec_gr.losses import (
    full_softmax_loss,
    multitask_bce_loss,
    next_item_targets,
    sampled_softmax_loss,
)


def test_next_item_targets():
    ids = torch.tensor([10, 11, 12, 20, 30, 31])
    next_ids, has_next = next_item_targets(ids, torch.tensor([3, 1, 0, 2]))
    assert has_next.tolist() == [True, True, False, False, True, False]
    assert next_ids[has_next].tolist() == [11, 12, 31]


def test_sampled_softmax_loss_matches_a_direct_float64_softmax():
    gen = torch.Generator().manual_seed(0)
    table = torch.nn.functional.normalize(torch.randn(12, 4, generator=gen, dtype=torch.float64))
    user = torch.nn.functional.normalize(torch.randn(5, 4, generator=gen, dtype=torch.float64))
    ids = torch.tensor([1, 2, 3, 4, 5])
    lengths = torch.tensor([3, 0, 2])
    negatives = torch.tensor([7, 2, 9, 5])
    loss = sampled_softmax_loss(user, ids, lengths, lambda i: table[i], negatives, 0.1)
    terms = []
    for p, target in ((0, 2), (1, 3), (3, 5)):  # tokens with a next item of their sequence
        logits = [user[p] @ table[target]]
        logits += [user[p] @ table[n] for n in negatives.tolist() if n != target]
        logits = torch.stack(logits) / 0.1
        terms.append(torch.logsumexp(logits, 0) - logits[0])
    torch.testing.assert_close(loss.double(), torch.stack(terms).mean())


def test_sampled_softmax_loss_is_zero_without_next_items():
    user = torch.randn(2, 4)
    ids = torch.tensor([1, 2])
    loss = sampled_softmax_loss(
        user, ids, torch.tensor([1, 0, 1]), lambda i: torch.ones(*i.shape, 4), ids, 0.05
    )
    assert loss.item() == 0.0


def test_full_softmax_loss_is_the_sampled_loss_over_every_item_float64():
    """Value and gradients, with and without a loss mask, in float64."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 12, (7,), generator=gen)
    lengths = torch.tensor([3, 1, 0, 3])
    for loss_mask in (None, torch.tensor([True, True, True, True, False, True, True])):
        results = []
        for full in (True, False):
            torch.manual_seed(0)
            table = torch.randn(12, 4, dtype=torch.float64, requires_grad=True)
            user = torch.randn(7, 4, dtype=torch.float64, requires_grad=True)
            if full:
                loss = full_softmax_loss(user, ids, lengths, table, 0.1, loss_mask)
            else:
                loss = sampled_softmax_loss(
                    user, ids, lengths, table.__getitem__, torch.arange(12), 0.1, loss_mask
                )
            loss.backward()
            results.append((loss.detach(), user.grad, table.grad))
        for got, want in zip(*results):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    empty = full_softmax_loss(torch.randn(2, 4), ids[:2], torch.tensor([1, 0, 1]),
                              torch.randn(12, 4), 0.05)
    assert empty.item() == 0.0
    for catalogue in (torch.randn(12, 3), torch.randn(12)):
        with pytest.raises(ValueError, match=r"catalogue must be \[N, E\] with user's E = 4, got"):
            full_softmax_loss(torch.randn(2, 4), ids[:2], torch.tensor([2]), catalogue, 0.05)


def test_multitask_bce_loss_matches_per_task_means():
    logits = torch.tensor([[0.5, -1.0], [2.0, 0.0], [-0.3, 1.5]])
    labels = torch.tensor([1, 2, 3])
    bits = torch.tensor([1, 2])
    weights = torch.tensor([1.0, 0.5])
    loss = multitask_bce_loss(logits, labels, bits, weights)
    bce = torch.nn.functional.binary_cross_entropy_with_logits
    click = bce(logits[:, 0], torch.tensor([1.0, 0.0, 1.0]))
    like = bce(logits[:, 1], torch.tensor([0.0, 1.0, 1.0]))
    torch.testing.assert_close(loss, click + 0.5 * like)
