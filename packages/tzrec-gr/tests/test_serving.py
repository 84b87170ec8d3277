"""The servers' API (``RetrievalServer``, ``RankingServer``): prefill once, then score
candidates and append events.

What each model guarantees (eval mode, same weights, up to rounding):

* retrieval: ``extend`` rows == the new events' rows of ``forward(history + events)``, its
  cache == ``prefill(history + events)``'s, and ``score`` == user_embedding . item_embedding;
* ranking: ``score`` == ``forward(history + candidates)`` with prefill's ``query_time``;
  ``extend`` is exact without time encoding and contextual features, and raises otherwise.
"""

from __future__ import annotations

import pytest
import torch
from _models import (
    CPU_BACKENDS,
    history_user,
    ranking_batch,
    ranking_model,
    ranking_user,
    retrieval_batch,
    retrieval_model,
)

from tzrec_gr import HSTUPositionalEncoder, STULayer, STUStack
from tzrec_gr.serving import Candidates, Histories, RankingServer, RetrievalServer, server_for
from tzrec_gr.serving import transducer as serving_transducer
from tzrec_ops.jagged import offsets_from_lengths
from tzrec_ops.testing.tolerances import assert_close

HISTORY = ("uih.item_id", "uih_action.sequence", "uih_timestamp.sequence")
CANDIDATES = ("candidate.item_id", "candidate_timestamp.sequence")


def _slice(user, keys, start, stop):
    return {k: user[k][start:stop] for k in keys}


# -- retrieval ------------------------------------------------------------------------------


STEPS = [[2, 1, 0], [0, 3, 1], [4, 2, 2]]


def _retrieval_steps(backend: str, device: str, dtype: torch.dtype, steps=STEPS) -> None:
    """Prime histories of 3, 0 and 5 events, then append jagged steps (a user may get
    none); every step equals the full forward over everything seen so far."""
    model = retrieval_model(backend, device).to(dtype)
    users = [history_user(12) for _ in range(3)]
    seen = [3, 0, 5]

    def upto(counts, start=None):
        return [
            {k: v[(0 if start is None else start[b]) : counts[b]] for k, v in u.items()}
            for b, u in enumerate(users)
        ]

    cache = server_for(model).prefill(*retrieval_batch(upto(seen), device))
    for step in steps:
        after = [s + d for s, d in zip(seen, step)]
        ids, lengths, ts = retrieval_batch(upto(after, seen), device)
        what_if, none = server_for(model).extend(cache, ids, lengths, ts, update_cache=False)
        out, cache = server_for(model).extend(cache, ids, lengths, ts)
        full = model(*retrieval_batch(upto(after), device))
        rows = torch.cat(
            [torch.arange(sum(after[:b]) + seen[b], sum(after[:b]) + after[b]) for b in range(3)]
        )
        assert none is None and torch.equal(what_if, out)
        assert_close(out, full[rows.to(full.device)].double(), dtype, name=f"step {step}")
        users_now = full[[sum(after[: b + 1]) - 1 for b in range(3)]]  # all have events
        assert_close(cache.user_embeddings, users_now.double(), dtype, name="user embeddings")
        seen = after
    fresh = server_for(model).prefill(*retrieval_batch(upto(seen), device))
    assert cache.offsets.tolist() == fresh.offsets.tolist()
    for old_k, old_v, new_k, new_v in zip(cache.keys, cache.values, fresh.keys, fresh.values):
        assert_close(old_k, new_k.double(), dtype, name="cached keys")
        assert_close(old_v, new_v.double(), dtype, name="cached values")
    candidates = torch.randint(0, 40, (3, 5), device=device)
    items = model.item_embedding(candidates)
    expected = torch.einsum("be,bte->bt", users_now.double(), items.double())
    assert_close(server_for(model).score(cache, candidates), expected, dtype, name="scores")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_retrieval_incremental_steps_equal_the_full_forward(backend):
    # the interpreter is slow: two steps still cover an empty cache and a user without events
    _retrieval_steps(backend, "cpu", torch.float32, STEPS if backend == "pytorch" else STEPS[:2])


