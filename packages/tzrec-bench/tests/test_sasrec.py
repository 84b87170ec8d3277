"""SASRec baseline: shapes, causality, batch independence, and its sampled-softmax loss."""

from __future__ import annotations

import pytest
import torch

from tzrec_bench.baselines import SASRec
from tzrec_gr.losses import sampled_softmax_loss

NUM_ITEMS, DIM, MAX_LEN = 50, 16, 8


def _model(**kwargs) -> SASRec:
    torch.manual_seed(0)
    args = dict(num_items=NUM_ITEMS, embedding_dim=DIM, max_seq_len=MAX_LEN, num_heads=2)
    return SASRec(**{**args, **kwargs}).eval()


def _batch(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths, dtype=torch.int64)
    total = int(lengths.sum())
    ids = torch.randint(0, NUM_ITEMS, (total,), generator=gen)
    return ids, lengths, torch.arange(total, dtype=torch.int64)


@pytest.mark.parametrize("lengths", [[3, 1, 8], [0, 5], [0, 0]])
def test_shapes_and_unit_norm(lengths):
    model = _model()
    ids, lengths, ts = _batch(lengths)
    full = model(ids, lengths, ts, MAX_LEN)
    assert full.shape == (ids.shape[0], DIM)
    torch.testing.assert_close(full.norm(dim=-1), torch.ones(ids.shape[0]))
    user = model.user_embedding(ids, lengths, ts, MAX_LEN)
    assert user.shape == (lengths.shape[0], DIM)
    assert model.item_embedding(torch.tensor([[1, 2]])).shape == (1, 2, DIM)


def test_user_embedding_is_last_token_and_zero_when_empty():
    model = _model()
    ids, lengths, ts = _batch([3, 0, 2])
    full = model(ids, lengths, ts, MAX_LEN)
    user = model.user_embedding(ids, lengths, ts, MAX_LEN)
    torch.testing.assert_close(user[0], full[2])
    torch.testing.assert_close(user[1], torch.zeros(DIM))
    torch.testing.assert_close(user[2], full[4])


def test_causal_later_tokens_do_not_change_earlier_outputs():
    model = _model()
    ids, lengths, ts = _batch([6, 4])
    changed = ids.clone()
    changed[4] = (changed[4] + 1) % NUM_ITEMS  # position 4 of the first user
    before = model(ids, lengths, ts, MAX_LEN)
    after = model(changed, lengths, ts, MAX_LEN)
    torch.testing.assert_close(after[:4], before[:4], rtol=0, atol=0)
    assert not torch.allclose(after[4], before[4])
    torch.testing.assert_close(after[6:], before[6:], rtol=0, atol=0)


def test_a_user_alone_equals_the_same_user_in_a_batch():
    model = _model()
    ids, lengths, ts = _batch([2, 7, 5])
    batched = model(ids, lengths, ts, MAX_LEN)
    alone = model(ids[2:9], lengths[1:2], ts[2:9], MAX_LEN)
    torch.testing.assert_close(alone, batched[2:9], rtol=1e-5, atol=1e-6)


def test_rejects_a_padded_length_beyond_the_position_table():
    model = _model()
    ids, lengths, ts = _batch([2])
    with pytest.raises(ValueError, match="max_seq_len must be in"):
        model(ids, lengths, ts, MAX_LEN + 1)
    with pytest.raises(ValueError, match="divisible by num_heads"):
        _model(num_heads=3)


@pytest.mark.parametrize("negatives, message", [
    (torch.tensor([1, NUM_ITEMS]), r"negatives must be in \[0, num_items=50\), got negatives\[1\]"),
    (torch.tensor([1.0, 2.0]), "negatives"),
])
def test_bad_negatives_are_refused_naming_them(negatives, message):
    ids, lengths, ts = _batch([3, 2])
    with pytest.raises(ValueError, match=message):
        _model().loss(ids, lengths, ts, MAX_LEN, negatives=negatives)


def test_loss_matches_a_direct_float64_sampled_softmax():
    model = _model(temperature=0.1)
    ids, lengths, ts = _batch([4, 1, 3])
    ids[1] = 7  # a positive that is also a negative: that negative is masked for this token
    negatives = torch.tensor([7, 0, 3, 7, 12])
    loss = model.loss(ids, lengths, ts, MAX_LEN, negatives=negatives)

    with torch.no_grad():
        user = model(ids, lengths, ts, MAX_LEN).double()
        items = model.item_embedding(torch.arange(NUM_ITEMS)).double()
    terms = []
    for start, length in ((0, 4), (4, 1), (5, 3)):
        for p in range(start, start + length - 1):
            target = int(ids[p + 1])
            logits = [float(user[p] @ items[target]) / 0.1]
            logits += [float(user[p] @ items[n]) / 0.1 for n in negatives.tolist() if n != target]
            logits = torch.tensor(logits, dtype=torch.float64)
            terms.append(torch.logsumexp(logits, 0) - logits[0])
    expected = torch.stack(terms).mean()
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)


def test_full_softmax_is_the_loss_over_every_item_float64():
    """num_negatives at least the catalogue and no negatives given: the loss over the whole
    table, value and gradients as with explicit negatives listing every item."""
    runs = []
    for negatives in (None, torch.arange(NUM_ITEMS)):
        model = _model(num_negatives=NUM_ITEMS, dropout_ratio=0.0).double()
        loss = model.loss(*_batch([4, 1, 3]), MAX_LEN, negatives=negatives)
        loss.backward()
        runs.append([loss.detach()] + [p.grad for p in model.parameters()])
    for got, want in zip(*runs):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_loss_is_zero_without_next_items():
    model = _model()
    ids, lengths, ts = _batch([1, 0, 1])
    user = model(ids, lengths, ts, MAX_LEN)
    loss = sampled_softmax_loss(user, ids, lengths, model.item_embedding, ids, 0.05)
    assert loss.item() == 0.0


def test_loss_decreases_with_adamw_on_a_learnable_sequence():
    # every user walks the catalogue in steps of one, so the next item is predictable
    torch.manual_seed(0)
    model = SASRec(NUM_ITEMS, DIM, MAX_LEN, num_heads=2, dropout_ratio=0.0, num_negatives=16)
    starts = torch.randint(0, NUM_ITEMS, (16,))
    ids = ((starts.unsqueeze(1) + torch.arange(MAX_LEN)) % NUM_ITEMS).reshape(-1)
    lengths = torch.full((16,), MAX_LEN)
    ts = torch.zeros_like(ids)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        loss = model.loss(ids, lengths, ts, MAX_LEN)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5
