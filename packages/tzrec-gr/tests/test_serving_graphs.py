"""ServingSession's CUDA graphs: buckets, synthetic buffers, padding, warm-up.

What is checked against what (CPU unless marked ``gpu``):

* a bucket's buffers built from the model's sizes alone (no request) == what a real
  request builds: the same layers, widths, dtypes, devices and optional fields;
* the padded step run eagerly on those buffers, loaded with a real request == the eager
  call (ranking ``score``: the model's ``score``; retrieval ``recommend`` of opened users:
  ``catalogue_topk``, same ids and scores) for several batch sizes, k and seen lengths;
* bucket choice, the fallback outside the buckets and ``max_graphs``, and ``warm_up``'s
  bookkeeping, with the capture replaced by an eager run of the step (no CUDA here);
* ``warm_up`` without CUDA graphs captures nothing and says why;
* on a GPU (``-m gpu``): real captures == eager (same ids, equal scores for
  ``recommend``), ``warm_up`` captures before the first request, which then only replays.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _models import (
    NUM_ITEMS,
    gpu_test,
    history_user,
    ranking_histories,
    ranking_model,
    ranking_user,
    retrieval_model,
)

from tzrec_gr.features import CANDIDATE_ITEM_ID, CANDIDATE_LENGTHS, CANDIDATE_TIMESTAMPS
from tzrec_gr.serving import (
    Candidates,
    Histories,
    RankingServer,
    ServingSession,
    catalogue_topk,
)
from tzrec_gr.serving._graphs import GraphPool, GraphSet
from tzrec_gr.serving._recommend_graphs import RecommendGraphs
from tzrec_gr.serving._score_graphs import ScoreGraphs, static_cache
from tzrec_ops.testing.tolerances import assert_close


def _retrieval_histories(lengths):
    users = [history_user(n) for n in lengths]
    return Histories.from_lists(
        [u["item_id"].tolist() for u in users], [u["timestamp"].tolist() for u in users]
    )


def _eager_capture(self, entry):
    """A stand-in for the CUDA capture: the step run eagerly, and a 'graph' that runs it
    again on replay (so the bookkeeping around captures runs on the CPU)."""

    class Replay:
        def replay(self_inner):
            entry.out = self.step(entry)

    entry.graph, entry.out = Replay(), self.step(entry)
    entry.capture_ms = 1.0
    self.captures += 1


# -- ranking: synthetic buffers and the padded step -----------------------------------------


@pytest.mark.parametrize(
    "dtype, timed",
    [(torch.float32, True), (torch.float32, False), (torch.bfloat16, True)],
    ids=["fp32", "fp32-untimed", "bf16"],
)
def test_static_cache_has_the_layout_of_a_real_cache(dtype, timed):
    kw = {} if timed else {"use_time_encoding": False, "max_contextual_seq_len": 0}
    if not timed:
        kw["contextual_feature_dim"] = 0
    model = ranking_model(**kw).to(dtype)
    users = [ranking_user(4, 2), ranking_user(7, 1)]
    if not timed:
        for u in users:
            u["contextual"] = None
    session = ServingSession(model)
    session.open(["a", "b"], ranking_histories(users))
    real = session._assemble(["a", "b"], session._users.states("users", ["a", "b"]))
    fake, lengths_host = static_cache(session.server, 4, 16, torch.device("cpu"))
    assert len(fake.keys) == len(real.keys) and len(fake.values) == len(real.values)
    for got, want in zip(fake.keys + fake.values, real.keys + real.values):
        assert got.shape == (4 * 16, want.shape[1])
        assert (got.dtype, got.device) == (want.dtype, want.device)
    for name in ("query_time", "contextual"):
        got, want = getattr(fake, name), getattr(real, name)
        assert (got is None) == (want is None), name
        if want is not None:
            assert got.shape == (4, *want.shape[1:]) and got.dtype == want.dtype, name
    assert fake.offsets.tolist() == [0, 16, 32, 48, 64] and fake.max_len == 16
    assert fake.owner == real.owner and fake.user_embeddings is None
    assert lengths_host.tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("batch", [1, 3])
def test_padded_score_step_run_eagerly_equals_score(batch):
    model = ranking_model()
    users = [ranking_user(n, 1) for n in (5, 2, 9)[:batch]]
    session = ServingSession(model)
    ids = [f"u{i}" for i in range(batch)]
    session.open(ids, ranking_histories(users))
    cache = session._assemble(ids, session._users.states("users", ids))
    cands = Candidates.from_lists([[1, 2, 3], [4], [5, 6]][:batch])
    lengths = cands.lengths
    query_time = torch.stack([u["query_time"] for u in users])
    ts = query_time.repeat_interleave(lengths)
    server = RankingServer(model)
    graphs = ScoreGraphs(server, torch.device("cpu"), GraphPool(), (4,), (32,), (4,), 8)
    bucket = graphs.bucket(batch, int(cache.lengths.max()), int(lengths.max()))
    assert bucket == (4, 32, 4)
    entry = graphs.new_entry(bucket)
    graphs.fill_synthetic(entry)
    graphs.step(entry)  # the synthetic inputs run (what a warm-up captures)
    graphs.load_cache(entry, cache)
    slots = graphs.load_candidates(entry, cands.item_ids, lengths, ts, query_time)
    got = graphs.step(entry).index_select(0, slots)
    want = session.server.score(
        cache,
        {CANDIDATE_ITEM_ID: cands.item_ids, CANDIDATE_LENGTHS: lengths, CANDIDATE_TIMESTAMPS: ts},
    )
    assert_close(got, want.double(), torch.float32, name="padded score_step")


def test_score_buckets_and_warm_up_buckets():
    model = ranking_model()
    server = RankingServer(model)
    graphs = ScoreGraphs(server, torch.device("cpu"), GraphPool(), (1, 4), (16, 32), (2, 4), 8)
    assert graphs.bucket(3, 17, 0) == (4, 32, 2)
    assert graphs.bucket(5, 1, 1) is None and graphs.bucket(1, 33, 1) is None
    sizes = {"batch_sizes": [3, 4], "lengths": None, "candidates": [1], "k": None}
    assert graphs.warm_up_buckets(sizes, True) == [(4, 16, 2), (4, 32, 2)]
    assert len(graphs.warm_up_buckets(dict(sizes, batch_sizes=None, candidates=None), True)) == 8
    with pytest.raises(ValueError, match=r"lengths\[1\] = 40 fits no bucket \(the largest is 32\)"):
        graphs.warm_up_buckets(dict(sizes, lengths=[2, 40]), True)


def test_warm_up_bookkeeping_with_an_eager_stand_in(monkeypatch):
    monkeypatch.setattr(GraphSet, "_capture", _eager_capture)
    model = ranking_model()
    server = RankingServer(model)
    graphs = ScoreGraphs(server, torch.device("cpu"), GraphPool(), (1, 4), (16, 32), (2,), 3)
    report = graphs.warm_up(
        graphs.warm_up_buckets(dict.fromkeys(("batch_sizes", "lengths", "candidates", "k")), True),
        strict=False,
    )
    assert [tuple(b.values()) for b in report["captured"]] == [(1, 16, 2), (1, 32, 2), (4, 16, 2)]
    assert [tuple(b.values()) for b in report["skipped"]] == [(4, 32, 2)]  # max_graphs = 3
    again = graphs.warm_up([(1, 16, 2), (4, 32, 2)], strict=False)
    assert len(again["present"]) == 1 and len(again["skipped"]) == 1 and not again["captured"]
    stats = graphs.stats()
    assert stats["captures"] == 3 and all(g["warm_up"] for g in stats["graphs"])
    assert graphs.bucket(4, 20, 1) is None  # no room: eager


# -- retrieval: recommend of opened users ---------------------------------------------------


def _opened_retrieval(lengths, **kw):
    model = retrieval_model(**kw)
    session = ServingSession(model, chunk_size=7)
    ids = list(range(len(lengths)))
    session.open(ids, _retrieval_histories(lengths))
    return model, session, ids


def test_recommend_buffers_have_the_layout_of_real_embeddings():
    model, session, ids = _opened_retrieval([3, 5])
    states = session._users.states("users", ids)
    real = torch.stack([s.user_embedding for s in states])
    graphs = RecommendGraphs(
        session._items,
        NUM_ITEMS,
        model.embedding_dim,
        next(model.parameters()).dtype,
        torch.device("cpu"),
        GraphPool(),
        (4,),
        (8,),
        7,
        8,
    )
    entry = graphs.new_entry((4, 5, 8))
    assert entry.users.shape == (4, real.shape[1])
    assert (entry.users.dtype, entry.users.device) == (real.dtype, real.device)
    assert entry.seen.dtype == torch.int64 and entry.seen.shape == (32,)
    assert entry.seen_user.tolist() == [b for b in range(4) for _ in range(8)]
    assert graphs.new_entry((4, 5, 0)).seen is None


def test_scan_pads_users_to_a_power_of_two_so_padding_changes_no_bit():
    gen = torch.Generator().manual_seed(3)
    users = torch.nn.functional.normalize(torch.randn(5, 16, generator=gen), dim=1)
    items = torch.nn.functional.normalize(torch.randn(300, 16, generator=gen), dim=1)
    for batch, padded in ((3, 4), (5, 8), (1, 1)):
        want = catalogue_topk(users[:batch], items, 7, chunk_size=64)
        rows = torch.cat([users[:batch], users.new_zeros(padded - batch, 16)])
        got = catalogue_topk(rows, items, 7, chunk_size=64)
        assert torch.equal(got.ids[:batch], want.ids)
        assert torch.equal(got.scores[:batch], want.scores)


def _cpu_recommend_graphs(session, batch_buckets, seen_buckets):
    """Recommend graphs of the test retrieval model on the CPU (buffers and buckets only:
    nothing is captured): 7 catalogue items per chunk, at most 8 graphs."""
    return RecommendGraphs(
        session._items,
        NUM_ITEMS,
        16,
        torch.float32,
        torch.device("cpu"),
        GraphPool(),
        batch_buckets,
        seen_buckets,
        7,
        8,
    )


def test_recommend_buckets():
    model, session, _ = _opened_retrieval([2])
    graphs = _cpu_recommend_graphs(session, (1, 2, 4), (8, 16))
    assert graphs.bucket(3, 5, 7) == (4, 5, 8)
    odd = _cpu_recommend_graphs(session, (3, 48), (8,))
    assert odd.batch_buckets == (1, 2, 4, 8, 16, 32, 48)
    assert graphs.bucket(3, 5, 9) == (4, 5, 16)
    assert graphs.bucket(1, 5, None) == (1, 5, 0)  # nothing excluded
    assert graphs.bucket(5, 5, 1) is None and graphs.bucket(1, 5, 17) is None
    assert graphs.bucket(1, 0, 1) is None and graphs.bucket(1, NUM_ITEMS + 1, 1) is None
    sizes = {"batch_sizes": [3], "lengths": [1, 9], "candidates": None, "k": [5, 10]}
    assert graphs.warm_up_buckets(sizes, True) == [(4, 5, 8), (4, 5, 16), (4, 10, 8), (4, 10, 16)]
    assert graphs.warm_up_buckets(dict(sizes, k=None), False) == [(4, 10, 0)]
    with pytest.raises(ValueError, match=r"k\[0\] = 41 must be an int in \[1, num_items=40\]"):
        graphs.warm_up_buckets(dict(sizes, k=[41]), True)


@pytest.mark.parametrize("exclude_seen", [True, False], ids=["seen-excluded", "all"])
@pytest.mark.parametrize("lengths, k", [([3], 5), ([3, 12, 1], 4), ([6, 2, 9, 4, 11], 40)])
def test_padded_recommend_run_eagerly_equals_catalogue_topk(lengths, k, exclude_seen):
    model, session, ids = _opened_retrieval(lengths)
    states = session._users.states("users", ids)
    embeddings = torch.stack([s.user_embedding for s in states])
    seen = [s.item_ids for s in states]
    graphs = _cpu_recommend_graphs(session, (1, 2, 8), (4, 16))
    bucket = graphs.bucket(len(ids), k, max(t.numel() for t in seen) if exclude_seen else None)
    entry = graphs.new_entry(bucket)
    graphs.fill_synthetic(entry)
    graphs.step(entry)  # the synthetic inputs run (what a warm-up captures)
    graphs.load(entry, embeddings, seen if exclude_seen else None)
    out = graphs.step(entry)
    want = catalogue_topk(
        embeddings, session._items(), k, exclude=seen if exclude_seen else None, chunk_size=7
    )
    assert torch.equal(out.ids[: len(ids)], want.ids)
    assert torch.equal(out.scores[: len(ids)], want.scores)
    assert torch.equal(session.recommend(ids, k, exclude_seen=exclude_seen).ids, want.ids)


def test_session_recommend_through_the_graph_path(monkeypatch):
    """The session's graph plumbing (bucket, load, replay, slice, fallback, stats) on the
    CPU, with the capture replaced by an eager run of the step."""
    monkeypatch.setattr(GraphSet, "_capture", _eager_capture)
    model, session, ids = _opened_retrieval([3, 12, 1])
    eager = copy.deepcopy(session)
    session._graphs = RecommendGraphs(
        session._items,
        NUM_ITEMS,
        16,
        torch.float32,
        torch.device("cpu"),
        session._pool,
        (2, 4),  # (used as 1, 2, 4: a request and its bucket pad to the same power of two)
        (4, 16),
        7,
        2,
    )
    report = session.warm_up(batch_sizes=[3], lengths=[12], k=[5])
    assert report["reason"] is None and report["captured"] == [{"batch": 4, "k": 5, "seen": 16}]
    for users, k in ((ids, 5), (ids[::-1], 5), (ids[:1], 5), (ids[:2], 3)):
        got, want = session.recommend(users, k), eager.recommend(users, k)
        assert torch.equal(got.ids, want.ids) and torch.equal(got.scores, want.scores)
    stats = session.graph_stats()
    assert stats["step"] == "recommend" and stats["captures"] == 2, stats
    assert stats["replays"] == 3 and stats["eager_calls"] == 1  # k=3: no room (max_graphs 2)
    assert [g["warm_up"] for g in stats["graphs"]] == [True, False]
    assert stats["warm_up"] is report
    # fresh Histories stay eager; new events reach the graph's answers
    session.recommend(_retrieval_histories([4]), 5)
    assert session.graph_stats()["replays"] == 3
    more = Histories.from_lists([[7, 8]], [[10**6, 10**6 + 1]])
    session.extend([0], more)
    eager.extend([0], more)
    got, want = session.recommend(ids, 5), eager.recommend(ids, 5)
    assert torch.equal(got.ids, want.ids) and torch.equal(got.scores, want.scores)


# -- warm_up without CUDA graphs ------------------------------------------------------------


def test_warm_up_without_cuda_graphs_captures_nothing_and_says_why():
    session = ServingSession(retrieval_model())
    report = session.warm_up()
    assert not report["captured"] and report["capture_ms"] == 0.0 and report["memory_bytes"] == 0
    assert "no CUDA graphs here (cuda_graphs='auto' on device cpu)" in report["reason"]
    stats = session.graph_stats()
    assert stats["enabled"] is False and stats["captures"] == 0 and stats["warm_up"] is report
    with pytest.raises(ValueError, match=r"candidates is for score \(ranking\)"):
        session.warm_up(candidates=[2])
    ranking = ServingSession(ranking_model())
    with pytest.raises(ValueError, match=r"k is for recommend \(retrieval\)"):
        ranking.warm_up(k=[10])
    with pytest.raises(ValueError, match="batch_sizes must be ints >= 1"):
        ranking.warm_up(batch_sizes=[0])
    assert ranking.warm_up(batch_sizes=[2], lengths=[8], candidates=[3])["captured"] == []


@pytest.mark.parametrize("kind", ["retrieval", "ranking"])
def test_warm_up_runs_the_eager_calls_once_per_shape(kind, monkeypatch):
    """Encoding (and, where extends are incremental, extending) synthetic users at the
    batch bucket of each size, before any request; no user is opened."""
    model = retrieval_model() if kind == "retrieval" else ranking_model()
    session = ServingSession(model)
    server = session.server
    seen = []
    prefill, extend = server.prefill_histories, server.extend_histories
    monkeypatch.setattr(
        server,
        "prefill_histories",
        lambda h, d: seen.append(("encode", h.batch_size, h.lengths.tolist())) or prefill(h, d),
    )
    monkeypatch.setattr(
        server,
        "extend_histories",
        lambda c, h, d: seen.append(("extend", h.batch_size, h.lengths.tolist()))
        or extend(c, h, d),
    )
    bound = server.max_events
    report = session.warm_up(batch_sizes=[3, 1], histories=[2, bound], events=[1, 4])
    assert report["encoded"] == [
        {"batch": b, "events": n} for b in (1, 4) for n in (2, bound)
    ]  # 3 users: the batch bucket of 4
    if kind == "retrieval":  # incremental: every extend that stays within the bound
        assert report["extended"] == [
            {"batch": b, "history": 2, "events": e} for b in (1, 4) for e in (1, 4)
        ]
    else:  # time encoding: extended users are encoded whole, nothing else to run
        assert report["extended"] == []
    assert [s[0] for s in seen].count("encode") == 4 and len(session) == 0
    assert report["encode_seconds"] >= 0 and report["seconds"] >= report["encode_seconds"]
    with pytest.raises(ValueError, match=rf"histories must be ints in \[1, {bound}\]"):
        session.warm_up(histories=[bound + 1])
    with pytest.raises(ValueError, match="events must be ints in"):
        session.warm_up(events=[0])


# -- GPU: real captures ---------------------------------------------------------------------

@gpu_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_recommend_graphs_equal_eager(dtype):
    model = retrieval_model(device="cuda").to(dtype)
    lengths = [3, 12, 1, 7, 9]
    h = _retrieval_histories(lengths)
    ids = list(range(len(lengths)))
    eager = ServingSession(model, cuda_graphs="off", chunk_size=16)
    # the encode eager in both, so the caches are the same bits and the recommend graph alone
    # is compared (the encode's graphs pad the batch: equal within tolerance, tested apart)
    graphs = ServingSession(
        model, cuda_graphs="on", chunk_size=16, batch_buckets=(2, 8), length_buckets=(4, 16),
        encode_graphs=False,
    )
    for s in (eager, graphs):
        s.open(ids, h)
    for users, k, exclude in (
        (ids, 5, True),
        (ids, 5, True),
        (ids[:2], 5, True),
        (ids[3:], 5, True),
        (ids, 40, True),
        (ids, 5, False),
        (ids[::-1], 5, True),
    ):
        got = graphs.recommend(users, k, exclude_seen=exclude)
        want = eager.recommend(users, k, exclude_seen=exclude)
        assert torch.equal(got.ids, want.ids), (users, k, exclude)
        assert torch.equal(got.scores, want.scores), (users, k, exclude)
    stats = graphs.graph_stats()
    assert stats["step"] == "recommend" and stats["captures"] == 4, stats
    assert stats["replays"] == 7 and stats["eager_calls"] == 0
    assert all(g["capture_ms"] > 0 and g["memory_bytes"] > 0 for g in stats["graphs"])
    # new events: the stored embeddings change, the graph reads them
    more = Histories.from_lists([[7, 8], [1]], [[10**6, 10**6 + 1], [10**6]])
    for s in (eager, graphs):
        s.extend([0, 2], more)
    got, want = graphs.recommend(ids, 5), eager.recommend(ids, 5)
    assert torch.equal(got.ids, want.ids) and torch.equal(got.scores, want.scores)
    # 9 users: outside the batch buckets, eager
    graphs.open([9, 10, 11, 12], _retrieval_histories([2, 2, 2, 2]))
    graphs.recommend(ids + [9, 10, 11, 12], 5)
    assert graphs.graph_stats()["eager_calls"] == 1


@gpu_test
def test_gpu_warm_up_captures_before_the_first_request():
    model = ranking_model(device="cuda")
    users = [ranking_user(5, 3), ranking_user(9, 2), ranking_user(2, 4)]
    h = ranking_histories(users)
    cands = Candidates.from_lists([[1, 2, 3], [4, 5], [6, 7, 8, 9]])
    eager = ServingSession(model, cuda_graphs="off")
    session = ServingSession(
        model, batch_buckets=(4,), length_buckets=(32,), candidate_buckets=(4,)
    )
    report = session.warm_up()
    assert report["reason"] is None and len(report["captured"]) == 1, report
    assert report["capture_ms"] > 0 and report["memory_bytes"] > 0
    got = session.score(h, cands)
    assert_close(got, eager.score(h, cands).double(), torch.float32, name="after warm_up")
    stats = session.graph_stats()
    assert stats["captures"] == 1 and stats["replays"] == 1, stats
    assert stats["graphs"][0]["warm_up"] is True and stats["warm_up"] is report
    # retrieval: warm-up for k=5, then recommend only replays
    retrieval = retrieval_model(device="cuda")
    session = ServingSession(retrieval, batch_buckets=(4,), length_buckets=(16,),
                             encode_graphs=False)  # the recommend graph alone, bit for bit
    # (recommend's user buckets are the powers of two up to the largest: 1, 2, 4)
    assert len(session.warm_up(k=[5])["captured"]) == 3
    rh = _retrieval_histories([3, 12])
    session.open([1, 2], rh)
    want = ServingSession(retrieval, cuda_graphs="off")
    want.open([1, 2], rh)
    got, ref = session.recommend([1, 2], 5), want.recommend([1, 2], 5)
    assert torch.equal(got.ids, ref.ids) and torch.equal(got.scores, ref.scores)
    assert session.graph_stats()["captures"] == 3 and session.graph_stats()["replays"] == 1


@gpu_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_recommend_graph_of_a_large_catalogue_equals_catalogue_topk(dtype):
    """A catalogue large enough for the matrix library to pick shape-dependent kernels:
    every batch size padded to its bucket gives catalogue_topk's bits."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    items = torch.nn.functional.normalize(
        torch.randn(200_000, 64, device="cuda", generator=gen), dim=1
    ).to(dtype)
    graphs = RecommendGraphs(
        lambda: items,
        200_000,
        64,
        dtype,
        torch.device("cuda"),
        GraphPool(),
        (64,),
        (8,),
        65536,
        32,
    )
    for batch in (1, 2, 3, 5, 7, 12, 33, 64):
        users = torch.nn.functional.normalize(
            torch.randn(batch, 64, device="cuda", generator=gen), dim=1
        ).to(dtype)
        seen = [torch.randint(0, 200_000, (int(n),)) for n in torch.randint(1, 9, (batch,))]
        for exclude in (seen, None):
            bucket = graphs.bucket(batch, 10, 8 if exclude is not None else None)
            got = graphs.recommend(bucket, users, exclude, strict=True)
            want = catalogue_topk(users, items, 10, exclude=exclude)
            assert torch.equal(got.ids, want.ids), (batch, exclude is None)
            assert torch.equal(got.scores, want.scores), (batch, exclude is None)
    assert graphs.captures == 12 and graphs.replays == 16  # 6 user buckets x 2
