"""The host side of a served request through the graph path, on the CPU (the captures
replaced by an eager run of the step, as in ``test_serving_graphs``):

* ``score`` of opened users through the score graphs equals an eager session's, as users
  of different lengths (a longer one, then a shorter one) take turns in one bucket's
  buffers, alone and in pairs, before and after an extend;
* a B=1 score of a cached user, and one after an extend, read no index tensor back (every
  one the graphs and the ops look at has a known host copy: on a GPU, no sync before the
  answer), and a cached one stays within a bound of torch calls;
* the histories the session builds from checked events are not checked again.
"""

from __future__ import annotations

import copy
import sys
from collections import Counter

import pytest
import torch
from _models import ranking_histories, ranking_model, ranking_user
from torch.overrides import TorchFunctionMode

import tzrec_ops.ops.host_copies as host_copies
from tzrec_gr.serving import Candidates, Histories, ServingSession
from tzrec_gr.serving._encode_graphs import EncodeGraphs
from tzrec_gr.serving._graphs import GraphSet
from tzrec_gr.serving._host import to_device_together
from tzrec_gr.serving._score_graphs import ScoreGraphs
from tzrec_gr.serving.ranking import RankingServer
from tzrec_ops.testing.tolerances import assert_close

CPU = torch.device("cpu")
# torch calls of a B=1 score of a cached user outside the replay: 69.5 here; 81 when the
# checks read the offsets as tensors, 107 when every layer's rows took two kernels and the
# index tensors were derived on the device
CALLS_PER_SCORE = 74


def _eager_capture(self, entry):
    """A stand-in for the CUDA capture: the step run eagerly, again at each replay (with
    torch function modes off: a replay is not host work of the request)."""

    class Replay:
        def replay(self_inner):
            with torch._C.DisableTorchFunction():
                entry.out = self.step(entry)

    entry.graph, entry.out = Replay(), self.step(entry)
    self.captures += 1