def test_retrieval_serving_in_float64():
    _retrieval_steps("pytorch", "cpu", torch.float64)


def test_retrieval_score_takes_shared_candidates():
    model = retrieval_model()
    ids, lengths, ts = retrieval_batch([history_user(4), history_user(2)])
    cache = server_for(model).prefill(ids, lengths, ts)
    shared = torch.tensor([1, 5, 9])
    expected = model.user_embedding(ids, lengths, ts) @ model.item_embedding(shared).t()
    torch.testing.assert_close(server_for(model).score(cache, shared), expected)


# -- ranking --------------------------------------------------------------------------------


def _ranking_scores(backend: str, device: str, dtype: torch.dtype, **kw) -> None:
    """Two candidate sets (a user with none in the second) scored against one cache equal
    the full forward with prefill's query time."""
    model = ranking_model(backend, device, **kw).to(dtype)
    users = [ranking_user(h, 4) for h in (5, 0, 9)]
    for u in users:
        u["contextual"] = u["contextual"].to(dtype)
    keys = [*HISTORY, "uih.sequence_length", "contextual"]
    history = ranking_batch(users, keys, device)
    query_time = ranking_batch(users, ["query_time"], device)["query_time"]
    cache = server_for(model).prefill(history, query_time)
    for counts in ([2, 1, 4], [3, 0, 1]):
        picked = [{**u, **_slice(u, CANDIDATES, 0, n)} for u, n in zip(users, counts)]
        candidates = ranking_batch(picked, [*CANDIDATES, "candidate.sequence_length"], device)
        expected = model(ranking_batch(picked, device=device))
        got = server_for(model).score(cache, candidates)
        assert_close(got, expected.double(), dtype, name=f"{counts}")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_ranking_scores_against_a_cache_equal_the_full_forward(backend):
    _ranking_scores(backend, "cpu", torch.float32)


@pytest.mark.parametrize(
    "kw",
    [
        {"enable_interleaving": True},
        {"use_time_encoding": False},
        {"contextual_feature_dim": 0, "max_contextual_seq_len": 0},
        {"linear_terms": True},
    ],
)
def test_ranking_scores_equal_the_full_forward_in_every_configuration(kw):
    _ranking_scores("pytorch", "cpu", torch.float64, **kw)


@pytest.mark.parametrize("interleave", [False, True])
def test_ranking_without_time_encoding_appends_events_exactly(interleave):
    model = ranking_model(
        contextual_feature_dim=0,
        max_contextual_seq_len=0,
        use_time_encoding=False,
        enable_interleaving=interleave,
    )
    users = [ranking_user(h, 3, context_width=0) for h in (8, 4)]
    seen = [2, 0]
    history_keys = [*HISTORY, "uih.sequence_length"]

    def events(start, stop):
        return [_slice(u, HISTORY, a, b) for u, a, b in zip(users, start, stop)]

    cache = server_for(model).prefill(ranking_batch(events([0, 0], seen), history_keys))
    candidates = ranking_batch(users, [*CANDIDATES, "candidate.sequence_length"])
    for step in ([3, 1], [0, 2], [3, 1]):
        after = [s + d for s, d in zip(seen, step)]
        new = ranking_batch(events(seen, after), history_keys)
        cache = server_for(model).extend(cache, new)
        full = [{**u, **_slice(u, HISTORY, 0, n)} for u, n in zip(users, after)]
        expected = model(ranking_batch(full))
        assert_close(server_for(model).score(cache, candidates), expected.double(), torch.float32)
        seen = after
    fresh = server_for(model).prefill(ranking_batch(events([0, 0], seen), history_keys))
    assert cache.lengths.tolist() == fresh.lengths.tolist()


