"""HSTURetrieval's ``input_projection``: the default keeps the preprocessor's Linear map;
False feeds the item table's rows to the positional encoder unchanged (input and output
embeddings tied). Checked against a float64 reference of the whole forward, and serving
against the forward."""

from __future__ import annotations

import math

import pytest
import torch
from _models import NUM_ITEMS, history_user, retrieval_batch, retrieval_model
from _reference import stu_layer as ref_stu_layer
from torch.nn import functional as F

from tzrec_gr.layers import Linear
from tzrec_gr.serving import server_for
from tzrec_ops.testing.tolerances import assert_close


def _reference_forward(model, ids, lengths):
    """[L, E] float64: sqrt(E) * item row + P[position], the STU layers, L2 norm."""
    weight = model.item_embeddings.weight.detach().double()
    encoder = model.transducer.positional_encoder
    table = encoder.position_embeddings_weight.detach().double()
    positions = torch.cat([torch.arange(n) for n in lengths.tolist()])
    x = math.sqrt(model.embedding_dim) * weight[ids] + table[positions]
    offsets = [0] + torch.cumsum(lengths, 0).tolist()
    for layer in model.transducer.stu.stu_layers:
        x = ref_stu_layer(layer, x, offsets, model.max_seq_len)
    return F.normalize(x, dim=-1, eps=1e-6)


def test_default_keeps_the_input_projection():
    model = retrieval_model()
    assert model.input_projection
    assert isinstance(model.transducer.input_preprocessor.projection, Linear)
    assert any("projection" in name for name, _ in model.named_parameters())


def test_without_projection_the_forward_matches_a_float64_reference():
    model = retrieval_model(input_projection=False).double()
    assert not any("projection" in name for name, _ in model.named_parameters())
    torch.manual_seed(1)
    users = [history_user(n) for n in (5, 1, 12, 7)]
    ids, lengths, ts = retrieval_batch(users, "cpu")
    out = model(ids, lengths, ts)
    # float64 throughout: the tolerance is float64's
    assert_close(out, _reference_forward(model, ids, lengths), torch.float64, name="forward")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_without_projection_serving_gives_what_forward_gives(dtype):
    model = retrieval_model(input_projection=False).to(dtype)
    torch.manual_seed(2)
    users = [history_user(9) for _ in range(3)]
    server = server_for(model)
    first = [{k: v[:4] for k, v in u.items()} for u in users]
    rest = [{k: v[4:] for k, v in u.items()} for u in users]
    cache = server.prefill(*retrieval_batch(first, "cpu"))
    out, cache = server.extend(cache, *retrieval_batch(rest, "cpu"))
    full = model(*retrieval_batch(users, "cpu"))
    rows = torch.cat([torch.arange(9 * b + 4, 9 * b + 9) for b in range(3)])
    assert_close(out, full[rows].double(), dtype, name="extended rows")
    candidates = torch.randint(0, NUM_ITEMS, (3, 5))
    users_now = full[[8, 17, 26]].double()
    expected = torch.einsum("be,bte->bt", users_now, model.item_embedding(candidates).double())
    assert_close(server.score(cache, candidates), expected, dtype, name="scores")
