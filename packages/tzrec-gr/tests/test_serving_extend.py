"""``ServingSession.extend``: chains of extends equal the full forward of the longer history,
in the two ways the session appends events (float32 on the CPU, the forward tolerance of
:mod:`tzrec_ops.testing.tolerances`: ``|d| <= 1e-5 * max|full| + 1e-4 * |full|``):

* incremental (a retrieval model; a ranking model without time encoding or contextual
  features): only the new events run, against the kept keys and values;
* deferred (a ranking model with time encoding and a contextual prefix): the kept keys and
  values depend on the newest event, so the whole history is encoded again at the user's
  next ``score``, once, however many extends came before.

Each case draws the users' starting histories (at least one event: ``open`` refuses an
empty one), then several extends that give each user none, one or many events (past the
model's bound too, which keeps the newest), and checks every answer against the model's
own forward over each user's history as followed here, on the side.
"""

from __future__ import annotations

import functools
from typing import Dict, List

import pytest
import torch
from _models import NUM_ITEMS, ranking_model, retrieval_model
from hypothesis import given, settings
from hypothesis import strategies as st

from tzrec_gr.serving import Histories, ServingSession
from tzrec_ops.testing.tolerances import assert_close

MODELS = {
    "ranking-deferred": lambda: ranking_model(),
    "ranking-incremental": lambda: ranking_model(
        use_time_encoding=False, max_contextual_seq_len=0, contextual_feature_dim=0
    ),
    "retrieval-incremental": lambda: retrieval_model(),
}


@functools.cache
def _model(name: str):
    return MODELS[name]()


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matrices: one torch thread (two spin against each other on a shared CPU)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class _Users:
    """The users' histories followed on the host: (ids, timestamps, actions) per user, each
    cut to the model's bound, plus contextual features and each user's query time."""

    def __init__(self, model, gen: torch.Generator) -> None:
        self.model, self.gen = model, gen
        self.ranking = hasattr(model, "max_uih_len")
        self.bound = model.max_uih_len if self.ranking else model.max_seq_len
        pre = model.transducer.input_preprocessor
        self.width = pre.contextual_seq_len() * getattr(pre, "contextual_feature_dim", 0)
        self.events: List[Dict[str, torch.Tensor]] = []
        self.contextual: List[torch.Tensor] = []
        self.clock = 1000

    def draw(self, n: int) -> Dict[str, torch.Tensor]:
        gaps = torch.randint(30, 4000, (n,), generator=self.gen)
        times = self.clock + torch.cumsum(gaps, 0)
        if n:
            self.clock = int(times[-1])
        return {
            "ids": torch.randint(0, NUM_ITEMS, (n,), generator=self.gen),
            "ts": times,
            "actions": torch.randint(0, 8, (n,), generator=self.gen),
        }

    def histories(self, rows: List[Dict[str, torch.Tensor]], contextual: bool) -> Histories:
        ctx = None
        if contextual and self.width:
            ctx = torch.stack(self.contextual)
        return Histories(
            item_ids=torch.cat([r["ids"] for r in rows]),
            lengths=torch.tensor([r["ids"].numel() for r in rows]),
            timestamps=torch.cat([r["ts"] for r in rows]),
            actions=torch.cat([r["actions"] for r in rows]) if self.ranking else None,
            contextual=ctx,
        )

    def open(self, lengths: List[int]) -> Histories:
        self.events = [self.draw(n) for n in lengths]
        self.contextual = [torch.randn(self.width, generator=self.gen) for _ in lengths]
        return self.histories(self.events, contextual=True)

    def extend(self, lengths: List[int]) -> Histories:
        new = [self.draw(n) for n in lengths]
        self.events = [
            {k: torch.cat([old[k], add[k]])[-self.bound :] for k in old}
            for old, add in zip(self.events, new)
        ]
        return self.histories(new, contextual=False)

    @torch.no_grad()
    def full_forward_probs(self, order: List[int], candidates: torch.Tensor) -> torch.Tensor:
        """sigmoid of the ranking model's forward over the whole histories of users
        ``order``, candidates [B, T] shown at each user's query time (the newest event's)."""
        rows, (users, t) = [self.events[b] for b in order], candidates.shape
        query = torch.stack([r["ts"][-1] for r in rows])
        batch = {
            "uih.item_id": torch.cat([r["ids"] for r in rows]),
            "uih.sequence_length": torch.tensor([r["ids"].numel() for r in rows]),
            "uih_action.sequence": torch.cat([r["actions"] for r in rows]),
            "uih_timestamp.sequence": torch.cat([r["ts"] for r in rows]),
            "candidate.item_id": candidates.reshape(-1),
            "candidate.sequence_length": torch.full((users,), t),
            "candidate_timestamp.sequence": query.repeat_interleave(t),
            "query_time": query,
        }
        if self.width:
            batch["contextual"] = torch.stack([self.contextual[b] for b in order])
        return torch.sigmoid(self.model(batch))

    @torch.no_grad()
    def full_forward_embeddings(self, order: List[int]) -> torch.Tensor:
        """[B, E] the retrieval model's user embeddings over the whole histories of users
        ``order``."""
        h = self.histories([self.events[b] for b in order], contextual=False)
        return self.model.user_embedding(h.item_ids, h.lengths, h.timestamps)


