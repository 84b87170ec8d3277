"""ServingSession's CUDA graphs of the whole-history encode (``open``, users encoded again
after ``extend``): buckets, padding, the session's plumbing.

What is checked against what (CPU unless marked ``gpu``):

* the padding users take the events a request leaves in its bucket, at most the model's
  ``max_events`` each, the users and events the same for every request of a bucket;
* the padded encode run eagerly on a bucket's buffers, loaded with a request, with the
  lengths' host copy of the synthetic inputs every graph is captured on (what a replay
  sees) == the server's eager ``prefill_histories``, in float64 on the pytorch backend:
  every layer's keys and values, offsets, lengths, ``max_len``, query times, contextual
  features, user embeddings (both models, several batch sizes);
* bucket choice, the fallback outside the buckets and the session's ``open``/``extend``/
  ``score``/``recommend`` through the graph path (the capture replaced by an eager run of
  the step) == a session without graphs; ``warm_up`` captures the buckets of its sizes;
* on a GPU (``-m gpu``): real captures == eager (bf16 and fp32 tolerances), replays read
  nothing back from the device, requests outside the buckets run eager.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _models import gpu_test, history_user, ranking_model, ranking_user, retrieval_model

from tzrec_gr.serving import Candidates, Histories, ServingSession
from tzrec_gr.serving._encode_graphs import EncodeGraphs, padded_lengths
from tzrec_gr.serving._graphs import GraphPool, GraphSet
from tzrec_gr.serving.server import server_for
from tzrec_ops.testing.tolerances import assert_close


def _ranking_histories(lengths, dtype=torch.float32):
    users = [ranking_user(n, 1) for n in lengths]
    return Histories(
        item_ids=torch.cat([u["uih.item_id"] for u in users]),
        lengths=torch.tensor(lengths),
        timestamps=torch.cat([u["uih_timestamp.sequence"] for u in users]),
        actions=torch.cat([u["uih_action.sequence"] for u in users]),
        contextual=torch.stack([u["contextual"] for u in users]).to(dtype),
        query_time=torch.stack([u["query_time"] for u in users]),
    )


def _retrieval_histories(lengths):
    users = [history_user(n) for n in lengths]
    return Histories.from_lists(
        [u["item_id"].tolist() for u in users], [u["timestamp"].tolist() for u in users]
    )


def _histories(kind, lengths, dtype=torch.float32):
    if kind == "ranking":
        return _ranking_histories(lengths, dtype)
    return _retrieval_histories(lengths)


def _model(kind, **kw):
    return ranking_model(**kw) if kind == "ranking" else retrieval_model(**kw)


def _eager_capture(self, entry):
    """A stand-in for the CUDA capture: the step run eagerly, and a 'graph' that runs it
    again on replay (so the bookkeeping around captures runs on the CPU)."""

    class Replay:
        def replay(self_inner):
            entry.out = self.step(entry)

    entry.graph, entry.out = Replay(), self.step(entry)
    entry.capture_ms = 1.0
    self.captures += 1


def assert_same_cache(got, want, dtype, name):
    """Every field of two caches equal (the float ones within ``dtype``'s tolerance)."""
    assert len(got.keys) == len(want.keys)
    for i, (a, b) in enumerate(zip(got.keys + got.values, want.keys + want.values)):
        assert a.shape == b.shape and a.dtype == b.dtype, (name, i)
        assert_close(a, b.double(), dtype, name=f"{name}: keys/values {i}")
    assert torch.equal(got.offsets, want.offsets) and torch.equal(got.lengths, want.lengths)
    assert got.max_len == want.max_len and got.owner == want.owner
    for field in ("query_time", "contextual", "user_embeddings"):
        a, b = getattr(got, field), getattr(want, field)
        assert (a is None) == (b is None), (name, field)
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape, (name, field)
            assert_close(a.double(), b.double(), dtype, name=f"{name}: {field}")


# -- buckets and padding --------------------------------------------------------------------


def test_padding_users_take_what_the_request_leaves():
    got = padded_lengths([5, 2], 6, 30, 10)
    assert got.tolist() == [5, 2, 10, 10, 3, 0]
    assert padded_lengths([3], 2, 3, 10).tolist() == [3, 0]
    assert padded_lengths([], 3, 25, 10).tolist() == [10, 10, 5]


def test_encode_buckets():
    server = server_for(retrieval_model())  # max_events 12
    graphs = EncodeGraphs(server, torch.device("cpu"), GraphPool(), (1, 4), (16, 64), 8)
    assert graphs.bucket(3, 17) == (4, 64) and graphs.bucket(1, 16) == (1, 16)
    assert graphs.bucket(5, 10) is None and graphs.bucket(1, 65) is None
    # U: the bucket's users and enough padding users for every event at 12 each
    assert graphs.users((4, 64)) == 4 + 6 and graphs.users((1, 16)) == 1 + 2
    sizes = {"batch_sizes": [1, 3], "histories": [4, 12, 40]}
    # (3 users of 40 events fit no bucket: eager)
    assert graphs.warm_up_buckets(sizes, True) == [(1, 16), (1, 16), (1, 64), (4, 16), (4, 64)]


# -- the padded encode == the eager one --------------------------------------------------


@pytest.mark.parametrize("kind", ["ranking", "retrieval"])
@pytest.mark.parametrize("lengths", [[7], [5, 2, 9], [1, 10, 3, 8]])
def test_padded_encode_with_the_capture_host_copies_equals_prefill(kind, lengths):
    model = _model(kind).double()
    server = server_for(model)
    h = _histories(kind, lengths, torch.float64)
    graphs = EncodeGraphs(server, torch.device("cpu"), GraphPool(), (1, 4), (16, 64), 8)
    bucket = graphs.bucket(len(lengths), sum(lengths))
    entry = graphs.new_entry(bucket)
    graphs.fill_synthetic(entry)
    captured_on = entry.lengths_host.clone()
    graphs.step(entry)  # the synthetic inputs run (what a capture records)
    graphs.load(entry, h, lengths)
    assert entry.lengths_host[: len(lengths)].tolist() == lengths
    assert int(entry.lengths_host.sum()) == bucket[1]  # every request fills the bucket
    entry.lengths_host = captured_on  # what a replay of the graph sees on the host
    got = graphs.result(graphs.step(entry), lengths)
    want = server.prefill_histories(h, torch.device("cpu"))
    assert_same_cache(got, want, torch.float64, f"{kind} {lengths}")


# -- the session's plumbing -----------------------------------------------------------------


def _session_pair(kind, monkeypatch, **kw):
    """(a session whose encodes go through EncodeGraphs on the CPU with an eager stand-in
    for the capture, one without graphs)."""
    monkeypatch.setattr(GraphSet, "_capture", _eager_capture)
    model = _model(kind, **kw)
    eager = ServingSession(model)
    session = ServingSession(copy.deepcopy(model))
    session._encode_graphs = EncodeGraphs(
        session.server, torch.device("cpu"), session._pool, (2, 4), (16, 32), 3
    )
    return session, eager


def _answers(kind, session, users):
    if kind == "ranking":
        return session.score(users, Candidates.from_lists([[1, 2, 3]] * len(users)))
    return session.recommend(users, 5).scores


@pytest.mark.parametrize("kind", ["ranking", "retrieval"])
def test_session_encodes_through_the_graph_path(kind, monkeypatch):
    session, eager = _session_pair(kind, monkeypatch)
    report = session.warm_up(batch_sizes=[2], histories=[5])
    assert [tuple(b.values()) for b in report["encode_graphs"]["captured"]] == [(2, 16)]
    assert report["encoded"] == [{"batch": 2, "events": 5}]  # (replayed once)
    h = _histories(kind, [5, 2, 9])
    for s in (session, eager):
        s.open(["a", "b", "c"], h)
    ids = ["a", "b", "c"]
    assert_close(_answers(kind, session, ids), _answers(kind, eager, ids).double(),
                 torch.float32, name="after open")
    more = _histories(kind, [2, 3, 0]) if kind == "ranking" else _histories(kind, [2, 3, 1])
    ts = torch.full_like(more.timestamps, 10**7)
    more = Histories(more.item_ids, more.lengths, ts, more.actions)
    for s in (session, eager):
        s.extend(ids, more)
    assert_close(_answers(kind, session, ids), _answers(kind, eager, ids).double(),
                 torch.float32, name="after extend")
    stats = session.graph_stats()["encode"]
    assert stats["enabled"] is True and stats["step"] == "encode"
    # warm-up (2, 16), open (4, 16); the ranking model's re-encode after extend (4, 32)
    assert stats["captures"] == (3 if kind == "ranking" else 2), stats
    assert stats["replays"] == stats["captures"] and stats["eager_calls"] == 0


@pytest.mark.parametrize("kind", ["ranking", "retrieval"])
def test_requests_outside_the_buckets_run_eager(kind, monkeypatch):
    session, eager = _session_pair(kind, monkeypatch)
    bound = session.server.max_events
    h = _histories(kind, [bound] * 4)  # more than 32 events in all
    for s in (session, eager):
        s.open([1, 2, 3, 4], h)
    five = _histories(kind, [1] * 5)  # more than 4 users
    for s in (session, eager):
        s.open([5, 6, 7, 8, 9], five)
    for users in ([1, 2, 3, 4], [5, 6, 7, 8, 9]):
        assert_close(_answers(kind, session, users), _answers(kind, eager, users).double(),
                     torch.float32, name="outside the buckets")
    stats = session.graph_stats()["encode"]
    assert stats["captures"] == 0 and stats["eager_calls"] == 2, stats


def test_no_encode_graphs_without_cuda_or_when_switched_off():
    session = ServingSession(ranking_model())
    assert session.graph_stats()["encode"]["enabled"] is False
    report = session.warm_up(histories=[3])
    assert report["encode_graphs"]["captured"] == [] and report["encoded"]
    with pytest.raises(ValueError, match="encode_graphs must be True or False"):
        ServingSession(ranking_model(), encode_graphs="no")
    with pytest.raises(ValueError, match="event_buckets must be ints >= 1"):
        ServingSession(ranking_model(), event_buckets=[0])


# -- GPU: real captures ---------------------------------------------------------------------

@gpu_test
@pytest.mark.parametrize("kind", ["ranking", "retrieval"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_replayed_open_and_extend_equal_eager(kind, dtype):
    model = _model(kind, device="cuda").to(dtype)
    eager = ServingSession(model, cuda_graphs="off")
    graphs = ServingSession(model, cuda_graphs="on", batch_buckets=(2, 4), event_buckets=(16, 32))
    report = graphs.warm_up(batch_sizes=[2, 4], histories=[4])
    assert len(report["encode_graphs"]["captured"]) == 2, report["encode_graphs"]
    h = _histories(kind, [5, 2, 9], dtype)
    ids = ["a", "b", "c"]
    for s in (eager, graphs):
        s.open(ids, h)
    got = graphs._assemble(ids, graphs._users.states("users", ids))
    want = eager._assemble(ids, eager._users.states("users", ids))
    assert_same_cache(got, want, dtype, f"{kind} open")
    more = _histories(kind, [2, 3, 1], dtype)
    more = Histories(more.item_ids, more.lengths, torch.full_like(more.timestamps, 10**7),
                     more.actions)
    for s in (eager, graphs):
        s.extend(ids, more)
    assert_close(_answers(kind, graphs, ids).float(), _answers(kind, eager, ids).double(),
                 dtype, name=f"{kind} after extend")
    stats = graphs.graph_stats()["encode"]
    assert stats["eager_calls"] == 0 and stats["replays"] >= 1, stats
    assert all(g["capture_ms"] > 0 and g["memory_bytes"] > 0 for g in stats["graphs"])
    # more users than any bucket: eager, the same answers
    five = _histories(kind, [2] * 5, dtype)
    for s in (eager, graphs):
        s.open(list(range(5)), five)
    assert graphs.graph_stats()["encode"]["eager_calls"] == 1


@gpu_test
@pytest.mark.parametrize("kind", ["ranking", "retrieval"])
def test_gpu_encode_replay_reads_nothing_back(kind):
    model = _model(kind, device="cuda")
    session = ServingSession(model, cuda_graphs="on", batch_buckets=(4,), event_buckets=(32,))
    assert len(session.warm_up(batch_sizes=[4], histories=[4])["encode_graphs"]["captured"]) == 1
    graphs = session._encode_graphs
    h = _histories(kind, [5, 2, 9])
    bucket = graphs.bucket(3, 16)
    before = graphs.stats()["replays"]  # the warm-up's encodes replay the graph too
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a device-to-host sync raises
    try:
        cache = graphs.encode(bucket, h, strict=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert cache is not None and cache.batch_size == 3
    assert graphs.stats()["replays"] == before + 1 and graphs.stats()["captures"] == 1
