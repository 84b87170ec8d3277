""":class:`~tzrec_gr.models.HSTURanking`'s serving: prefill histories, score candidates,
append events. The model's ``prefill``, ``score``, ``score_step``, ``extend`` and
``extend_step`` methods call these.

Legend: B = users, L_t = candidate tokens, K = tasks.

``score`` and ``extend`` check their inputs, read the new tokens' longest length on the host
and call the pure steps ``score_step`` and ``extend_step``: functions of a
:class:`~tzrec_gr.serving.ServingCache` and plain tensors that check nothing, read nothing
on the host and change nothing, which ``torch.export`` records (the new tokens padded to the
model's bound, which changes no output).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Dict, Optional, Sequence

import torch

from tzrec_gr.features import (
    CANDIDATE_ITEM_ID,
    CANDIDATE_LENGTHS,
    CANDIDATE_TIMESTAMPS,
    UIH_ACTIONS,
    UIH_ITEM_ID,
    UIH_LENGTHS,
    UIH_TIMESTAMPS,
)
from tzrec_gr.models._inputs import check_appended, check_batch, check_bound
from tzrec_gr.serving.cache import ServingCache, constant_lengths, longest

if TYPE_CHECKING:
    from tzrec_gr.models.ranking import HSTURanking

Batch = Dict[str, torch.Tensor]

__all__ = ["extend", "extend_step", "prefill", "score", "score_step"]


def _empty(keys: Sequence[str], users: int, like: torch.Tensor) -> Batch:
    """No history or no candidates: ``keys`` (ids, lengths, timestamps[, actions])."""
    empty = torch.zeros(0, dtype=torch.int64, device=like.device)
    lengths = constant_lengths(0, users, like.device)
    return {k: lengths if k.endswith("sequence_length") else empty for k in keys}


def _no_candidates(users: int, like: torch.Tensor) -> Batch:
    return _empty((CANDIDATE_ITEM_ID, CANDIDATE_LENGTHS, CANDIDATE_TIMESTAMPS), users, like)


def _no_history(users: int, like: torch.Tensor) -> Batch:
    return _empty((UIH_ITEM_ID, UIH_LENGTHS, UIH_ACTIONS, UIH_TIMESTAMPS), users, like)


def _tokens_per_event(model: HSTURanking) -> int:
    return 2 if model.transducer.input_preprocessor.enable_interleaving else 1


def _check_extendable(model: HSTURanking) -> None:
    if model.use_time_encoding or model.contextual_seq_len > 0:
        raise NotImplementedError(
            "HSTURanking.extend needs use_time_encoding=False and no contextual features: "
            "positions counted back from the newest event, time gaps to the query time "
            "and contextual tokens (which attend to all history) change for every cached "
            "token when history grows; prefill the longer history instead"
        )


@torch.no_grad()
def prefill(
    model: HSTURanking,
    history: Batch,
    query_time: Optional[torch.Tensor] = None,
    max_uih_len: Optional[int] = None,
) -> ServingCache:
    """Encode B users' histories once and cache every layer's keys and values.

    Args:
        model (HSTURanking): in eval mode.
        history (Dict[str, torch.Tensor]): the ``uih.*`` features of ``forward`` (and
            ``contextual`` with C > 0); no candidates.
        query_time (torch.Tensor | None): [B] integer request time of each user, the
            anchor of every time gap (required with time encoding; candidates scored
            against this cache are measured from it too).
        max_uih_len (int | None): as in ``forward``.

    Returns:
        ServingCache: for :func:`score` (and :func:`extend`) of this model.
    """
    max_uih_len = check_bound("max_uih_len", max_uih_len, model.max_uih_len)
    model.transducer.check_cache(None)
    users = model._check_history("history", history, max_uih_len, contextual=True)
    if model.use_time_encoding and query_time is None:
        raise ValueError(
            "query_time is required: the time gaps of the cached history and of the "
            "candidates scored against it are measured from it"
        )
    model._check_query_time("query_time", query_time, users)
    lengths = history[UIH_LENGTHS]
    features, _ = model.embed_features({**history, **_no_candidates(users, lengths)})
    _, cache = model.transducer.prefill(features, max_uih_len, query_time=query_time)
    return cache


@torch.no_grad()
def score(model: HSTURanking, cache: ServingCache, candidates: Batch) -> torch.Tensor:
    """Logits of candidates against cached histories; the cache is unchanged.

    Exact: equals ``forward(history + candidates)`` with ``query_time`` = the one given to
    :func:`prefill` (up to rounding), because targets attend to the history and themselves
    only, and the divisor is fixed. Call it any number of times with the same cache.

    Args:
        model (HSTURanking): in eval mode.
        cache (ServingCache): from :func:`prefill` (or :func:`extend`) of this model.
        candidates (Dict[str, torch.Tensor]): ``candidate.item_id`` [L_t],
            ``candidate.sequence_length`` [B] (at most ``max_targets`` each),
            ``candidate_timestamp.sequence`` [L_t].

    Returns:
        torch.Tensor: [L_t, K] logits, candidates in input order.
    """
    model.transducer.check_cache(cache)
    model._check_candidates("candidates", candidates, model.max_targets, cache.batch_size)
    return score_step(model, cache, candidates, longest(candidates[CANDIDATE_LENGTHS]))


def score_step(
    model: HSTURanking,
    cache: ServingCache,
    candidates: Batch,
    max_candidates: Optional[int] = None,
) -> torch.Tensor:
    """:func:`score` as a pure function, which ``torch.export`` can record (the cache a
    pytree argument): nothing is checked, nothing read on the host and nothing changed.

    Args:
        model (HSTURanking): in eval mode.
        cache (ServingCache): the users' cache; its ``max_len`` (None: the model's
            ``max_cached_len``) bounds its lengths.
        candidates (Dict[str, torch.Tensor]): as for :func:`score`.
        max_candidates (int | None): an upper bound on candidates per user; each user's
            are padded to it (which changes no output). Default: ``max_targets``.

    Returns:
        torch.Tensor: [L_t, K] logits, candidates in input order.
    """
    like = candidates[CANDIDATE_LENGTHS]
    features, cand = model.embed_features({**_no_history(cache.batch_size, like), **candidates})
    max_new = model.max_targets if max_candidates is None else max_candidates
    user, _, _ = model.transducer.cached_forward(features, cache, max_new, targets=True)
    return model.head(user, cand)


@torch.no_grad()
def extend(model: HSTURanking, cache: ServingCache, events: Batch) -> ServingCache:
    """Append ``events['uih.sequence_length'][b]`` new events to user b's history.

    Exact (the result equals :func:`prefill` of the longer history, up to rounding) only for
    a model built with ``use_time_encoding=False`` and no contextual features: otherwise
    ``NotImplementedError``, because positions counted back from the newest event and time
    gaps to the query time change for every cached token, and the contextual tokens attend
    to every history token. Prefill the longer history then.

    Args:
        model (HSTURanking): in eval mode.
        cache (ServingCache): from :func:`prefill` or :func:`extend` of this model.
        events (Dict[str, torch.Tensor]): the new events as ``uih.*`` features; a user's
            cached and new events together stay within ``max_uih_len``.

    Returns:
        ServingCache: the extended cache (the given one is unchanged).
    """
    model.transducer.check_cache(cache)
    _check_extendable(model)
    model._check_history("events", events, model.max_uih_len, contextual=False)
    lengths = events[UIH_LENGTHS]
    check_batch(f"events[{UIH_LENGTHS!r}]", lengths, cache.batch_size, "the cache")
    check_appended(
        f"events[{UIH_LENGTHS!r}]",
        cache.lengths,
        lengths,
        _tokens_per_event(model),
        model.max_uih_len,
        "max_uih_len",
    )
    new = extend_step(model, cache, events, longest(lengths))
    return dataclasses.replace(new, max_len=longest(new.lengths))


def extend_step(
    model: HSTURanking,
    cache: ServingCache,
    events: Batch,
    max_events: Optional[int] = None,
) -> ServingCache:
    """:func:`extend` as a pure function, which ``torch.export`` can record: the cache goes
    in whole and the extended one comes back; nothing is checked, read on the host or
    changed in place.

    Args:
        model (HSTURanking): in eval mode, built with ``use_time_encoding=False`` and no
            contextual features.
        cache (ServingCache): as for :func:`score_step`.
        events (Dict[str, torch.Tensor]): as for :func:`extend`.
        max_events (int | None): an upper bound on new events per user. Default:
            ``max_uih_len``.

    Returns:
        ServingCache: the extended cache; its ``max_len`` bounds the new lengths.
    """
    _check_extendable(model)
    before = model.max_cached_len if cache.max_len is None else cache.max_len
    max_new = model.max_uih_len if max_events is None else max_events
    after = min(before + _tokens_per_event(model) * max_new, model.max_cached_len)
    like = events[UIH_LENGTHS]
    features, _ = model.embed_features({**events, **_no_candidates(cache.batch_size, like)})
    _, _, new = model.transducer.cached_forward(
        features, cache, max_new, targets=False, update_cache=True, max_cached_len=after
    )
    if new is None:
        raise RuntimeError("the transducer returned no cache with update_cache=True")
    return new