def _check(
    session: ServingSession, users: _Users, order: List[int], what: str, names: str = "u"
) -> None:
    """The session's answers for users ``order`` (ids ``f"{names}{b}"``) against the full
    forward."""
    ids = [f"{names}{b}" for b in order]
    if users.ranking:
        candidates = torch.randint(0, NUM_ITEMS, (len(ids), 3), generator=users.gen)
        got = session.score(ids, candidates).reshape(-1, users.model.num_tasks)
        want = users.full_forward_probs(order, candidates)
        assert_close(got, want.double(), torch.float32, name=what)
        return
    top = session.recommend(ids, k=4)
    states = session._users.states("users", ids)
    got = torch.stack([s.user_embedding for s in states])
    want = users.full_forward_embeddings(order)
    assert_close(got, want.double(), torch.float32, name=f"{what} user embeddings")
    with torch.no_grad():
        scores = want @ users.model.item_embedding(torch.arange(NUM_ITEMS)).t()
    for b, u in enumerate(order):
        scores[b, users.events[u]["ids"]] = float("-inf")
    best = scores.sort(dim=1, descending=True).values[:, :4]
    assert_close(top.scores, best.double(), torch.float32, name=f"{what} top-4 scores")


@pytest.mark.parametrize("name", list(MODELS))
@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_extend_chains_equal_the_full_forward(name, data):
    model = _model(name)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    users = _Users(model, gen)
    batch = data.draw(st.integers(1, 3), label="users")
    lengths = data.draw(st.lists(st.integers(1, users.bound), min_size=batch, max_size=batch))
    ids = [f"u{b}" for b in range(batch)]
    everyone = list(range(batch))
    session = ServingSession(model)
    session.open(ids, users.open(lengths))
    _check(session, users, everyone, "opened")
    steps = data.draw(st.integers(1, 4), label="extends")
    for step in range(steps):
        # none, one, a few or past the bound (the history then keeps its newest events)
        counts = data.draw(
            st.lists(
                st.sampled_from([0, 1, 2, 3, users.bound + 1]), min_size=batch, max_size=batch
            ),
            label=f"new events of extend {step}",
        )
        session.extend(ids, users.extend(counts))
        if data.draw(st.booleans(), label=f"answer after extend {step}") or step == steps - 1:
            order = data.draw(st.permutations(everyone), label=f"users asking {step}")
            _check(session, users, list(order), f"after extend {step}")


def _counting(session: ServingSession, monkeypatch) -> Dict[str, List[int]]:
    """Counts the server's prefills and incremental extends (users per call)."""
    calls: Dict[str, List[int]] = {"prefill": [], "extend": []}
    server = session.server
    prefill, extend = server.prefill_histories, server.extend_histories

    def counted_prefill(h, device):
        calls["prefill"].append(h.batch_size)
        return prefill(h, device)

    def counted_extend(cache, events, device):
        calls["extend"].append(events.batch_size)
        return extend(cache, events, device)

    monkeypatch.setattr(server, "prefill_histories", counted_prefill)
    monkeypatch.setattr(server, "extend_histories", counted_extend)
    return calls


