"""Preprocessors, the HSTU transducer (incl. torch.compile / torch.export) and the models."""

from __future__ import annotations

import pytest
import torch

from tzrec_gr import (
    ContextualInterleavePreprocessor,
    HSTUPositionalEncoder,
    HSTUTransducer,
    L2NormPostprocessor,
    SimpleActionEncoder,
    SimpleContextualizedMLP,
    SliceContentEncoder,
    STULayer,
    STUStack,
    UIHPreprocessor,
)
from tzrec_gr.models import HSTURanking, HSTURetrieval

PT = "pytorch"
E = 8


def _features(with_ctx=True):
    f = {
        "uih.sequence": torch.randn(5, 4),
        "uih.sequence_length": torch.tensor([2, 3]),
        "uih_timestamp.sequence": torch.tensor([10, 20, 30, 40, 50]),
        "uih_action.sequence": torch.tensor([1, 2, 3, 0, 1]),
        "candidate.sequence": torch.randn(3, 4),
        "candidate.sequence_length": torch.tensor([1, 2]),
        "candidate_timestamp.sequence": torch.tensor([25, 60, 61]),
    }
    if with_ctx:
        f["contextual"] = torch.randn(2, 2 * 3)
    return f


def _preprocessor(interleave=False, ctx=True):
    act = SimpleActionEncoder(2, [1, 2], backend=PT)
    return ContextualInterleavePreprocessor(
        4,
        4,
        E,
        SliceContentEncoder(4, 4, backend=PT),
        SimpleContextualizedMLP(4, E, 8, backend=PT),
        action_encoder=act,
        action_mlp=SimpleContextualizedMLP(act.output_dim, E, 8, backend=PT),
        contextual_feature_dim=3 if ctx else 0,
        max_contextual_seq_len=2 if ctx else 0,
        enable_interleaving=interleave,
        backend=PT,
    )


@pytest.mark.parametrize("interleave, training", [(False, True), (True, True), (True, False)])
def test_contextual_preprocessor_layout(interleave, training):
    pre = _preprocessor(interleave).train(training)
    out = pre(_features(), 3, 2)
    if not interleave:
        lengths, ts, targets, max_len = (
            [5, 7],
            [0, 0, 10, 20, 25, 0, 0, 30, 40, 50, 60, 61],
            [1, 2],
            7,
        )
    elif training:
        lengths, targets, max_len = [8, 12], [2, 4], 12
        ts = [0, 0, 10, 10, 20, 20, 25, 25, 0, 0, 30, 30, 40, 40, 50, 50, 60, 60, 61, 61]
    else:
        lengths, targets, max_len = [7, 10], [1, 2], 10
        ts = [0, 0, 10, 10, 20, 20, 25, 0, 0, 30, 30, 40, 40, 50, 50, 60, 61]
    assert out.seq_lengths.tolist() == lengths
    assert out.seq_offsets.tolist() == [0, lengths[0], sum(lengths)]
    assert out.seq_timestamps.tolist() == ts
    assert out.num_targets.tolist() == targets
    assert out.max_seq_len == max_len
    assert out.seq_embeddings.shape == (sum(lengths), E)
    assert out.total_uih_len + out.total_targets == sum(lengths)
    assert pre.interleave_targets() == (interleave and training)


def test_interleaved_rows_are_content_then_action():
    pre = _preprocessor(interleave=True, ctx=False).eval()
    f = _features(False)
    out = pre(f, 3, 2)
    flat = _preprocessor(interleave=False, ctx=False).eval()
    flat.load_state_dict(pre.state_dict())
    summed = flat(f, 3, 2).seq_embeddings
    # sample 0: (c0, a0, c1, a1, t0); content + action of history token 0 = summed row 0
    torch.testing.assert_close(out.seq_embeddings[0] + out.seq_embeddings[1], summed[0])


def test_uih_preprocessor_with_context():
    pre = UIHPreprocessor(4, E, contextual_feature_dim=3, max_contextual_seq_len=2, backend=PT)
    out = pre(_features(), 3)
    assert out.seq_lengths.tolist() == [4, 5]
    assert out.seq_timestamps.tolist() == [0, 0, 10, 20, 0, 0, 30, 40, 50]
    assert out.num_targets.tolist() == [0, 0] and out.total_targets == 0
    assert out.max_seq_len == 5


