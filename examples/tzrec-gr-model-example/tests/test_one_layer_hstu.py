"""What is particular to this package: its entry point, its model and its server (the tools
around it are tested in the monorepo's tests/test_model_plugin.py)."""

from __future__ import annotations

import importlib.metadata
import types

import pytest
import torch
from tzrec_gr_model_example.model import MODEL_NAME, OneLayerHSTU
from tzrec_gr_model_example.serving import OneLayerHSTUServer

from tzrec_gr.models import HSTURetrieval
from tzrec_gr.models.registry import get_model
from tzrec_gr.serving import server_for

SETTINGS = types.SimpleNamespace(embedding_dim=16, max_seq_len=12, num_heads=2, num_layers=3,
                                 dropout=0.0, num_negatives=8, temperature=0.05,
                                 num_candidates=4, backend=None)


def _model() -> OneLayerHSTU:
    torch.manual_seed(0)
    return OneLayerHSTU(**get_model(MODEL_NAME).trainer_kwargs(SETTINGS, 40, ())).eval()


def _history():
    lengths = torch.tensor([5, 3])
    ids = torch.randint(0, 40, (8,), generator=torch.Generator().manual_seed(1))
    return ids, lengths, 1000 + 60 * torch.arange(8)


def test_the_distribution_registers_the_model_through_its_entry_point():
    (ep,) = [ep for ep in importlib.metadata.entry_points(group="tzrec_gr.models")
             if ep.dist.metadata["Name"] == "tzrec-gr-model-example"]
    assert (ep.name, ep.value) == (MODEL_NAME, "tzrec_gr_model_example.model")
    record = get_model(MODEL_NAME)
    assert record.model_class is OneLayerHSTU and record.task == "retrieval"


def test_the_model_has_one_layer_whatever_the_settings_say():
    assert len(_model().transducer.stu.stu_layers) == 1


def test_the_server_extends_exactly_what_forward_gives():
    model = _model()
    server = server_for(model)
    assert type(server) is OneLayerHSTUServer
    ids, lengths, times = _history()
    full = model(ids, lengths, times)
    # the first 3 and 2 events prefilled, the other 2 and 1 appended
    head, tail = [0, 1, 2, 5, 6], [3, 4, 7]
    cache = server.prefill(ids[head], torch.tensor([3, 2]), times[head])
    rows, cache = server.extend(cache, ids[tail], torch.tensor([2, 1]), times[tail])
    torch.testing.assert_close(rows, full[tail], rtol=1e-5, atol=1e-5)
    users = model.user_embedding(ids, lengths, times)
    scores = server.score(cache, torch.arange(40))
    torch.testing.assert_close(scores, users @ model.item_embedding(torch.arange(40)).T,
                               rtol=1e-5, atol=1e-5)


def test_bad_input_names_the_argument():
    model = _model()
    ids, lengths, times = _history()
    with pytest.raises(ValueError, match=r"^lengths sums to 7 but item_ids has 8 rows"):
        model(ids, torch.tensor([4, 3]), times)
    with pytest.raises(ValueError, match=r"^item_ids must be in \[0, num_items=40\)"):
        model(ids + 40, lengths, times)
    with pytest.raises(ValueError, match=r"^item_ids must be an integer tensor"):
        model(ids.float(), lengths, times)


def test_the_server_refuses_another_model():
    hstu = HSTURetrieval(num_items=40, embedding_dim=16, num_layers=1, max_seq_len=12)
    with pytest.raises(TypeError, match=r"^OneLayerHSTUServer serves OneLayerHSTU models, "
                       r"got HSTURetrieval$"):
        OneLayerHSTUServer(hstu)


def test_a_training_step_lowers_the_loss():
    model = _model().train()
    ids, lengths, times = _history()
    negatives = torch.arange(40)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        loss = model.loss(ids, lengths, times, negatives=negatives)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