class _Calls(TorchFunctionMode):
    """Counts torch calls (functions and tensor methods) but attribute reads."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name != "__get__":
            self.calls[name] += 1
        return func(*args, **(kwargs or {}))


def _sessions(monkeypatch, lengths):
    """(a session serving through emulated graphs, an eager copy, the users' ids)."""
    monkeypatch.setattr(GraphSet, "_capture", _eager_capture)
    torch.manual_seed(1)
    session = ServingSession(ranking_model())
    ids = [f"u{i}" for i in range(len(lengths))]
    session.open(ids, ranking_histories([ranking_user(n, 1) for n in lengths]))
    eager = copy.deepcopy(session)
    server = session.server
    assert isinstance(server, RankingServer)
    session._graphs = ScoreGraphs(server, CPU, session._pool, (1, 2), (32,), (4,), 8)
    session._encode_graphs = EncodeGraphs(server, CPU, session._pool, (1, 2), (64,), 8)
    return session, eager, ids


def _fresh_score(monkeypatch, session, users, cands):
    """``users``' scores in a new graph session holding only them (clean buffers)."""
    fresh = copy.deepcopy(session)
    fresh._graphs = ScoreGraphs(fresh.server, CPU, fresh._pool, (1, 2), (32,), (4,), 8)
    return fresh.score(users, cands)


def test_scores_through_the_graphs_equal_eager_as_users_take_turns(monkeypatch):
    session, eager, ids = _sessions(monkeypatch, [9, 3, 6])
    events = Histories(
        torch.tensor([5, 6]),
        torch.tensor([2]),
        torch.tensor([10**9, 10**9 + 1]),
        torch.tensor([1, 2]),
    )
    requests = [[ids[0]], [ids[1]], [ids[0], ids[1]], [ids[1], ids[2]], [ids[2]], [ids[1]]]
    for users in requests + ["extend"] + [[ids[1]], [ids[0]], [ids[1], ids[0]]]:
        if users == "extend":
            for s in (session, eager):
                s.extend([ids[1]], events)
            continue
        cands = Candidates.from_lists([[1, 2, 3], [4]][: len(users)])
        got = session.score(users, cands)
        assert_close(got.double(), eager.score(users, cands).double(), torch.float32)
        # the rows a longer user left in the buffers change no bit
        assert torch.equal(got, _fresh_score(monkeypatch, session, users, cands)), users
    stats = session.graph_stats()
    assert stats["eager_calls"] == 0 and stats["encode"]["replays"] == 1, stats


def test_b1_score_of_a_cached_user_reads_nothing_back(monkeypatch):
    session, _, ids = _sessions(monkeypatch, [9, 3])
    cands = Candidates.from_lists([[1, 2, 3]])
    for u in ids:  # the bucket captured, both users met once
        session.score([u], cands)
    reads = []
    snapshot = host_copies._snapshot

    def read_back(values):  # a host copy taken of a tensor (not one given by the caller)
        if sys._getframe(1).f_code.co_name != "remember_host_copy":
            reads.append(tuple(values.shape))
        return snapshot(values)

    monkeypatch.setattr(host_copies, "_snapshot", read_back)
    counter = _Calls()
    with counter:
        for u in ids:  # each call loads the other user's rows into the buffers
            session.score([u], cands)
    assert reads == []
    calls = sum(counter.calls.values()) / len(ids)
    assert calls <= CALLS_PER_SCORE, (calls, counter.calls)
    # nor does the score after an extend (the history encoded again in its graph)
    session.extend([ids[0]], Histories.from_lists([[5]], [[10**9]], [[1]]))
    session.score([ids[0]], cands)
    assert reads == [] and session.graph_stats()["encode"]["replays"] == 1


def test_histories_built_from_checked_events_are_not_checked_again(monkeypatch):
    session, _, ids = _sessions(monkeypatch, [4])
    events = Histories.from_lists([[5]], [[10**9]], [[1]])
    cands = Candidates.from_lists([[1]])
    built = []
    post_init = Histories.__post_init__
    monkeypatch.setattr(Histories, "__post_init__", lambda h: built.append(h) or post_init(h))
    session.extend([ids[0]], events)
    session.score([ids[0]], cands)
    assert built == []  # neither the longer history nor the one encoded again


def test_index_tensors_moved_together_keep_their_values_on_the_host_and_alignment():
    parts = [[3], [0, 3], [5, 1, 2]]
    moved = to_device_together(parts, CPU)
    base = moved[0].data_ptr()
    for t, values in zip(moved, parts):
        assert t.tolist() == values and t.dtype == torch.int64
        assert host_copies.known_host_copy(t).values.tolist() == values
        assert (t.data_ptr() - base) % 16 == 0  # as its own allocation (Triton specializes)


def test_request_checks_name_the_user_and_position_and_allow_a_step_back_between_users():
    """The host checks (one read of the offsets, ids by their range first) still name the
    user and the position of a bad value; a user's first event may be older than the
    previous user's last."""
    ok = Histories(torch.tensor([1, 2, 3]), torch.tensor([2, 1]), torch.tensor([5, 9, 1]))
    ok.check(10, after=[None, 1])
    cases = [
        (lambda: ok.check(3), r"histories.item_ids of user 1 \(position 0\) is 3, not an item"),
        (lambda: ok.check(10, after=[None, 2]), "user 1 start at 1, older than that user's"),
        (lambda: ok.check(10, max_events=1), "histories of user 0 has 2 events, more than"),
        (
            lambda: Histories(torch.tensor([1, 2]), torch.tensor([2, -1, 1]), torch.tensor([0, 0])),
            r"histories.lengths\[1\] must be >= 0, got -1",
        ),
        (
            lambda: Histories(
                torch.tensor([1, 2, 3]), torch.tensor([1, 2]), torch.tensor([5, 9, 1])
            ).check(10),
            r"user 1 are not sorted: position 1 \(1\) is older than position 0 \(9\)",
        ),
        (
            lambda: Candidates(torch.tensor([0, 1, 2]), torch.tensor([1, 2])).check(10, 1),
            "candidates of user 1: 2, more than the model's max_targets",
        ),
        (
            lambda: Candidates(torch.tensor([0, 1, -2]), torch.tensor([1, 2])).check(10, 4),
            r"candidates.item_ids of user 1 \(position 1\) is -2",
        ),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