def test_time_encoded_extends_are_encoded_once_at_the_next_score(monkeypatch):
    model = _model("ranking-deferred")
    users = _Users(model, torch.Generator().manual_seed(1))
    session = ServingSession(model)
    calls = _counting(session, monkeypatch)
    ids = ["u0", "u1", "u2"]
    session.open(ids, users.open([3, 2, 4]))
    assert calls["prefill"] == [3]
    for counts in ([1, 0, 2], [2, 0, 1], [1, 0, 0]):
        session.extend(ids, users.extend(counts))
    assert calls["prefill"] == [3]  # kept, not encoded
    _check(session, users, [2, 1, 0], "deferred")
    assert calls["prefill"] == [3, 2]  # u2 and u0 once; u1 got no events and kept its rows
    _check(session, users, [0, 1, 2], "again")
    assert calls["prefill"] == [3, 2] and calls["extend"] == []
    # extended users move to the end (as when they were encoded at once), encoding keeps them
    assert session.user_ids == ["u1", "u2", "u0"]
    session.close(["u0"])
    assert "u0" not in session and len(session) == 2


def test_incremental_extends_run_at_once_unless_a_history_outgrows_the_bound(monkeypatch):
    model = _model("ranking-incremental")
    users = _Users(model, torch.Generator().manual_seed(2))
    session = ServingSession(model)
    calls = _counting(session, monkeypatch)
    ids, both = ["u0", "u1"], [0, 1]
    session.open(ids, users.open([3, 5]))
    session.extend(ids, users.extend([1, 2]))
    assert calls == {"prefill": [2], "extend": [2]}
    _check(session, users, both, "incremental")
    session.extend(ids, users.extend([users.bound, 1]))  # u0 outgrows the bound
    assert calls == {"prefill": [2], "extend": [2]}
    session.extend(ids, users.extend([1, 0]))  # with a stale user: kept for later too
    assert calls == {"prefill": [2], "extend": [2]}
    _check(session, users, both, "after the bound")
    assert calls == {"prefill": [2, 2], "extend": [2]}
    session.extend(ids, users.extend([0, 1]))  # u0 is at the bound: no room for more
    assert calls == {"prefill": [2, 2], "extend": [2, 2]}
    _check(session, users, both, "incremental again")


def test_a_new_query_time_alone_makes_a_time_encoded_user_stale(monkeypatch):
    model = _model("ranking-deferred")
    users = _Users(model, torch.Generator().manual_seed(3))
    session = ServingSession(model)
    calls = _counting(session, monkeypatch)
    session.open(["u0"], users.open([4]))
    later = int(users.events[0]["ts"][-1]) + 7200
    no_events = Histories(
        torch.zeros(0, dtype=torch.int64),
        torch.tensor([0]),
        torch.zeros(0, dtype=torch.int64),
        torch.zeros(0, dtype=torch.int64),
        query_time=torch.tensor([later]),
    )
    session.extend(["u0"], no_events)
    candidates = torch.randint(0, NUM_ITEMS, (1, 2), generator=users.gen)
    got = session.score(["u0"], candidates)
    assert calls["prefill"] == [1, 1]
    rows = users.events[0]
    with torch.no_grad():
        want = torch.sigmoid(
            model(
                {
                    "uih.item_id": rows["ids"],
                    "uih.sequence_length": torch.tensor([rows["ids"].numel()]),
                    "uih_action.sequence": rows["actions"],
                    "uih_timestamp.sequence": rows["ts"],
                    "candidate.item_id": candidates.reshape(-1),
                    "candidate.sequence_length": torch.tensor([2]),
                    "candidate_timestamp.sequence": torch.tensor([later, later]),
                    "query_time": torch.tensor([later]),
                    "contextual": users.contextual[0][None],
                }
            )
        )
    assert_close(got.reshape(-1, 2), want.double(), torch.float32)
