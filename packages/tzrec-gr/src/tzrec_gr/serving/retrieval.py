""":class:`~tzrec_gr.models.HSTURetrieval`'s serving: prefill histories, append events, score
candidates. The model's ``prefill``, ``extend``, ``score`` and step methods call these.

Legend: B = users, E = embedding width, L' = new events, T = candidates per user.

``extend`` and ``score`` check their inputs and call the pure steps
(``event_embeddings_step``, ``extend_step``, ``score_step``): functions of a
:class:`~tzrec_gr.serving.ServingCache` and plain tensors that check nothing, read nothing
on the host and change nothing, which ``torch.export`` records (the new events padded to the
model's bound, which changes no output).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional, Tuple

import torch

from tzrec_gr.models._inputs import (
    check_appended,
    check_batch,
    check_bound,
    check_int_tensor,
    check_item_ids,
)
from tzrec_gr.serving.cache import ServingCache, longest

if TYPE_CHECKING:
    from tzrec_gr.models.retrieval import HSTURetrieval

__all__ = ["event_embeddings_step", "extend", "extend_step", "prefill", "score", "score_step"]


def _user_embeddings(cache: ServingCache) -> torch.Tensor:
    if cache.user_embeddings is None:
        raise ValueError("cache holds no user embeddings: it was not built by HSTURetrieval")
    return cache.user_embeddings


@torch.no_grad()
def prefill(
    model: HSTURetrieval,
    item_ids: torch.Tensor,
    lengths: torch.Tensor,
    timestamps: torch.Tensor,
    max_seq_len: Optional[int] = None,
) -> ServingCache:
    """Encode B users' histories once and cache every layer's keys and values.

    Arguments as in the model's ``forward``. ``cache.user_embeddings`` is
    ``model.user_embedding(item_ids, lengths, timestamps)``.

    Returns:
        ServingCache: for :func:`extend` and :func:`score` of this model.
    """
    max_seq_len = check_bound("max_seq_len", max_seq_len, model.max_seq_len)
    model.transducer.check_cache(None)
    model._check_history(item_ids, lengths, timestamps, max_seq_len)
    features = model.embed_features(item_ids, lengths, timestamps)
    out, cache = model.transducer.prefill(features, max_seq_len)
    if out.full_embeddings is None:
        raise RuntimeError("the transducer must return full embeddings")
    users = model._last_rows(out.full_embeddings, lengths)
    return dataclasses.replace(cache, user_embeddings=users)


@torch.no_grad()
def extend(
    model: HSTURetrieval,
    cache: ServingCache,
    item_ids: torch.Tensor,
    lengths: torch.Tensor,
    timestamps: torch.Tensor,
    update_cache: bool = True,
) -> Tuple[torch.Tensor, Optional[ServingCache]]:
    """Append ``lengths[b]`` new events to user b's cached history.

    Exact: the returned rows are the rows of the new events in
    ``forward(history + events)`` and the new cache is ``prefill(history + events)``'s
    (up to rounding), because positions count forward and the layers are causal with a
    fixed attention divisor: no cached token depends on later ones.

    Args:
        model (HSTURetrieval): in eval mode.
        cache (ServingCache): from :func:`prefill` or :func:`extend` of this model.
        item_ids (torch.Tensor): [L'] the new events' item ids, user-major.
        lengths (torch.Tensor): [B] new events per user (0 allowed); a user's cached and
            new events together stay within ``max_seq_len``.
        timestamps (torch.Tensor): [L'] their timestamps.
        update_cache (bool): return the extended cache; False returns None and leaves
            the cache as it was (a what-if, without copying the cache). Default: True.

    Returns:
        (torch.Tensor [L', E] the user embedding after each new event,
        ServingCache | None).
    """
    model.transducer.check_cache(cache)
    check_batch("lengths", lengths, cache.batch_size, "the cache")
    model._check_history(item_ids, lengths, timestamps, model.max_seq_len)
    check_appended("lengths", cache.lengths, lengths, 1, model.max_seq_len, "max_seq_len")
    events = (item_ids, lengths, timestamps, longest(lengths))
    if not update_cache:
        return event_embeddings_step(model, cache, *events), None
    out, new = extend_step(model, cache, *events)
    return out, dataclasses.replace(new, max_len=longest(new.lengths))


def event_embeddings_step(
    model: HSTURetrieval,
    cache: ServingCache,
    item_ids: torch.Tensor,
    new_lengths: torch.Tensor,
    timestamps: torch.Tensor,
    max_events: Optional[int] = None,
) -> torch.Tensor:
    """``extend(cache, ..., update_cache=False)[0]`` as a pure function, which
    ``torch.export`` can record (the cache a pytree argument): the user embedding after each
    new event, the cache unchanged. Nothing is checked or read on the host.

    Args:
        model (HSTURetrieval): in eval mode.
        cache (ServingCache): the users' cache; its ``max_len`` (None: the model's
            ``max_cached_len``) bounds its lengths.
        item_ids, new_lengths, timestamps: the new events, as :func:`extend`'s
            ``item_ids``, ``lengths`` and ``timestamps``.
        max_events (int | None): an upper bound on new events per user; each user's
            are padded to it (which changes no output). Default: ``max_seq_len``.

    Returns:
        torch.Tensor: [L', E].
    """
    features = model.embed_features(item_ids, new_lengths, timestamps)
    max_new = model.max_seq_len if max_events is None else max_events
    out, _, _ = model.transducer.cached_forward(features, cache, max_new, targets=False)
    return out


def extend_step(
    model: HSTURetrieval,
    cache: ServingCache,
    item_ids: torch.Tensor,
    new_lengths: torch.Tensor,
    timestamps: torch.Tensor,
    max_events: Optional[int] = None,
) -> Tuple[torch.Tensor, ServingCache]:
    """:func:`extend` as a pure function, which ``torch.export`` can record: the cache goes
    in whole and the extended one comes back; nothing is checked, read on the host or
    changed in place.

    Args: as for :func:`event_embeddings_step`; the cache must hold ``user_embeddings``.

    Returns:
        (rows [L', E] the user embedding after each new event, the extended cache, whose
        ``user_embeddings`` [B, E] are each user's newest and whose ``max_len`` bounds the
        new lengths).
    """
    before = model.max_cached_len if cache.max_len is None else cache.max_len
    users = _user_embeddings(cache)
    features = model.embed_features(item_ids, new_lengths, timestamps)
    max_new = model.max_seq_len if max_events is None else max_events
    after = min(before + max_new, model.max_cached_len)
    out, _, new = model.transducer.cached_forward(
        features, cache, max_new, targets=False, update_cache=True, max_cached_len=after
    )
    if new is None:
        raise RuntimeError("the transducer returned no cache with update_cache=True")
    last = model._last_rows(out, new_lengths)
    users = torch.where((new_lengths > 0).unsqueeze(1), last, users)
    return out, dataclasses.replace(new, user_embeddings=users)


@torch.no_grad()
def score(model: HSTURetrieval, cache: ServingCache, candidate_ids: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of each user's embedding with candidate items.

    Equals ``user_embedding(history) @ item_embedding(candidates)`` per user.

    Args:
        model (HSTURetrieval): in eval mode.
        cache (ServingCache): from :func:`prefill` or :func:`extend` of this model.
        candidate_ids (torch.Tensor): [B, T] candidates per user, or [T] shared by all.

    Returns:
        torch.Tensor: [B, T] in ``[-1, 1]``.
    """
    model.transducer.check_cache(cache)
    if not isinstance(candidate_ids, torch.Tensor) or candidate_ids.dim() not in (1, 2):
        raise ValueError(
            "candidate_ids must be a [B, T] or [T] integer tensor, got "
            f"{getattr(candidate_ids, 'shape', type(candidate_ids).__name__)}"
        )
    check_int_tensor("candidate_ids", candidate_ids, candidate_ids.dim())
    if candidate_ids.dim() == 2:
        check_batch("candidate_ids", candidate_ids, cache.batch_size, "the cache")
    check_item_ids("candidate_ids", candidate_ids, model.num_items, model.validate_inputs)
    return score_step(model, cache, candidate_ids)


def score_step(
    model: HSTURetrieval, cache: ServingCache, candidate_ids: torch.Tensor
) -> torch.Tensor:
    """:func:`score` as a pure function (unchecked): [B, T] cosines of the cache's
    ``user_embeddings`` [B, E] with the candidates' item embeddings, ``candidate_ids``
    [B, T] or [T]."""
    user_embeddings = _user_embeddings(cache)
    items = model.item_embedding(candidate_ids).to(user_embeddings.dtype)
    if items.dim() == 2:
        return user_embeddings @ items.t()
    return torch.einsum("be,bte->bt", user_embeddings, items)
