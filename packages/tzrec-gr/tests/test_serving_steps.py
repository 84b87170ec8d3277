"""The servers' pure steps: functions of a cache (a pytree) that ``torch.export`` records.

``score`` / ``extend`` over a ``ServingCache`` check their inputs and call the steps, so the
steps at the models' bounds (the defaults, which an exported graph uses: new tokens padded
to the bound, the cache rebuilt from its leaves without its ``max_len``) must give what the
methods give with the batch's own longest lengths, in float64. The exported steps (pytorch
backend, CPU, float32 with torch.testing's default tolerances, as in test_export.py), which
take the cache whole, with dynamic users and token dims, are run on batches of other sizes
than the export example (one user among them).
"""

from __future__ import annotations

from typing import Any, List, Sequence, Tuple

import pytest
import torch
import torch.utils._pytree as pytree
from _models import (
    history_user,
    ranking_batch,
    ranking_model,
    ranking_user,
    retrieval_batch,
    retrieval_model,
)
from torch.export import Dim

from tzrec_gr.models import HSTURanking, HSTURetrieval
from tzrec_gr.serving import RankingServer, RetrievalServer, ServingCache, server_for
from tzrec_ops.testing.tolerances import assert_close

HISTORY = ("uih.item_id", "uih_action.sequence", "uih_timestamp.sequence")
CANDIDATES = ("candidate.item_id", "candidate_timestamp.sequence", "candidate.sequence_length")
MAX_USERS = 16


def _as_exported(cache: ServingCache) -> ServingCache:
    """``cache`` rebuilt from its pytree leaves, as an exported step receives it."""
    leaves, spec = pytree.tree_flatten(cache)
    return pytree.tree_unflatten(leaves, spec)


def _assert_same_cache(got: ServingCache, want: ServingCache, dtype: torch.dtype) -> None:
    """``got``'s tensors equal ``want``'s."""
    assert got.offsets.tolist() == want.offsets.tolist()
    assert got.lengths.tolist() == want.lengths.tolist()
    for layer, (k, v) in enumerate(zip(got.keys, got.values)):
        assert_close(k, want.keys[layer].double(), dtype, name=f"keys[{layer}]")
        assert_close(v, want.values[layer].double(), dtype, name=f"values[{layer}]")


def test_cache_is_a_pytree_of_its_tensors_without_its_ints():
    model = retrieval_model()
    cache, _ = _retrieval_request(model, [3, 2], [0, 0])
    leaves, spec = pytree.tree_flatten(cache)
    assert all(isinstance(t, torch.Tensor) for t in leaves)
    assert len(leaves) == 2 * len(cache.keys) + 3  # keys, values, offsets, lengths, users
    assert cache.max_len == 3 and cache.owner is not None
    rebuilt = pytree.tree_unflatten(leaves, spec)
    assert rebuilt.max_len is None and rebuilt.owner is None
    # another model's cache of the same shape flattens to the same spec
    other, _ = _retrieval_request(retrieval_model(), [1, 4, 2], [0, 0, 0])
    assert pytree.tree_flatten(other)[1] == spec
    doubled = pytree.tree_map(lambda t: t.double() if t.is_floating_point() else t, cache)
    assert doubled.keys[0].dtype == torch.float64 and doubled.lengths.dtype == torch.int64


# -- ranking --------------------------------------------------------------------------------


def _ranking_request(
    model: HSTURanking,
    histories: Sequence[int],
    candidates: Sequence[int],
    dtype: torch.dtype,
    device: str = "cpu",
) -> Tuple[ServingCache, dict, dict]:
    """(cache of the users' histories, their candidates, the full batch for forward)."""
    users = [ranking_user(h, c) for h, c in zip(histories, candidates)]
    for u in users:
        u["contextual"] = u["contextual"].to(dtype)
    keys = [*HISTORY, "uih.sequence_length"]
    if model.contextual_seq_len:
        keys.append("contextual")
    query_time = ranking_batch(users, ["query_time"], device)["query_time"]
    cache = server_for(model).prefill(ranking_batch(users, keys, device), query_time)
    full = ranking_batch(users, [*keys, *CANDIDATES, "query_time"], device)
    return cache, ranking_batch(users, CANDIDATES, device), full


@pytest.mark.parametrize("kw", [{}, {"enable_interleaving": True}], ids=["plain", "interleaved"])
def test_ranking_score_step_equals_score_and_forward(kw):
    model = ranking_model(**kw).double()
    cache, candidates, full = _ranking_request(model, [5, 0, 9], [2, 1, 4], torch.float64)
    with torch.no_grad():
        # at the model's bounds (max_targets, max_cached_len), as an exported step runs
        got = server_for(model).score_step(_as_exported(cache), candidates)
        expected = model(full)
    assert_close(got, server_for(model).score(cache, candidates), torch.float64, name="score")
    assert_close(got, expected, torch.float64, name="forward")