@pytest.mark.parametrize(
    "mutate, exc, match",
    [
        (lambda f: f.pop("candidate.sequence"), KeyError, "missing feature 'candidate.sequence'"),
        (
            lambda f: f.update({"candidate.sequence_length": torch.tensor([1, 1, 1])}),
            ValueError,
            "has B = 3 entries but uih.sequence_length has 2",
        ),
        (
            lambda f: f.update({"uih_timestamp.sequence": torch.tensor([1, 2])}),
            ValueError,
            "uih_timestamp.sequence has 2 rows but there are 5 history tokens",
        ),
        (
            lambda f: f.update({"candidate_timestamp.sequence": torch.tensor([1])}),
            ValueError,
            "candidate_timestamp.sequence has 1 rows but there are 3 candidate tokens",
        ),
        (
            lambda f: f.update({"contextual": torch.randn(3, 6)}),
            ValueError,
            r"contextual must be \[B=2",
        ),
        (lambda f: f.pop("uih_action.sequence"), KeyError, "missing feature 'uih_action.sequence'"),
    ],
)
def test_preprocessor_input_errors(mutate, exc, match):
    f = _features()
    mutate(f)
    with pytest.raises(exc, match=match):
        _preprocessor()(f, 3, 2)


def test_preprocessor_constructor_errors():
    mlp = SimpleContextualizedMLP(4, E, 8)
    with pytest.raises(ValueError, match="enable_interleaving=True needs an action_encoder"):
        ContextualInterleavePreprocessor(
            4, 4, E, SliceContentEncoder(4, 4), mlp, enable_interleaving=True
        )
    with pytest.raises(ValueError, match="action_encoder needs an action_mlp"):
        ContextualInterleavePreprocessor(
            4, 4, E, SliceContentEncoder(4, 4), mlp, action_encoder=SimpleActionEncoder(2, [1])
        )
    with pytest.raises(
        ValueError, match=r"content_mlp.output_dim \(8\) must equal output_embedding_dim \(6\)"
    ):
        ContextualInterleavePreprocessor(4, 4, 6, SliceContentEncoder(4, 4), mlp)
    with pytest.raises(ValueError, match="must both be > 0 or both 0"):
        UIHPreprocessor(4, E, contextual_feature_dim=3)


def _transducer(interleave=False, full=False, truncate=False, **kw):
    pre = _preprocessor(interleave)
    layers = [
        STULayer(E, 2, 4, 4, output_dropout_ratio=0.0, contextual_seq_len=2, backend=PT)
        for _ in range(2)
    ]
    stack = STUStack(layers, 1, 2) if truncate else STUStack(layers)
    return HSTUTransducer(
        pre,
        stack,
        positional_encoder=HSTUPositionalEncoder(
            E, 16, 8, use_time_encoding=True, contextual_seq_len=2, backend=PT
        ),
        output_postprocessor=L2NormPostprocessor(),
        return_full_embeddings=full,
        backend=PT,
        **kw,
    )


@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("full", [False, True])
@pytest.mark.parametrize("truncate", [False, True])
def test_transducer_outputs(interleave, full, truncate):
    model = _transducer(interleave, full, truncate).train()
    out = model(_features(), 3, 2)
    assert out.candidate_embeddings.shape == (3, E)
    torch.testing.assert_close(out.candidate_embeddings.norm(dim=-1), torch.ones(3))
    assert (out.full_embeddings is not None) == full
    if full:
        assert out.full_embeddings.shape[0] == int(out.seq_offsets[-1])
    out.candidate_embeddings.sum().backward()


def test_transducer_candidates_are_last_rows_of_full_output():
    model = _transducer(full=True).eval()
    out = model(_features(), 3, 2)
    full = out.full_embeddings
    torch.testing.assert_close(out.candidate_embeddings, full[[4, 10, 11]])


def test_transducer_truncation_sync_free_matches_synced():
    model = _transducer(truncate=True).eval()
    f = _features()
    synced = model(f, 3, 2).candidate_embeddings
    # lengths [5, 7], C = 2, tail 2: sample 1 drops one history token -> 11 rows, max 6
    # (the exact max, which the synced plan uses as the attention divisor)
    free = model(f, 3, 2, truncated_total_len=11, truncated_max_seq_len=6).candidate_embeddings
    torch.testing.assert_close(free, synced)