def test_ranking_extend_with_time_encoding_or_context_raises():
    users = [ranking_user(3, 1), ranking_user(2, 1)]
    keys = [*HISTORY, "uih.sequence_length", "contextual"]
    for kw in ({}, {"use_time_encoding": False}):
        model = ranking_model(**kw)
        query_time = torch.tensor([9000, 9000])
        cache = server_for(model).prefill(ranking_batch(users, keys), query_time)
        with pytest.raises(NotImplementedError, match="prefill the longer history instead"):
            server_for(model).extend(cache, ranking_batch(users, keys))
    with pytest.raises(ValueError, match="query_time is required"):
        server_for(ranking_model()).prefill(ranking_batch(users, keys))


@pytest.mark.parametrize("timed", [False, True], ids=["positions-forward", "time-encoded"])
def test_time_encoding_makes_the_cached_keys_depend_on_later_events(timed):
    """Why extend with time encoding encodes the history again: the keys of a user's first
    5 events, cached after them, differ from the same rows after 3 more events (same query
    time), because every position counts back from the newest event; with positions
    counted forward they are equal (float32 rounding)."""
    model = ranking_model(
        use_time_encoding=timed, max_contextual_seq_len=0, contextual_feature_dim=0
    )
    user = ranking_user(8, 0, context_width=0)
    keys = [*HISTORY, "uih.sequence_length"]
    query_time = user["query_time"][None]
    short, longer = (
        server_for(model).prefill(
            ranking_batch([_slice(user, HISTORY, 0, n)], keys), query_time
        )
        for n in (5, 8)
    )
    for layer, (k5, k8) in enumerate(zip(short.keys, longer.keys)):
        change = float((k5 - k8[:5]).abs().max())
        if timed:
            assert change > 1e-3, f"layer {layer}"
        else:
            assert change < 1e-5, f"layer {layer}"


# -- errors ---------------------------------------------------------------------------------


def test_serving_rejects_a_cache_from_another_model_or_batch():
    model, other = retrieval_model(), retrieval_model()
    ids, lengths, ts = retrieval_batch([history_user(3), history_user(4)])
    cache = server_for(model).prefill(ids, lengths, ts)
    with pytest.raises(ValueError, match="cache was built by another model's prefill"):
        server_for(other).extend(cache, ids, lengths, ts)
    with pytest.raises(ValueError, match="cache was built by another model's prefill"):
        server_for(other).score(cache, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"lengths has B = 1 users but the cache has 2"):
        server_for(model).extend(cache, ids[:3], lengths[:1], ts[:3])
    with pytest.raises(ValueError, match=r"candidate_ids has B = 3 users but the cache has 2"):
        server_for(model).score(cache, torch.zeros(3, 2, dtype=torch.int64))
    ranking = ranking_model()
    with pytest.raises(ValueError, match="cache was built by another model's prefill"):
        RankingServer(ranking).score(cache, ranking_batch([ranking_user(1, 1)] * 2, CANDIDATES))
    users = [ranking_user(2, 2), ranking_user(1, 1)]
    rcache = server_for(ranking).prefill(
        ranking_batch(users, [*HISTORY, "uih.sequence_length", "contextual"]),
        torch.tensor([1, 2]),
    )
    wrong = ranking_batch(users[:1], [*CANDIDATES, "candidate.sequence_length"])
    with pytest.raises(ValueError, match=r"has B = 1 users but the history has 2"):
        server_for(ranking).score(rcache, wrong)


def test_serving_needs_eval_mode_and_stays_within_the_bound():
    model = retrieval_model(max_seq_len=6)
    ids, lengths, ts = retrieval_batch([history_user(4), history_user(2)])
    cache = server_for(model).prefill(ids, lengths, ts)
    more_ids, more_ts = torch.tensor([1, 2, 3]), torch.arange(3)
    with pytest.raises(ValueError, match=r"user 0 has 4 cached events plus lengths\[0\] = 3 new"):
        server_for(model).extend(cache, more_ids, torch.tensor([3, 0]), more_ts)
    model.train()
    with pytest.raises(RuntimeError, match=r"serving runs in eval mode"):
        server_for(model).prefill(ids, lengths, ts)