@pytest.mark.parametrize("interleave", [False, True])
def test_ranking_extend_step_equals_extend(interleave):
    model = ranking_model(
        contextual_feature_dim=0,
        max_contextual_seq_len=0,
        use_time_encoding=False,
        enable_interleaving=interleave,
    ).double()
    users = [ranking_user(h, 1, context_width=0) for h in (8, 3)]
    keys = [*HISTORY, "uih.sequence_length"]
    history = ranking_batch([{k: u[k][:4] for k in HISTORY} for u in users], keys)
    events = ranking_batch([{k: u[k][4:] for k in HISTORY} for u in users], keys)
    cache = server_for(model).prefill(history)
    before = [t.clone() for t in (cache.lengths, *cache.keys)]
    with torch.no_grad():
        got = server_for(model).extend_step(_as_exported(cache), events)
    _assert_same_cache(got, server_for(model).extend(cache, events), torch.float64)
    # the given cache is a value: the step changed none of its tensors
    for old, now in zip(before, (cache.lengths, *cache.keys)):
        assert torch.equal(old, now)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("backend", ["pytorch", "triton"])
def test_ranking_score_step_on_gpu_equals_score_and_forward(backend):
    model = ranking_model(backend, "cuda")
    cache, candidates, full = _ranking_request(model, [5, 0, 9], [2, 1, 4], torch.float32, "cuda")
    with torch.no_grad():
        got = server_for(model).score_step(_as_exported(cache), candidates)
        expected = model(full)
    want = server_for(model).score(cache, candidates)
    assert_close(got, want.double(), torch.float32, name="score")
    assert_close(got, expected.double(), torch.float32, name="forward")


def test_ranking_extend_step_refuses_time_encoding():
    model = ranking_model()
    with pytest.raises(NotImplementedError, match="use_time_encoding=False"):
        empty = ServingCache((), (), torch.zeros(1), torch.zeros(0))
        RankingServer(model).extend_step(empty, {})


class _Score(torch.nn.Module):
    """``RankingServer.score_step`` as a module's forward (what torch.export takes)."""

    def __init__(self, model: HSTURanking) -> None:
        super().__init__()
        self.model = model
        self.server = RankingServer(model)

    def forward(self, cache, candidates):
        return self.server.score_step(cache, candidates)


def _dynamic_cache_shapes(
    layers: int, users: Dim, max_tokens: int, per_user: Sequence[Any]
) -> List[Any]:
    """The cache's dynamic shapes: its leaves' in field order (keys, values, offsets,
    lengths, then ``per_user``: the optional tensors it holds)."""
    tokens = Dim("cached_tokens", max=MAX_USERS * max_tokens)
    kv = ({0: tokens},) * layers  # keys and values are tuples
    return [kv, kv, {0: users + 1}, {0: users}, *per_user]


def test_ranking_score_step_exports_with_dynamic_users_and_tokens():
    model = ranking_model()
    # a first user with fewer than max_targets candidates: with every user at the bound
    # export would specialise the padding away
    cache, candidates, _ = _ranking_request(model, [5, 0, 9], [3, 1, 4], torch.float32)
    users = Dim("users", min=1, max=MAX_USERS)
    new = Dim("candidate_tokens", max=MAX_USERS * model.max_targets)
    per_user = ({0: users}, {0: users, 1: Dim.STATIC})  # query_time, contextual
    shapes = (
        _dynamic_cache_shapes(len(cache.keys), users, model.max_cached_len, per_user),
        {
            "candidate.item_id": {0: new},
            "candidate_timestamp.sequence": {0: new},
            "candidate.sequence_length": {0: users},
        },
    )
    step = _Score(model)
    with torch.no_grad():
        program = torch.export.export(step, (cache, candidates), dynamic_shapes=shapes)
    for histories, counts in (([7, 2, 10, 1, 4], [1, 4, 2, 2, 3]), ([6], [2])):
        other, other_candidates, _ = _ranking_request(model, histories, counts, torch.float32)
        with torch.no_grad():
            got = program.module()(other, other_candidates)
        torch.testing.assert_close(got, server_for(model).score(other, other_candidates))


# -- retrieval ------------------------------------------------------------------------------


def _retrieval_request(
    model: HSTURetrieval, histories: Sequence[int], new: Sequence[int]
) -> Tuple[ServingCache, Tuple[torch.Tensor, ...]]:
    """(cache of the histories, the new events (ids, lengths, timestamps))."""
    users = [history_user(h + n) for h, n in zip(histories, new)]
    old = [{k: v[:h] for k, v in u.items()} for u, h in zip(users, histories)]
    events = [{k: v[h:] for k, v in u.items()} for u, h in zip(users, histories)]
    return server_for(model).prefill(*retrieval_batch(old)), retrieval_batch(events)


