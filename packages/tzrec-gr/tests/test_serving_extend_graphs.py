"""ServingSession's CUDA graphs of the incremental ``extend`` (a retrieval model, a ranking
model without time encoding or contextual features): buckets, padding, the session's
plumbing.

What is checked against what (CPU unless marked ``gpu``):

* bucket choice (users, cached tokens, new events per user) and the rows copied out;
* the padded extend run eagerly on a bucket's buffers, loaded with a request after the
  synthetic inputs every graph is captured on ran (the cached lengths' host copy then the
  capture's, as a replay sees it) == the server's eager ``extend_histories``, in float64 on
  the pytorch backend: every layer's keys and values, offsets, lengths, ``max_len``, user
  embeddings (several batch sizes, users with no new events, a user whose cache is at the
  bucket's bound, interleaved actions, requests one after another in one bucket);
* the fallback outside the buckets and the session's ``extend`` then ``recommend`` /
  ``score`` through the graph path (the capture replaced by an eager run of the step) == a
  session without graphs; ``warm_up`` captures the buckets of its sizes;
* on a GPU (``-m gpu``): real captures == eager (bf16 and fp32 tolerances), replays read
  nothing back from the device, requests outside the buckets run eager.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _models import (
    attributed_retrieval_model,
    gpu_test,
    history_user,
    ranking_model,
    retrieval_model,
)
from test_serving_encode_graphs import _eager_capture, assert_same_cache

from tzrec_gr.serving import Candidates, Histories, ServingSession
from tzrec_gr.serving._extend_graphs import ExtendGraphs, kept_rows
from tzrec_gr.serving._graphs import GraphPool, GraphSet
from tzrec_gr.serving._session_graphs import build_graphs
from tzrec_gr.serving.server import server_for
from tzrec_ops.jagged import host_copy
from tzrec_ops.testing.tolerances import assert_close

CPU = torch.device("cpu")
INCREMENTAL = {"use_time_encoding": False, "max_contextual_seq_len": 0, "contextual_feature_dim": 0}
KINDS = {
    "retrieval": lambda **kw: retrieval_model(**kw),
    "retrieval-attributes": lambda **kw: attributed_retrieval_model(**kw),
    "ranking": lambda **kw: ranking_model(**{**INCREMENTAL, **kw}),
    "ranking-interleaved": lambda **kw: ranking_model(
        **{**INCREMENTAL, "enable_interleaving": True, **kw}
    ),
}


def _histories(lengths, actions, start=1000):
    users = [history_user(n, start) for n in lengths]
    return Histories.from_lists(
        [u["item_id"].tolist() for u in users],
        [u["timestamp"].tolist() for u in users],
        [u["action"].tolist() for u in users] if actions else None,
    )


def _events(server, lengths, step=0):
    """New events for users opened with :func:`_histories`, after their newest (and after
    those of the ``step`` extends before)."""
    return _histories(lengths, server.needs_actions, start=10**7 * (step + 1))


# -- buckets --------------------------------------------------------------------------------


def test_extend_buckets():
    server = server_for(KINDS["retrieval"]())  # max_events 12
    graphs = ExtendGraphs(server, CPU, GraphPool(), (1, 4), (8, 16), (2, 4), 8)
    assert graphs.bucket(3, 9, 1) == (4, 16, 2) and graphs.bucket(1, 8, 4) == (1, 8, 4)
    assert graphs.bucket(2, 0, 0) == (4, 8, 2)  # no events at all: the smallest bucket
    assert graphs.bucket(5, 1, 1) is None  # more users than any bucket
    assert graphs.bucket(1, 17, 1) is None and graphs.bucket(1, 1, 5) is None
    sizes = {"batch_sizes": [1, 3], "histories": [4, 10], "events": [1, 3]}
    # 10 + 3 events pass max_events: left out
    assert graphs.warm_up_buckets(sizes, True) == [
        (1, 8, 2), (1, 8, 4), (1, 16, 2), (4, 8, 2), (4, 8, 4), (4, 16, 2)
    ]


def test_interleaved_tokens_count_twice():
    graphs = ExtendGraphs(
        server_for(KINDS["ranking-interleaved"]()), CPU, GraphPool(), (4,), (16,), (2,), 8
    )
    assert graphs.tokens(3) == 6
    assert graphs.warm_up_buckets({"batch_sizes": [2], "histories": [8], "events": [2]}, True) == [
        (4, 16, 2)
    ]
    assert graphs.warm_up_buckets({"batch_sizes": [2], "histories": [9], "events": [1]}, True) == []


def test_kept_rows_take_the_cached_rows_then_the_new_ones():
    # blocks of 6 rows: 4 cached slots, 2 new slots
    assert kept_rows([2, 0, 4], [1, 2, 0], 4, 6) == [0, 1, 4, 10, 11, 12, 13, 14, 15]


# -- the padded extend == the eager one ---------------------------------------------------


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize(
    "requests",
    [
        [([7], [3])],
        [([5, 2, 8], [2, 0, 1]), ([1, 8, 3, 6], [0, 4, 1, 1])],  # 8 events: at the bound
        [([4, 4], [0, 0]), ([8], [1])],
    ],
    ids=["one", "several-then-longer-slots", "no-events"],
)
def test_padded_extend_with_the_capture_host_copies_equals_eager(kind, requests):
    torch.manual_seed(0)
    model = KINDS[kind]().double()
    server = server_for(model)
    graphs = ExtendGraphs(server, CPU, GraphPool(), (1, 4), (8, 16), (2, 4), 8)
    entries = {}
    for lengths, new in requests:  # one after another: a slot may hold a longer user
        cache = server.prefill_histories(_histories(lengths, server.needs_actions), CPU)
        events = _events(server, new)
        want = server.extend_histories(cache, events, CPU)
        cached = host_copy(cache.lengths).values.tolist()
        bucket = graphs.bucket(len(lengths), max(cached), max(new))
        if bucket not in entries:
            entry = entries[bucket] = graphs.new_entry(bucket)
            graphs.fill_synthetic(entry)
            graphs.before_capture(entry)  # the host copy a replay sees: the capture's
            graphs.step(entry)  # the synthetic inputs run (what a capture records)
        entry = entries[bucket]
        graphs.load(entry, cache, events, new)
        got = graphs.result(graphs.step(entry), bucket, cached, new)
        assert_same_cache(got, want, torch.float64, f"{kind} {lengths} + {new}")


# -- the session's plumbing -----------------------------------------------------------------


def _session_pair(kind, monkeypatch, **kw):
    """(a session whose incremental extends go through ExtendGraphs on the CPU with an
    eager stand-in for the capture, one without graphs)."""
    monkeypatch.setattr(GraphSet, "_capture", _eager_capture)
    model = KINDS[kind](**kw)
    eager = ServingSession(model)
    session = ServingSession(copy.deepcopy(model))
    session._extend_graphs = ExtendGraphs(
        session.server, CPU, session._pool, (2, 4), (8, 16), (1, 2), 4
    )
    return session, eager


def _answers(session, users):
    if session.kind == "ranking":
        return session.score(users, Candidates.from_lists([[1, 2, 3]] * len(users)))
    return session.recommend(users, 5).scores


def _same_answers(session, eager, users, name):
    assert_close(_answers(session, users), _answers(eager, users).double(), torch.float32,
                 name=name)
    got = session._assemble(users, session._users.states("users", users))
    want = eager._assemble(users, eager._users.states("users", users))
    assert_same_cache(got, want, torch.float32, name)


@pytest.mark.parametrize("kind", list(KINDS))
def test_session_extends_through_the_graph_path(kind, monkeypatch):
    session, eager = _session_pair(kind, monkeypatch)
    report = session.warm_up(batch_sizes=[2], histories=[3], events=[1, 2])
    captured = [tuple(b.values()) for b in report["extend_graphs"]["captured"]]
    assert captured == [(2, 8, 1), (2, 8, 2)], report["extend_graphs"]
    assert report["extended"] == [
        {"batch": 2, "history": 3, "events": 1}, {"batch": 2, "history": 3, "events": 2}
    ]
    ids = ["a", "b", "c"]
    h = _histories([5, 2, 6], session.server.needs_actions)
    for s in (session, eager):
        s.open(ids, h)
    for step, (users, new) in enumerate(
        [(ids, [2, 0, 1]), (["c", "a", "b"], [1, 1, 1]), (["b"], [2])]
    ):
        events = _events(session.server, new, step)
        for s in (session, eager):
            s.extend(users, events)
        _same_answers(session, eager, ids, f"{kind} after extend {step}")
    stats = session.graph_stats()["extend"]
    assert stats["enabled"] is True and stats["step"] == "extend"
    # the warm-up's two buckets, (4, 8, 2) for three users and (4, 16, 1) once a
    # cache outgrows 8 tokens (interleaved: every one does)
    assert stats["eager_calls"] == 0 and stats["replays"] == 2 + 3, stats
    assert session.graph_counts() == (stats["captures"], 0)


@pytest.mark.parametrize("kind", ["retrieval", "ranking"])
def test_extends_outside_the_buckets_run_eager(kind, monkeypatch):
    session, eager = _session_pair(kind, monkeypatch)
    five = list(range(5))
    h = _histories([3] * 5, session.server.needs_actions)
    for s in (session, eager):
        s.open(five, h)
    # 5 users; 3 events per user
    for step, (users, new) in enumerate(((five, [1] * 5), (five[:2], [3, 1]))):
        events = _events(session.server, new, step)
        for s in (session, eager):
            s.extend(users, events)
    _same_answers(session, eager, five, "outside the buckets")
    stats = session.graph_stats()["extend"]
    assert stats["captures"] == 0 and stats["eager_calls"] == 2, stats


def test_no_extend_graphs_without_cuda_and_bad_buckets():
    session = ServingSession(KINDS["retrieval"]())
    assert session.graph_stats()["extend"]["enabled"] is False
    report = session.warm_up(histories=[3], events=[1])
    assert report["extend_graphs"]["captured"] == [] and report["extended"]
    with pytest.raises(ValueError, match="extend_buckets must be ints >= 1"):
        ServingSession(KINDS["retrieval"](), extend_buckets=[0])


# -- GPU: real captures ---------------------------------------------------------------------


def _gpu_session_pair(kind, dtype, **kw):
    model = KINDS[kind](device="cuda").to(dtype)
    eager = ServingSession(model, cuda_graphs="off")
    graphs = ServingSession(
        model, cuda_graphs="on", batch_buckets=(2, 4), length_buckets=(8, 16),
        extend_buckets=(1, 2), **kw
    )
    return graphs, eager


@gpu_test
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_replayed_extends_equal_eager(kind, dtype):
    torch.manual_seed(0)
    graphs, eager = _gpu_session_pair(kind, dtype)
    report = graphs.warm_up(batch_sizes=[2, 4], histories=[3, 6], events=[1, 2])
    assert report["extend_graphs"]["captured"] and not report["extend_graphs"]["failed"], report
    ids = ["a", "b", "c"]
    h = _histories([5, 2, 6], graphs.server.needs_actions)
    for s in (eager, graphs):
        s.open(ids, h)
    for step, (users, new) in enumerate(
        [(ids, [2, 0, 1]), (["c", "a", "b"], [1, 1, 1]), (["b"], [2])]
    ):
        events = _events(graphs.server, new, step)
        for s in (eager, graphs):
            s.extend(users, events)
        got = graphs._assemble(ids, graphs._users.states("users", ids))
        want = eager._assemble(ids, eager._users.states("users", ids))
        assert_same_cache(got, want, dtype, f"{kind} {dtype} extend {step}")
        assert_close(_answers(graphs, ids).float(), _answers(eager, ids).double(), dtype,
                     name=f"{kind} {dtype} answers after extend {step}")
    stats = graphs.graph_stats()["extend"]
    assert stats["eager_calls"] == 0 and stats["replays"] >= 3, stats
    assert all(g["capture_ms"] > 0 and g["memory_bytes"] > 0 for g in stats["graphs"])
    # more new events per user than any bucket (user b stays within max_events): eager,
    # the same caches
    events = _events(graphs.server, [0, 3, 0], 3)
    for s in (eager, graphs):
        s.extend(ids, events)
    assert graphs.graph_stats()["extend"]["eager_calls"] == 1
    got = graphs._assemble(ids, graphs._users.states("users", ids))
    want = eager._assemble(ids, eager._users.states("users", ids))
    assert_same_cache(got, want, dtype, f"{kind} {dtype} outside the buckets")


@gpu_test
@pytest.mark.parametrize("kind", ["retrieval", "ranking-interleaved"])
def test_gpu_extend_replay_reads_nothing_back(kind):
    session, _ = _gpu_session_pair(kind, torch.float32)
    assert session.warm_up(batch_sizes=[4], histories=[6], events=[2])["extend_graphs"]["captured"]
    ids = ["a", "b", "c"]
    session.open(ids, _histories([5, 2, 6], session.server.needs_actions))
    cache = session._assemble(ids, session._users.states("users", ids))
    events = _events(session.server, [2, 0, 1])
    graphs = session._extend_graphs
    bucket = graphs.bucket(3, int(host_copy(cache.lengths).values.max()), 2)
    before = graphs.stats()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a device-to-host sync raises
    try:
        out = graphs.extend(bucket, cache, events, strict=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out is not None and out.batch_size == 3
    after = graphs.stats()
    assert after["replays"] == before["replays"] + 1 and after["captures"] == before["captures"]


@gpu_test
def test_gpu_no_extend_graphs_where_the_extend_re_encodes():
    session = ServingSession(ranking_model(device="cuda"), cuda_graphs="on")  # time encoded
    assert session.graph_stats()["extend"]["enabled"] is False
    assert session.graph_stats()["encode"]["enabled"] is True


@pytest.mark.parametrize("has_step", [True, False])
def test_extend_graphs_only_for_a_server_with_the_extend_step(monkeypatch, has_step):
    """A server (a plugin's) that extends incrementally without the pure step the graphs
    capture gets none: its extends run eager. Built for a CUDA device without touching
    it (the call's own graphs stubbed out)."""
    server = server_for(KINDS["retrieval"]())
    monkeypatch.setattr(server, "has_extend_step", has_step)
    monkeypatch.setattr(server, "cuda_graphs", lambda **kw: (None, "stubbed"))
    graphs = build_graphs(
        server, torch.device("cuda"), GraphPool(), cuda_graphs="auto", batch_buckets=(2,),
        length_buckets=None, candidate_buckets=None, event_buckets=None,
        extend_buckets=None, encode_graphs=False, max_graphs=4, chunk_size=64,
        catalogue=lambda: torch.zeros(1),
    )
    assert (graphs.extend is not None) is has_step
