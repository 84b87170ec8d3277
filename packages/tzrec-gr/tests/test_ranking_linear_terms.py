"""HSTURanking's ``linear_terms``: off by default (no extra parameter); on, each logit gains
``[user, item] @ W + b``. The head is checked against a float64 reference of its formula,
and one training step of each CPU backend against the pytorch backend in float64."""

from __future__ import annotations

import pytest
import torch
from _models import CPU_BACKENDS, NUM_ITEMS, ranking_batch, ranking_model, ranking_user

from tzrec_gr.models import HSTURanking
from tzrec_ops.testing.tolerances import assert_close


def _batch():
    torch.manual_seed(3)
    return ranking_batch([ranking_user(h, c) for h, c in ((6, 3), (0, 2), (10, 4))])


def test_off_by_default_with_no_parameters():
    model = ranking_model()
    assert not model.linear_terms and model.first_order is None
    assert not any("first_order" in name for name, _ in model.named_parameters())


def test_the_head_matches_a_float64_reference():
    model = ranking_model(linear_terms=True)
    assert model.linear_terms
    batch = _batch()
    logits = model(batch)
    with torch.no_grad():
        model64 = ranking_model(linear_terms=True).double()
        features, cand = model64.embed_features(batch)
        user = model64.transducer(
            features, model64.max_uih_len, model64.max_targets, query_time=batch["query_time"]
        ).candidate_embeddings
        w = model64.first_order.weight.detach()
        b = model64.first_order.bias.detach()
        # the MLP of the product, as without the option, plus the first-order terms by hand
        expected = model64.task_head(user * model64.item_tower(cand))
        expected = expected + user @ w[: user.shape[1]] + cand @ w[user.shape[1] :] + b
    assert logits.shape == (batch["candidate.item_id"].shape[0], 2)
    assert_close(logits, expected, torch.float32, name="logits")


def test_the_terms_move_the_logits():
    """The first-order map is used: zeroing it gives the logits of the product's MLP."""
    model = ranking_model(linear_terms=True)
    batch = _batch()
    with torch.no_grad():
        full = model(batch)
        model.first_order.weight.zero_()
        model.first_order.bias.zero_()
        product_only = model(batch)
    assert (full - product_only).abs().max() > 1e-3


def _trained_model(backend: str, dtype: torch.dtype) -> HSTURanking:
    torch.manual_seed(0)
    model = HSTURanking(
        NUM_ITEMS, 16, 16, [4, 2], [1 << bit for bit in range(8)], dropout_ratio=0.0,
        backend=backend, max_uih_len=12, max_targets=4, linear_terms=True,
    )
    return model.to(dtype).train()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_training_step_matches_the_float64_oracle(backend):
    torch.manual_seed(1)
    users = [ranking_user(h, c) for h, c in ((7, 3), (1, 4), (12, 2))]
    for user in users:
        del user["contextual"], user["query_time"]
    batch = ranking_batch(users)
    labels = torch.randint(0, 8, batch["candidate.item_id"].shape)
    results = []
    for model in (_trained_model(backend, torch.float32), _trained_model("pytorch", torch.float64)):
        loss = model.loss(model(batch, 12, 4), labels)
        loss.backward()
        results.append((loss.detach(), model.first_order.weight.grad))
    (loss, grad), (loss64, grad64) = results
    assert_close(loss, loss64, name="loss")
    assert_close(grad, grad64, grad=True, name="first_order.weight.grad")