def test_retrieval_steps_equal_extend_and_score():
    model = retrieval_model().double()
    cache, events = _retrieval_request(model, [3, 0, 5], [2, 1, 0])
    candidate_ids = torch.randint(0, model.num_items, (3, 4))
    server = RetrievalServer(model)
    with torch.no_grad():
        rows = server.event_embeddings_step(_as_exported(cache), *events)
        got_rows, extended = server.extend_step(_as_exported(cache), *events)
        scores = server.score_step(_as_exported(cache), candidate_ids)
    want_rows, want = server.extend(cache, *events)
    assert_close(rows, want_rows, torch.float64, name="event_embeddings_step")
    assert_close(got_rows, want_rows, torch.float64, name="extend_step rows")
    _assert_same_cache(extended, want, torch.float64)
    assert_close(
        extended.user_embeddings, want.user_embeddings, torch.float64, name="user embeddings"
    )
    assert_close(scores, server.score(cache, candidate_ids), torch.float64, name="score_step")


class _EventEmbeddings(torch.nn.Module):
    """``RetrievalServer.event_embeddings_step`` with at most ``max_events`` new events per
    user, as a module's forward."""

    def __init__(self, model: HSTURetrieval, max_events: int) -> None:
        super().__init__()
        self.model = model
        self.server = RetrievalServer(model)
        self.max_events = max_events

    def forward(self, cache, item_ids, new_lengths, timestamps):
        return self.server.event_embeddings_step(
            cache, item_ids, new_lengths, timestamps, self.max_events
        )


class _Extend(_EventEmbeddings):
    """``RetrievalServer.extend_step`` likewise: the extended cache comes back whole."""

    def forward(self, cache, item_ids, new_lengths, timestamps):
        return self.server.extend_step(cache, item_ids, new_lengths, timestamps, self.max_events)


def test_retrieval_event_embeddings_step_exports_with_dynamic_users_and_tokens():
    model = retrieval_model()
    cache, events = _retrieval_request(model, [3, 0, 5], [2, 1, 0])
    users = Dim("users", min=1, max=MAX_USERS)
    new = Dim("new_events", max=MAX_USERS * 3)
    per_user = ({0: users, 1: Dim.STATIC},)  # user_embeddings
    shapes = (
        _dynamic_cache_shapes(len(cache.keys), users, model.max_cached_len, per_user),
        {0: new},
        {0: users},
        {0: new},
    )
    with torch.no_grad():
        program = torch.export.export(
            _EventEmbeddings(model, 3), (cache, *events), dynamic_shapes=shapes
        )
    for histories, counts in (([4, 1, 7, 2, 0], [3, 1, 2, 0, 3]), ([6], [1])):
        other, other_events = _retrieval_request(model, histories, counts)
        want, _ = server_for(model).extend(other, *other_events, update_cache=False)
        with torch.no_grad():
            got = program.module()(other, *other_events)
        torch.testing.assert_close(got, want)


def test_retrieval_extend_step_exports_with_dynamic_users_and_tokens():
    model = retrieval_model()
    cache, events = _retrieval_request(model, [3, 0, 5], [2, 1, 0])
    users = Dim("users", min=1, max=MAX_USERS)
    new = Dim("new_events", max=MAX_USERS * 3)
    per_user = ({0: users, 1: Dim.STATIC},)  # user_embeddings
    shapes = (
        _dynamic_cache_shapes(len(cache.keys), users, model.max_cached_len, per_user),
        {0: new},
        {0: users},
        {0: new},
    )
    with torch.no_grad():
        program = torch.export.export(_Extend(model, 3), (cache, *events), dynamic_shapes=shapes)
    for histories, counts in (([4, 1, 7, 2, 0], [3, 1, 2, 0, 3]), ([6], [2])):
        other, other_events = _retrieval_request(model, histories, counts)
        want_rows, want = server_for(model).extend(other, *other_events)
        with torch.no_grad():
            rows, got = program.module()(other, *other_events)
        torch.testing.assert_close(rows, want_rows)
        assert isinstance(got, ServingCache) and got.max_len is None
        for name in ("keys", "values", "offsets", "lengths", "user_embeddings"):
            torch.testing.assert_close(getattr(got, name), getattr(want, name))


def test_cache_tensors_are_checked():
    model = retrieval_model()
    cache, events = _retrieval_request(model, [3, 2], [1, 1])
    keys, values, offsets, lengths = cache.keys, cache.values, cache.offsets, cache.lengths
    with pytest.raises(ValueError, match=r"offsets must be \[B \+ 1\] = \[3\] .* got shape \(4,\)"):
        ServingCache(keys, values, torch.cat([offsets, offsets[-1:]]), lengths)
    one_layer = ServingCache(keys[:1], values, offsets, lengths, user_embeddings=torch.zeros(2, 16))
    with pytest.raises(ValueError, match=r"one tensor per STU layer \(2\), got 1 and 2"):
        server_for(model).event_embeddings_step(one_layer, *events)
