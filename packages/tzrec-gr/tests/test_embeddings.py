"""The id-table interface (tzrec_gr.embeddings): plain nn.Embedding by default, a torchrec
EmbeddingCollection on request, the same rows, outputs and gradients for the same weights."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
from _models import (
    NUM_ITEMS,
    history_user,
    ranking_batch,
    ranking_model,
    ranking_user,
    retrieval_batch,
    retrieval_model,
)
from torch import nn

from tzrec_gr import EmbeddingTable, TorchrecEmbeddingTable, embedding_table
from tzrec_gr.embeddings import init_rows_
from tzrec_gr.models import HSTURanking, HSTURetrieval
from tzrec_gr.serving import RetrievalServer

needs_torchrec = pytest.mark.skipif(
    importlib.util.find_spec("torchrec") is None,
    reason="needs torchrec (pip install 'tzrec-gr[torchrec]'; the test-torchrec session)",
)

TORCHREC_KEY = "item_embeddings.collection.embeddings.item.weight"

# HSTURetrieval(40, 8, num_layers=1) as checkpoints hold it (saved before the interface)
RETRIEVAL_CHECKPOINT = {
    "item_embeddings.weight": (40, 8),
    "transducer.input_preprocessor.projection.weight": (8, 8),
    "transducer.input_preprocessor.projection.bias": (8,),
    "transducer.stu.stu_layers.0._uvqk_weight": (8, 32),
    "transducer.stu.stu_layers.0._uvqk_beta": (32,),
    "transducer.stu.stu_layers.0._input_norm_weight": (8,),
    "transducer.stu.stu_layers.0._input_norm_bias": (8,),
    "transducer.stu.stu_layers.0._output_weight": (24, 8),
    "transducer.stu.stu_layers.0._output_norm_weight": (8,),
    "transducer.stu.stu_layers.0._output_norm_bias": (8,),
    "transducer.positional_encoder.position_embeddings_weight": (512, 8),
}


# ---------------------------------------------------------------------- plain (default)


def test_plain_tables_are_nn_embedding_and_keep_checkpoint_keys():
    table = embedding_table("plain", 10, 4)
    assert type(table) is nn.Embedding and isinstance(table, EmbeddingTable)
    model = HSTURetrieval(40, 8, num_layers=1)
    assert type(model.item_embeddings) is nn.Embedding
    checkpoint = {k: torch.randn(shape) for k, shape in RETRIEVAL_CHECKPOINT.items()}
    model.load_state_dict(checkpoint)  # strict: the same keys and shapes
    assert torch.equal(model.item_embeddings.weight, checkpoint["item_embeddings.weight"])
    ranking = HSTURanking(40, 8, 8, [1], [1], num_layers=1)
    assert type(ranking.item_embeddings) is nn.Embedding
    assert [k for k in ranking.state_dict() if "item_embeddings" in k] == ["item_embeddings.weight"]


def test_unknown_kind_names_the_argument():
    with pytest.raises(ValueError, match=r"embedding_tables must be one of 'plain', 'torchrec'"):
        embedding_table("sharded", 10, 4)
    with pytest.raises(ValueError, match=r"embedding_tables .* got 'dense'"):
        HSTURetrieval(40, 8, embedding_tables="dense")
    with pytest.raises(ValueError, match=r"embedding_tables .* got 'dense'"):
        HSTURanking(40, 8, 8, [1], [1], embedding_tables="dense")


def test_torchrec_missing_names_the_argument_and_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchrec", None)  # import torchrec raises ImportError
    message = (
        r"embedding_tables='torchrec' needs the optional dependency torchrec, which is not "
        r"installed: pip install 'tzrec-gr\[torchrec\]'"
    )
    with pytest.raises(ImportError, match=message):
        embedding_table("torchrec", 10, 4)
    with pytest.raises(ImportError, match=message):
        HSTURetrieval(40, 8, embedding_tables="torchrec")


# ---------------------------------------------------------------------- torchrec


def _table_pair(n: int = 12, d: int = 4):
    plain = embedding_table("plain", n, d)
    rec = embedding_table("torchrec", n, d)
    rec.load_state_dict(plain.state_dict())  # a plain table's state dict loads
    return plain, rec


@needs_torchrec
@pytest.mark.parametrize("shape", [(7,), (3, 5), (), (0,)])
def test_torchrec_table_rows_and_gradients_equal_plain(shape):
    plain, rec = _table_pair()
    assert isinstance(rec, TorchrecEmbeddingTable) and isinstance(rec, EmbeddingTable)
    assert (rec.num_embeddings, rec.embedding_dim) == (12, 4)
    assert list(rec.state_dict()) == ["collection.embeddings.item.weight"]
    assert torch.equal(rec.weight, plain.weight)
    ids = torch.randint(0, 12, shape)
    want, got = plain(ids), rec(ids)
    assert got.shape == (*shape, 4) and torch.equal(got, want)
    upstream = torch.randn(*shape, 4)
    (want * upstream).sum().backward()
    (got * upstream).sum().backward()
    assert torch.equal(rec.weight.grad, plain.weight.grad)


def _model_pair(make, **kw):
    plain = make(**kw)
    rec = make(embedding_tables="torchrec", **kw)
    rec.load_state_dict(plain.state_dict())
    assert isinstance(rec.item_embeddings, TorchrecEmbeddingTable)
    assert TORCHREC_KEY in rec.state_dict()
    return plain, rec


def _assert_same_grads(plain: nn.Module, rec: nn.Module) -> None:
    grads = {
        k.replace("collection.embeddings.item.", ""): p.grad for k, p in rec.named_parameters()
    }
    for name, p in plain.named_parameters():
        if p.grad is None:
            assert grads[name] is None, name
        else:
            torch.testing.assert_close(grads[name], p.grad, rtol=0, atol=0, msg=name)


@needs_torchrec
def test_retrieval_with_torchrec_table_equals_plain():
    plain, rec = _model_pair(retrieval_model)
    users = [history_user(5), history_user(0), history_user(3)]
    batch = retrieval_batch(users)
    assert torch.equal(rec(*batch), plain(*batch))
    negatives = torch.randint(0, NUM_ITEMS, (6,))
    plain.loss(*batch, negatives=negatives).backward()
    rec.loss(*batch, negatives=negatives).backward()
    _assert_same_grads(plain, rec)
    with torch.no_grad():
        candidates = torch.randint(0, NUM_ITEMS, (3, 4))
        servers = [RetrievalServer(m) for m in (plain, rec)]
        scores = [s.score(s.prefill(*batch), candidates) for s in servers]
    assert torch.equal(scores[1], scores[0])


@needs_torchrec
def test_ranking_with_torchrec_table_equals_plain():
    plain, rec = _model_pair(ranking_model)
    batch = ranking_batch([ranking_user(4, 2), ranking_user(0, 3), ranking_user(6, 1)])
    logits = [m(batch) for m in (plain, rec)]
    assert torch.equal(logits[1], logits[0])
    labels = torch.randint(0, 4, (logits[0].shape[0],))
    for model, out in zip((plain, rec), logits):
        model.loss(out, labels).backward()
    _assert_same_grads(plain, rec)


def test_a_factory_builds_the_table_and_is_checked():
    built = []

    def factory(num_embeddings, embedding_dim, *, name, device):
        built.append((num_embeddings, embedding_dim, name, device))
        return nn.Embedding(num_embeddings, embedding_dim, device=device)

    model = HSTURetrieval(40, 8, embedding_tables=factory)
    assert isinstance(model.item_embeddings, nn.Embedding)
    assert built == [(40, 8, "item", None)]
    with pytest.raises(TypeError, match=r"embedding_tables: the factory .* 40 rows of width 8"):
        HSTURetrieval(40, 8, embedding_tables=lambda n, d, **kw: nn.Embedding(n + 1, d))


@pytest.mark.parametrize(
    "first_row,rows,first_column,columns",
    [(0, 10, 0, 6), (3, 70_000, 2, 3), (65_530, 12, 0, 6), (131_072, 1, 5, 1)],
)
def test_init_rows_fills_a_shard_with_its_rows_of_the_whole_table(
    first_row, rows, first_column, columns
):
    whole = init_rows_(torch.empty(first_row + rows, 6), 0, seed=3)
    shard = init_rows_(torch.empty(rows, columns), first_row, seed=3, first_column=first_column,
                       table_width=6)
    torch.testing.assert_close(
        shard, whole[first_row:, first_column : first_column + columns], rtol=0, atol=0
    )
    assert abs(whole.std().item() - 0.02) < 0.002
    other = init_rows_(torch.empty(rows, columns), first_row, seed=4, first_column=first_column,
                       table_width=6)
    assert not torch.equal(shard, other)