# -- the pieces -----------------------------------------------------------------------------


@pytest.mark.parametrize("time", [False, True])
def test_positional_encoder_forward_appended_matches_forward(time):
    """The new rows of ``[cached | new]`` encoded alone equal forward's rows."""
    # CPU float64 tensors: the pytorch backend on every machine (a GPU one would pick triton)
    encoder = HSTUPositionalEncoder(
        8, 6, 5, use_time_encoding=time, contextual_seq_len=1, backend="pytorch"
    )
    cached, new = torch.tensor([3, 1]), torch.tensor([2, 2])
    lengths = cached + new
    offsets = offsets_from_lengths(lengths)
    x = torch.randn(int(lengths.sum()), 8, dtype=torch.float64)
    ts = torch.tensor([0, 10, 50, 900, 900, 0, 7000, 7000])
    query_time = torch.tensor([1000, 9000])
    targets = new if time else None  # time encoding: only targets can be appended
    full = encoder(8, lengths, offsets, ts, x, targets, query_time)
    rows = torch.tensor([3, 4, 6, 7])
    out = encoder.forward_appended(
        x[rows], offsets_from_lengths(new), cached, ts[rows], query_time, targets=time
    )
    torch.testing.assert_close(out, full[rows])
    if time:
        with pytest.raises(NotImplementedError, match="not exact with time encoding"):
            encoder.forward_appended(x[rows], offsets_from_lengths(new), cached, ts, None, False)


def test_stu_cached_forward_warns_without_a_fixed_divisor():
    layer = STULayer(16, 2, 8, 8, output_dropout_ratio=0.0, backend="pytorch").eval()
    x, offsets = torch.randn(5, 16), torch.tensor([0, 2, 5])
    with torch.no_grad():
        cache = layer(x, offsets, 3, kv_caching_lengths=torch.tensor([2, 3])).kv_cache
        with pytest.warns(UserWarning, match="scaling_seqlen=-1 divides attention"):
            layer.cached_forward(torch.randn(2, 16), cache)


def test_transducer_prefill_needs_a_fixed_divisor():
    model = retrieval_model()
    transducer = model.transducer
    transducer.stu = STUStack([STULayer(16, 2, 8, 8, backend="pytorch")])
    with pytest.raises(ValueError, match="serving needs a fixed attention divisor"):
        serving_transducer.prefill(transducer, {})


def test_a_non_tensor_is_a_type_error_naming_the_argument_at_every_door():
    """The models, the servers and the session's inputs share one integer-tensor check."""
    model = retrieval_model()
    ids, lengths, ts = retrieval_batch([history_user(3)])
    with pytest.raises(TypeError, match=r"item_ids must be a torch.Tensor, got list"):
        model(ids.tolist(), lengths, ts)
    server = RetrievalServer(model)
    cache = server.prefill(ids, lengths, ts)
    with pytest.raises(TypeError, match=r"candidate_ids must be a torch.Tensor, got list"):
        server.score(cache, [1, 2])
    with pytest.raises(TypeError, match=r"histories.lengths must be a torch.Tensor, got list"):
        Histories(ids, [3], ts)
    with pytest.raises(TypeError, match=r"candidates.item_ids must be a torch.Tensor, got tuple"):
        Candidates((1, 2), torch.tensor([2]))
    with pytest.raises(TypeError, match=r"histories.contextual must be a torch.Tensor, got list"):
        Histories(ids, lengths, ts, contextual=[[0.0]])
    with pytest.raises(ValueError, match=r"histories.item_ids must be an integer tensor"):
        Histories(ids.float(), lengths, ts)