def test_transducer_constructor_errors():
    pre = _preprocessor()
    stack = STUStack([STULayer(16, 2, 4, 4, backend=PT)])
    with pytest.raises(
        ValueError, match=r"output_dim \(8\) must equal the STU embedding_dim \(16\)"
    ):
        HSTUTransducer(pre, stack)
    stack = STUStack([STULayer(E, 2, 4, 4, backend=PT)])
    with pytest.raises(ValueError, match=r"positional_encoder.contextual_seq_len \(0\) must equal"):
        HSTUTransducer(pre, stack, HSTUPositionalEncoder(E, 8, 4, use_time_encoding=True))


def test_transducer_compiles():
    model = _transducer().eval()
    f = _features()
    expected = model(f, 3, 2).candidate_embeddings
    compiled = torch.compile(model, backend="eager", fullgraph=False)
    torch.testing.assert_close(compiled(f, 3, 2).candidate_embeddings, expected)
    inductor = torch.compile(model)
    torch.testing.assert_close(
        inductor(f, 3, 2).candidate_embeddings, expected, rtol=1e-5, atol=1e-5
    )


def test_transducer_exports():
    model = _transducer().eval()

    class Wrapped(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, features):
            return self.inner(features, 3, 2).candidate_embeddings

    f = _features()
    wrapped = Wrapped(model)
    exported = torch.export.export(wrapped, (f,), strict=False)
    torch.testing.assert_close(exported.module()(f), wrapped(f))


def test_retrieval_model_trains():
    torch.manual_seed(1)
    model = HSTURetrieval(50, 8, num_layers=2, num_negatives=16, dropout_ratio=0.0, backend=PT)
    ids = torch.randint(0, 50, (9,))
    lengths = torch.tensor([4, 5])
    ts = torch.arange(9) * 60
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    negatives = torch.randint(0, 50, (16,))
    first = None
    for _ in range(30):
        loss = model.loss(ids, lengths, ts, 5, negatives)
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = first if first is not None else loss.item()
    assert loss.item() < 0.5 * first
    assert model.user_embedding(ids, lengths, ts, 5).shape == (2, 8)


def test_retrieval_loss_matches_manual_softmax():
    model = HSTURetrieval(
        20, 8, num_layers=1, num_negatives=4, dropout_ratio=0.0, backend=PT
    ).eval()
    ids = torch.tensor([1, 2, 3, 4, 5])
    lengths = torch.tensor([3, 2])
    ts = torch.arange(5)
    neg = torch.tensor([7, 8, 2, 9])
    user = model(ids, lengths, ts, 3)
    items = model.item_embedding(torch.arange(20))
    losses = []
    for row, nxt in ((0, 2), (1, 3), (3, 5)):  # positions with a next item in the same sample
        logits = [user[row] @ items[nxt]] + [user[row] @ items[n] for n in neg.tolist() if n != nxt]
        logits = torch.stack(logits) / model.temperature
        losses.append(torch.logsumexp(logits, 0) - logits[0])
    torch.testing.assert_close(model.loss(ids, lengths, ts, 3, neg), torch.stack(losses).mean())


def test_ranking_model_trains_and_scores():
    model = HSTURanking(
        30,
        4,
        E,
        [1, 2],
        [1, 2, 4],
        contextual_feature_dim=3,
        max_contextual_seq_len=2,
        dropout_ratio=0.0,
        backend=PT,
    )
    batch = {
        "uih.item_id": torch.tensor([1, 2, 3, 4, 5]),
        "uih.sequence_length": torch.tensor([2, 3]),
        "uih_action.sequence": torch.tensor([1, 2, 3, 0, 1]),
        "uih_timestamp.sequence": torch.tensor([10, 20, 30, 40, 50]),
        "candidate.item_id": torch.tensor([6, 7, 8]),
        "candidate.sequence_length": torch.tensor([1, 2]),
        "candidate_timestamp.sequence": torch.tensor([25, 60, 61]),
        "contextual": torch.randn(2, 6),
    }
    labels = torch.tensor([1, 2, 3])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = None
    for _ in range(30):
        loss = model.loss(model(batch, 3, 2), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = first if first is not None else loss.item()
    assert loss.item() < 0.5 * first
    with pytest.raises(ValueError, match=r"labels must be \[L_t\] = \[3\]"):
        model.loss(model(batch, 3, 2), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="task_weights has 1 entries"):
        HSTURanking(30, 4, E, [1, 2], [1], task_weights=[1.0])
