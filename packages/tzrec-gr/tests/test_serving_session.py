"""tzrec_gr.serving's one serving API: catalogue_topk, ServingSession, Histories/Candidates.

What is checked against what:

* ``catalogue_topk`` == a dense stable sort of ``users @ items.T`` with the exclusions
  removed (ties by smaller id), for any chunk size, exclusion set and k;
* ``recommend`` == brute force over the model's ``user_embedding`` and ``item_embedding``;
* ``score`` == ``sigmoid(model(history + candidates))``;
* an opened user's answers == the stateless ones on the same history, and after
  ``extend`` == the stateless ones on the concatenated history;
* with CUDA graphs (GPU only) == eager, with the capture counted.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _models import (
    NUM_ITEMS,
    history_user,
    ranking_histories,
    ranking_model,
    ranking_user,
    retrieval_model,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from tzrec_gr.models import build_from_config
from tzrec_gr.serving import Candidates, Histories, ServingSession, catalogue_topk
from tzrec_ops.testing.tolerances import assert_close

# -- catalogue_topk -------------------------------------------------------------------------


def _dense_topk(users, items, k, exclude):
    scores = users @ items.t()
    for b, row in enumerate(exclude or []):
        scores[b, list(row)] = float("-inf")
    values, ids = torch.sort(scores, dim=1, descending=True, stable=True)
    values, ids = values[:, :k], ids[:, :k]
    return torch.where(torch.isinf(values), torch.full_like(ids, -1), ids), values


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 4),
    num_items=st.integers(1, 30),
    data=st.data(),
)
def test_catalogue_topk_equals_dense_sort(batch, num_items, data):
    k = data.draw(st.integers(1, num_items), label="k")
    chunk = data.draw(st.integers(1, num_items + 5), label="chunk")
    ties = data.draw(st.booleans(), label="ties")
    exclude = data.draw(
        st.one_of(
            st.none(),
            st.lists(
                st.lists(st.integers(0, num_items - 1), max_size=num_items + 3),
                min_size=batch,
                max_size=batch,
            ),
        ),
        label="exclude",
    )
    gen = torch.Generator().manual_seed(batch * 1000 + num_items)
    # multiples of 1/16 (1 with ties: many equal scores): every product and sum is exact,
    # so the chunked matmuls give the dense scores to the bit, whatever their shapes
    step = 1.0 if ties else 16.0
    users = (torch.randn(batch, 3, generator=gen) * step).round() / step
    items = (torch.randn(num_items, 3, generator=gen) * step).round() / step
    want_ids, want_scores = _dense_topk(users, items, k, exclude)
    for table in (items, lambda s, e: items[s:e]):
        got = catalogue_topk(
            users, table, k, exclude=exclude, chunk_size=chunk, num_items=num_items
        )
        assert torch.equal(got.ids, want_ids)
        assert torch.equal(got.scores, want_scores)
    if exclude is not None:  # the jagged (values, offsets) form
        lengths = torch.tensor([len(r) for r in exclude])
        values = torch.tensor([i for r in exclude for i in r], dtype=torch.int64)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        got = catalogue_topk(users, items, k, exclude=(values, offsets), chunk_size=chunk)
        assert torch.equal(got.ids, want_ids)


def test_catalogue_topk_fills_missing_slots_and_orders_ties_by_id():
    users = torch.ones(2, 2)
    items = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 0.0], [0.5, 0.5]])  # 1, 1, 2, 1
    got = catalogue_topk(users, items, 4, exclude=[[2, 0, 1], []], chunk_size=3)
    assert got.ids.tolist() == [[3, -1, -1, -1], [2, 0, 1, 3]]
    assert got.scores[0, 1:].isneginf().all() and got.scores[1].tolist() == [2, 1, 1, 1]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"k": 0}, r"k must be an int in \[1, num_items=4\]"),
        ({"k": 5}, r"k must be an int in \[1, num_items=4\]"),
        ({"exclude": [[1], [4]]}, r"exclude of user 1 holds item id 4, outside"),
        ({"exclude": [[1]]}, "exclude holds 1 users but user_embeddings has 2"),
        ({"items": torch.ones(4, 3)}, r"item_embeddings must be \[I, E\] with E = 2"),
        ({"items": lambda s, e: torch.ones(e - s, 2)}, "num_items is required"),
        ({"chunk_size": 0}, "chunk_size must be an int >= 1"),
    ],
)
def test_catalogue_topk_bad_arguments(kwargs, match):
    args = {"items": torch.ones(4, 2), "k": 2, **kwargs}
    items, k = args.pop("items"), args.pop("k")
    with pytest.raises(ValueError, match=match):
        catalogue_topk(torch.ones(2, 2), items, k, **args)


# -- retrieval ------------------------------------------------------------------------------


def _retrieval_histories(lengths):
    users = [history_user(n) for n in lengths]
    return Histories.from_lists(
        [u["item_id"].tolist() for u in users], [u["timestamp"].tolist() for u in users]
    )


@torch.no_grad()  # (the first forward with autograd imports torch's compiler: seconds)
def _brute_force(model, h: Histories, k):
    users = model.user_embedding(h.item_ids, h.lengths, h.timestamps)
    scores = users @ model.item_embedding(torch.arange(NUM_ITEMS)).t()
    for b in range(h.batch_size):
        scores[b, h.item_ids[h.offsets[b] : h.offsets[b + 1]]] = float("-inf")
    return scores, scores.sort(dim=1, descending=True, stable=True).values[:, :k]


def _check_recommendations(top, scores, best, k):
    assert top.ids.shape == (scores.shape[0], k)
    assert_close(top.scores, best.double(), torch.float32, name="top-k scores")
    # each returned id scores what it was returned with (so ties may differ, not items)
    assert_close(scores.gather(1, top.ids), top.scores.double(), torch.float32, name="ids")


def test_recommend_equals_brute_force():
    model = retrieval_model()
    session = ServingSession(model, chunk_size=7)
    h = _retrieval_histories([3, 1, 6])
    scores, best = _brute_force(model, h, 5)
    top = session.recommend(h, k=5)
    _check_recommendations(top, scores, best, 5)
    seen = set(h.item_ids[:3].tolist())
    assert not seen & set(top.ids[0].tolist())
    unfiltered = session.recommend(h, k=5, exclude_seen=False)
    with torch.no_grad():
        dense = model.user_embedding(h.item_ids, h.lengths, h.timestamps)
        dense = dense @ model.item_embedding(torch.arange(NUM_ITEMS)).t()
    assert_close(
        unfiltered.scores, dense.sort(1, descending=True).values[:, :5].double(), torch.float32
    )


def test_opened_users_and_extend_equal_the_stateless_answers():
    model = retrieval_model()
    session = ServingSession(model)
    users = [history_user(10) for _ in range(3)]

    def hist(parts, which=(0, 1, 2)):
        chosen = [users[i] for i in which]
        return Histories.from_lists(
            [u["item_id"][a:b].tolist() for u, (a, b) in zip(chosen, parts)],
            [u["timestamp"][a:b].tolist() for u, (a, b) in zip(chosen, parts)],
        )

    session.open(["a", "b", "c"], hist([(0, 3), (0, 1), (0, 5)]))
    assert len(session) == 3 and "b" in session
    opened = session.recommend(["c", "a"], k=4)
    fresh = session.recommend(hist([(0, 5), (0, 3)], which=(2, 0)), k=4)
    assert torch.equal(opened.ids, fresh.ids)
    assert_close(opened.scores, fresh.scores.double(), torch.float32)
    # events for two users (one gets none), then beyond max_seq_len = 12 for "c"
    session.extend(["a", "b"], hist([(3, 6), (1, 1)]))
    after = session.recommend(["a", "b"], k=4)
    want = session.recommend(hist([(0, 6), (0, 1)]), k=4)
    assert torch.equal(after.ids, want.ids)
    assert_close(after.scores, want.scores.double(), torch.float32)
    longer = history_user(9, start=int(users[2]["timestamp"][4]) + 1)
    session.extend(
        ["c"], Histories.from_lists([longer["item_id"].tolist()], [longer["timestamp"].tolist()])
    )
    window = torch.cat([users[2]["item_id"][:5], longer["item_id"]])[-12:]
    window_ts = torch.cat([users[2]["timestamp"][:5], longer["timestamp"]])[-12:]
    want = session.recommend(Histories.from_lists([window.tolist()], [window_ts.tolist()]), k=3)
    got = session.recommend(["c"], k=3)
    assert torch.equal(got.ids, want.ids)
    session.close(["a"])
    assert "a" not in session and session.user_ids == ["b", "c"]


def test_from_checkpoint_round_trip(tmp_path):
    kwargs = {
        "num_items": NUM_ITEMS,
        "embedding_dim": 16,
        "num_layers": 2,
        "dropout_ratio": 0.0,
        "max_seq_len": 12,
        "backend": "pytorch",
    }
    model = build_from_config({"model": "HSTURetrieval", "kwargs": kwargs}).eval()
    path = tmp_path / "best.pt"
    torch.save(
        {
            "format": 1,
            "model_config": {"model": "HSTURetrieval", "kwargs": kwargs},
            "model": model.state_dict(),
        },
        path,
    )
    h = _retrieval_histories([4, 2])
    loaded = ServingSession.from_checkpoint(path, device="cpu")
    want = ServingSession(model).recommend(h, k=6)
    got = loaded.recommend(h, k=6)
    assert torch.equal(got.ids, want.ids) and torch.equal(got.scores, want.scores)
    torch.save({"format": 2, "model_config": {}, "model": {}}, path)
    with pytest.raises(ValueError, match="checkpoint format 2, expected 1"):
        ServingSession.from_checkpoint(path)
    torch.save({"format": 1, "model_config": {"model": "SASRec", "kwargs": {}}, "model": {}}, path)
    with pytest.raises(ValueError, match="model must be one of HSTURanking, HSTURetrieval"):
        ServingSession.from_checkpoint(path)
    with pytest.raises(FileNotFoundError):
        ServingSession.from_checkpoint(tmp_path / "missing.pt")


# -- ranking --------------------------------------------------------------------------------


def _forward_probs(model, users):
    batch = {
        "uih.item_id": torch.cat([u["uih.item_id"] for u in users]),
        "uih.sequence_length": torch.tensor([u["uih.item_id"].numel() for u in users]),
        "uih_action.sequence": torch.cat([u["uih_action.sequence"] for u in users]),
        "uih_timestamp.sequence": torch.cat([u["uih_timestamp.sequence"] for u in users]),
        "candidate.item_id": torch.cat([u["candidate.item_id"] for u in users]),
        "candidate.sequence_length": torch.tensor([u["candidate.item_id"].numel() for u in users]),
        "candidate_timestamp.sequence": torch.cat(
            [u["candidate_timestamp.sequence"] for u in users]
        ),
        "contextual": torch.stack([u["contextual"] for u in users]),
        "query_time": torch.stack([u["query_time"] for u in users]),
    }
    with torch.no_grad():
        return torch.sigmoid(model(batch))


def test_score_equals_the_full_forward():
    model = ranking_model()
    session = ServingSession(model)
    users = [ranking_user(4, 3), ranking_user(7, 1), ranking_user(1, 4)]
    want = _forward_probs(model, users)
    cands = Candidates(
        torch.cat([u["candidate.item_id"] for u in users]),
        torch.tensor([3, 1, 4]),
        torch.cat([u["candidate_timestamp.sequence"] for u in users]),
    )
    got = session.score(ranking_histories(users), cands)
    assert got.shape == (8, 2)
    assert_close(got, want.double(), torch.float32, name="stateless")
    session.open([10, 11, 12], ranking_histories(users))
    assert_close(session.score([10, 11, 12], cands), want.double(), torch.float32, name="opened")
    # the candidates shown at the query time by default, [B, T] in, [B, T, K] out
    dense = torch.randint(0, NUM_ITEMS, (2, 3))
    for u, row in zip(users[:2], dense):
        u["candidate.item_id"] = row
        u["candidate_timestamp.sequence"] = u["query_time"].repeat(3)
    want = _forward_probs(model, users[:2])
    got = session.score([10, 11], dense)
    assert got.shape == (2, 3, 2)
    assert_close(got.reshape(6, 2), want.double(), torch.float32, name="dense")


@pytest.mark.parametrize("timed", [False, True], ids=["incremental", "re-encoded"])
def test_ranking_extend_equals_the_longer_history(timed):
    kw = (
        {}
        if timed
        else {"use_time_encoding": False, "max_contextual_seq_len": 0, "contextual_feature_dim": 0}
    )
    model = ranking_model(**kw)
    session = ServingSession(model)
    users = [ranking_user(8, 2), ranking_user(6, 2)]
    if not timed:
        for u in users:
            del u["contextual"]
            u["contextual"] = None

    def hist(parts):
        keys = ("uih.item_id", "uih_timestamp.sequence", "uih_action.sequence")
        rows = [{k: u[k][a:b] for k in keys} for u, (a, b) in zip(users, parts)]
        return Histories(
            item_ids=torch.cat([r[keys[0]] for r in rows]),
            lengths=torch.tensor([b - a for a, b in parts]),
            timestamps=torch.cat([r[keys[1]] for r in rows]),
            actions=torch.cat([r[keys[2]] for r in rows]),
            contextual=None if not timed else torch.stack([u["contextual"] for u in users]),
            query_time=torch.stack([u["query_time"] for u in users]),
        )

    cands = Candidates.from_lists([[1, 2], [3, 4]], [[int(u["query_time"])] * 2 for u in users])
    session.open(["x", "y"], hist([(0, 5), (0, 2)]))
    session.extend(["x", "y"], hist([(5, 8), (2, 6)]))
    want = session.score(hist([(0, 8), (0, 6)]), cands)
    assert_close(session.score(["x", "y"], cands), want.double(), torch.float32)


# -- bad input ------------------------------------------------------------------------------


def test_bad_inputs_name_the_argument_and_row():
    session = ServingSession(retrieval_model())
    ranking = ServingSession(ranking_model())
    cases = [
        (
            lambda: session.recommend(Histories.from_lists([[1, 2], [3, NUM_ITEMS]]), k=2),
            ValueError,
            rf"histories.item_ids of user 1 \(position 1\) is {NUM_ITEMS}",
        ),
        (
            lambda: session.recommend(
                Histories.from_lists([[1], [2, 3, 4]], [[5], [7, 9, 8]]), k=2
            ),
            ValueError,
            r"timestamps of user 1 are not sorted: position 2 \(8\)",
        ),
        (
            lambda: session.recommend(Histories.from_lists([[1], []]), k=2),
            ValueError,
            "histories of user 1 is empty",
        ),
        (
            lambda: session.recommend(Histories.from_lists([list(range(13))]), k=2),
            ValueError,
            "user 0 has 13 events, more than the model takes",
        ),
        (
            lambda: session.recommend(Histories.from_lists([[1]]), k=NUM_ITEMS + 1),
            ValueError,
            "k must be an int in",
        ),
        (lambda: session.recommend(["nobody"], k=2), ValueError, "were not opened"),
        (
            lambda: session.score(Histories.from_lists([[1]]), [[1]]),
            TypeError,
            "score needs an HSTURanking model; this session serves an HSTURetrieval",
        ),
        (
            lambda: ranking.recommend(Histories.from_lists([[1]]), k=2),
            TypeError,
            "recommend needs an HSTURetrieval model",
        ),
        (
            lambda: session.open([1, 1], Histories.from_lists([[1], [2]])),
            ValueError,
            r"user_ids\[1\] = 1 appears twice",
        ),
        (
            lambda: Histories(torch.tensor([1, 2]), torch.tensor([1]), torch.tensor([0, 1])),
            ValueError,
            "histories.lengths sums to 1 but histories.item_ids has 2 rows",
        ),
        (
            lambda: Histories(torch.tensor([1.0]), torch.tensor([1]), torch.tensor([0])),
            ValueError,
            "histories.item_ids must be an integer tensor",
        ),
        (lambda: ServingSession(torch.nn.Linear(2, 2)), TypeError, "model must be an"),
        (
            lambda: ServingSession(retrieval_model(), cuda_graphs="maybe"),
            ValueError,
            "cuda_graphs must be",
        ),
    ]
    if not torch.cuda.is_available():
        cases.append(
            (
                lambda: ServingSession(retrieval_model(), cuda_graphs="on"),
                ValueError,
                "cuda_graphs='on' needs a CUDA device",
            )
        )
    for call, error, match in cases:
        with pytest.raises(error, match=match):
            call()
    users = [ranking_user(3, 2), ranking_user(2, 1)]
    h = ranking_histories(users)
    with pytest.raises(ValueError, match="candidates are for 1 users but users has 2"):
        ranking.score(h, [[1]])
    with pytest.raises(ValueError, match=r"candidates of user 1: 5, more than the model's"):
        ranking.score(h, [[1], [1, 2, 3, 4, 5]])
    with pytest.raises(ValueError, match=r"candidates.item_ids of user 0 \(position 0\) is -1"):
        ranking.score(h, [[-1], [2]])
    no_actions = Histories(h.item_ids, h.lengths, h.timestamps, contextual=h.contextual)
    with pytest.raises(ValueError, match="histories.actions is required"):
        ranking.score(no_actions, [[1], [2]])
    no_context = Histories(h.item_ids, h.lengths, h.timestamps, h.actions)
    with pytest.raises(ValueError, match=r"histories.contextual \[B, 6\] is required"):
        ranking.score(no_context, [[1], [2]])
    ranking.open(["u", "v"], h)
    late = Histories.from_lists([[1], []], [[0], []], actions=[[1], []])
    with pytest.raises(ValueError, match="timestamps of user 0 start at 0, older than"):
        ranking.extend(["u", "v"], late)


# -- CUDA graphs (GPU) ----------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_graph_replay_equals_eager_and_is_reused(dtype):
    model = ranking_model(device="cuda").to(dtype)
    users = [ranking_user(5, 3), ranking_user(9, 2), ranking_user(2, 4)]
    h = ranking_histories(users)
    cands = Candidates.from_lists([[1, 2, 3], [4, 5], [6, 7, 8, 9]])
    eager = ServingSession(model, cuda_graphs="off")
    graphs = ServingSession(
        model, cuda_graphs="on", batch_buckets=(4,), length_buckets=(32,), candidate_buckets=(4,)
    )
    want = eager.score(h, cands)
    got = graphs.score(h, cands)
    assert_close(got, want.double(), dtype, name="graph vs eager")
    stats = graphs.graph_stats()
    assert stats["captures"] == 1 and stats["replays"] == 1, stats
    assert stats["graphs"][0]["capture_ms"] > 0 and stats["graphs"][0]["memory_bytes"] > 0
    # new candidates for opened users: the same graph, no new capture
    graphs.open(["a", "b", "c"], h)
    eager.open(["a", "b", "c"], h)
    other = Candidates.from_lists([[9], [8, 7, 6], [5]])
    for _ in range(2):
        got = graphs.score(["a", "b", "c"], other)
        assert_close(got, eager.score(["a", "b", "c"], other).double(), dtype)
    assert graphs.graph_stats()["captures"] == 1
    assert graphs.graph_stats()["replays"] == 3
    # two users in the batch-4 bucket: padded users, same graph
    got = graphs.score(["c", "a"], Candidates.from_lists([[1], [2, 3]]))
    want = eager.score(["c", "a"], Candidates.from_lists([[1], [2, 3]]))
    assert_close(got, want.double(), dtype)
    assert graphs.graph_stats()["captures"] == 1


@cuda
def test_graphs_fall_back_to_eager_outside_the_buckets():
    model = ranking_model(device="cuda")
    users = [ranking_user(5, 3) for _ in range(3)]
    h = ranking_histories(users)
    cands = Candidates.from_lists([[1, 2, 3]] * 3)
    session = ServingSession(
        model, batch_buckets=(2,), length_buckets=(32,), candidate_buckets=(4,)
    )
    want = ServingSession(model, cuda_graphs="off").score(h, cands)
    got = session.score(h, cands)  # 3 users > the batch-2 bucket
    assert_close(got, want.double(), torch.float32)
    stats = session.graph_stats()
    assert stats["captures"] == 0 and stats["eager_calls"] == 1, stats


@cuda
def test_recommend_on_cuda_equals_cpu():
    model = retrieval_model()
    h = _retrieval_histories([4, 7])
    want = ServingSession(copy.deepcopy(model)).recommend(h, k=5)
    got = ServingSession(model, device="cuda", chunk_size=8).recommend(h, k=5)
    assert_close(got.scores.cpu(), want.scores.double(), torch.float32)
