"""Item attributes: ``ItemAttributeEmbedding`` against a float64 loop (forward and backward),
its input checks, and ``HSTURetrieval(num_attributes=...)``: the rows it scores and feeds the
stack, serving, and a checkpoint that brings the links back."""

from __future__ import annotations

import pytest
import torch
from _models import (
    NUM_ITEMS,
    attributed_retrieval_model,
    history_user,
    retrieval_batch,
    retrieval_model,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn import functional as F

from tzrec_gr.checkpoint import load_model, write_payload
from tzrec_gr.item_attributes import ItemAttributeEmbedding
from tzrec_gr.serving import server_for
from tzrec_ops.testing.tolerances import assert_close


def _links(lists):
    offsets = torch.tensor([0] + [len(a) for a in lists]).cumsum(0)
    ids = torch.tensor([a for attrs in lists for a in attrs], dtype=torch.long)
    return offsets, ids


def _table(lists, num_attributes, dim=4, dtype=torch.float64):
    torch.manual_seed(0)
    offsets, ids = _links(lists)
    table = ItemAttributeEmbedding(len(lists), num_attributes, max(int(ids.numel()), 1), dim)
    table.to(dtype)
    if ids.numel():
        table.set_links(offsets, ids)
    return table


def _reference(table, lists):
    """[I, E] float64: each item's mean attribute row, by a loop."""
    weight = table.table.weight.double()
    rows = [weight[list(a)].mean(0) if a else weight.new_zeros(weight.shape[1]) for a in lists]
    return torch.stack(rows)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.lists(st.integers(0, 6), max_size=5), min_size=1, max_size=8)
       .filter(lambda lists: any(lists)))
def test_the_rows_are_each_items_mean_attribute_row_forward_and_backward(lists):
    # items without attributes, one attribute, repeats of one attribute: a plain mean
    table = _table(lists, 7)
    out = table()
    assert_close(out, _reference(table, lists), torch.float64, name="rows")
    grad = torch.randn_like(out)
    (out * grad).sum().backward()
    weight = table.table.weight.detach().clone().requires_grad_(True)
    rows = [weight[list(a)].mean(0) if a else weight.new_zeros(4) for a in lists]
    (torch.stack(rows) * grad).sum().backward()
    assert_close(table.table.weight.grad, weight.grad, torch.float64, name="table grad")


def test_before_links_every_item_has_a_zero_row():
    table = ItemAttributeEmbedding(3, 2, 4, 5)
    assert torch.equal(table(), torch.zeros(3, 5))


@pytest.mark.parametrize("offsets, ids, message", [
    ([0, 1, 2], [0, 1, 1], r"offsets must be \[num_items \+ 1\] = \[4\]"),
    ([0, 2, 1, 3], [0, 1, 1], "offsets must rise from 0 to num_links = 3"),
    ([1, 2, 3, 3], [0, 1, 1], "offsets must rise from 0 to num_links = 3"),
    ([0, 1, 2, 3], [0, 1], r"attribute_ids must be \[num_links\] = \[3\]"),
    ([0, 1, 2, 3], [0, 1, 2], r"attribute_ids must lie in \[0, 2\)"),
    ([0, 1, 2, 3], [0, -1, 1], r"attribute_ids must lie in \[0, 2\)"),
    ([0.0, 1.0, 2.0, 3.0], [0, 1, 1], "offsets must be a 1-D integer tensor"),
])
def test_bad_links_are_refused_naming_the_argument(offsets, ids, message):
    table = ItemAttributeEmbedding(3, 2, 3, 4)
    with pytest.raises(ValueError, match=message):
        table.set_links(torch.tensor(offsets), torch.tensor(ids))
    assert torch.equal(table.item_counts, torch.zeros(3, 1, dtype=torch.long))  # nothing half set


@pytest.mark.parametrize("kwargs, message", [
    ({"num_attributes": -1}, "num_attributes must be an int >= 0"),
    ({"num_attributes": True, "num_attribute_links": 3}, "num_attributes must be an int"),
    ({"num_attributes": 0, "num_attribute_links": 3}, "num_attribute_links must be 0"),
    ({"num_attributes": 4}, "num_attribute_links must be an int > 0 with num_attributes"),
])
def test_bad_attribute_sizes_are_refused_naming_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        retrieval_model(**kwargs)


def _attributed_model(dtype=torch.float64):
    lists = [[] if i < 2 else [i % 5] for i in range(NUM_ITEMS)]
    lists[2] = [2, 3, 4]
    return attributed_retrieval_model().to(dtype), lists  # the links it documents


def test_a_model_scores_and_reads_each_item_as_its_id_row_plus_its_attribute_row():
    model, lists = _attributed_model()
    table = _reference(model.item_attributes, lists)
    rows = model.item_embeddings.weight.double() + table
    ids = torch.arange(NUM_ITEMS)
    assert_close(model.item_embedding(ids), F.normalize(rows, dim=-1), torch.float64,
                 name="item embedding")
    assert_close(model.catalogue_embedding(), F.normalize(rows, dim=-1), torch.float64,
                 name="catalogue")
    # the stack reads the same rows: a model without attributes fed them as id rows agrees
    plain = retrieval_model().double()
    plain.load_state_dict({k: v for k, v in model.state_dict().items()
                           if not k.startswith("item_attributes.")})
    with torch.no_grad():
        plain.item_embeddings.weight.copy_(rows)
    users = [history_user(n) for n in (3, 1, 7)]
    batch = retrieval_batch(users, "cpu")
    assert_close(model(*batch), plain(*batch), torch.float64, name="forward")
    assert not torch.allclose(model(*batch), retrieval_model().double()(*batch))


def test_the_loss_trains_the_attribute_table():
    model, _ = _attributed_model(dtype=torch.float32)
    model.train()
    users = [history_user(n) for n in (4, 6)]
    model.loss(*retrieval_batch(users, "cpu")).backward()
    assert model.item_attributes.table.weight.grad.abs().sum() > 0


def test_serving_scores_what_the_model_scores():
    model, _ = _attributed_model()
    users = [history_user(6) for _ in range(2)]
    server = server_for(model)
    cache = server.prefill(*retrieval_batch(users, "cpu"))
    candidates = torch.randint(0, NUM_ITEMS, (2, 4))
    full = model(*retrieval_batch(users, "cpu"))
    expected = torch.einsum("be,bte->bt", full[[5, 11]], model.item_embedding(candidates))
    assert_close(server.score(cache, candidates), expected, torch.float64, name="scores")


def test_a_checkpoint_brings_the_links_back(tmp_path):
    model, _ = _attributed_model(dtype=torch.float32)
    config = {"model": "HSTURetrieval",
              "kwargs": {"num_items": NUM_ITEMS, "embedding_dim": 16, "num_layers": 2,
                         "max_seq_len": 12, "dropout_ratio": 0.0, "backend": "pytorch",
                         "num_attributes": 5,
                         "num_attribute_links": model.item_attributes.num_links}}
    write_payload(tmp_path / "m.pt", {"model_config": config, "model": model.state_dict()})
    loaded, _ = load_model(tmp_path / "m.pt")
    assert torch.equal(loaded.catalogue_embedding(), model.catalogue_embedding())
