""":class:`RetrievalServer`: the serving of an :class:`~tzrec_gr.models.HSTURetrieval`:
prefill histories, append events, score candidates.

Legend: B = users, E = embedding width, I = catalogue items, L' = new events, T = candidates
per user.

``extend`` and ``score`` check their inputs and call the pure steps
(``event_embeddings_step``, ``extend_step``, ``score_step``): functions of a
:class:`~tzrec_gr.stu.ServingCache` and plain tensors that check nothing, read nothing
on the host and change nothing, which ``torch.export`` records (the new events padded to the
model's bound, which changes no output).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence, Tuple

import torch
from torch.export import Dim

from tzrec_gr.features import UIH_ITEM_ID, UIH_LENGTHS, UIH_TIMESTAMPS
from tzrec_gr.models import HSTURetrieval
from tzrec_gr.models.inputs import (
    check_appended,
    check_batch,
    check_bound,
    check_int_tensor,
    check_item_ids,
)
from tzrec_gr.serving import transducer as cached
from tzrec_gr.serving._graphs import GraphPool, GraphSet, powers_of_two_up_to
from tzrec_gr.serving._predict import TOP_K
from tzrec_gr.serving._recommend_graphs import RecommendGraphs
from tzrec_gr.serving._rows import register_predict_kind
from tzrec_gr.serving.inputs import Histories
from tzrec_gr.serving.server import (
    Features,
    ModelServer,
    check_positive,
    example_new_lengths,
    register_server,
)
from tzrec_gr.stu import ServingCache
from tzrec_gr.stu.serving_cache import longest

__all__ = ["RetrievalServer"]


def _newest(last: torch.Tensor, new_lengths: torch.Tensor, users: torch.Tensor) -> torch.Tensor:
    """[B, E] each user's embedding after an extend: ``last`` (the row of its newest new
    event) where it got events, else its embedding before (``users``)."""
    return torch.where((new_lengths > 0).unsqueeze(1), last, users)


def _user_embeddings(cache: ServingCache) -> torch.Tensor:
    if cache.user_embeddings is None:
        raise ValueError("cache holds no user embeddings: it was not built by RetrievalServer")
    return cache.user_embeddings


class RetrievalServer(ModelServer):
    """Serves an :class:`~tzrec_gr.models.HSTURetrieval`: user embeddings kept current as
    events arrive, scored against candidates or the whole catalogue.

    Args:
        model (HSTURetrieval): the trained model, in eval mode when serving.

    Example::

        server = RetrievalServer(model.eval())
        cache = server.prefill(item_ids, lengths, timestamps)      # histories, once
        scores = server.score(cache, candidate_ids)                # [B, T] cosines
        new_rows, cache = server.extend(cache, new_ids, new_lengths, new_timestamps)

    :meth:`extend_step`, :meth:`event_embeddings_step` and :meth:`score_step` are the same
    steps as pure functions of the cache (a pytree) and the new tokens, which
    ``torch.export`` can record (the methods over a cache check their inputs and call them).

    Raises:
        TypeError: ``model`` is not an HSTURetrieval.
    """

    kind = "retrieval"
    model_class = HSTURetrieval
    call = "recommend"
    answers = "recommend(users, k)"
    request_size = "k"
    has_extend_step = True

    # -- the tensor API -------------------------------------------------------------------

    @torch.no_grad()
    def prefill(
        self,
        item_ids: torch.Tensor,
        lengths: torch.Tensor,
        timestamps: torch.Tensor,
        max_seq_len: Optional[int] = None,
    ) -> ServingCache:
        """Encode B users' histories once and cache every layer's keys and values.

        Arguments as in the model's ``forward``. ``cache.user_embeddings`` is
        ``model.user_embedding(item_ids, lengths, timestamps)``.

        Returns:
            ServingCache: for :meth:`extend` and :meth:`score` of this model.
        """
        model = self.model
        max_seq_len = check_bound("max_seq_len", max_seq_len, model.max_seq_len)
        self.check_cache(None)
        model.check_history(item_ids, lengths, timestamps, max_seq_len)
        return self._prefill(item_ids, lengths, timestamps, max_seq_len)

    @torch.no_grad()
    def extend(
        self,
        cache: ServingCache,
        item_ids: torch.Tensor,
        lengths: torch.Tensor,
        timestamps: torch.Tensor,
        update_cache: bool = True,
    ) -> Tuple[torch.Tensor, Optional[ServingCache]]:
        """Append ``lengths[b]`` new events to user b's cached history.

        Exact: the returned rows are the rows of the new events in the model's
        ``forward(history + events)`` and the new cache is ``prefill(history + events)``'s
        (up to rounding), because positions count forward and the layers are causal with a
        fixed attention divisor: no cached token depends on later ones.

        Args:
            cache (ServingCache): from :meth:`prefill` or :meth:`extend` of this model.
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
        model = self.model
        self.check_cache(cache)
        check_batch("lengths", lengths, cache.batch_size, "the cache")
        model.check_history(item_ids, lengths, timestamps, model.max_seq_len)
        check_appended("lengths", cache.lengths, lengths, 1, model.max_seq_len, "max_seq_len")
        events = (item_ids, lengths, timestamps, longest(lengths))
        if not update_cache:
            return self.event_embeddings_step(cache, *events), None
        out, new = self.extend_step(cache, *events)
        return out, dataclasses.replace(new, max_len=longest(new.lengths))

    def event_embeddings_step(
        self,
        cache: ServingCache,
        item_ids: torch.Tensor,
        new_lengths: torch.Tensor,
        timestamps: torch.Tensor,
        max_events: Optional[int] = None,
    ) -> torch.Tensor:
        """``extend(cache, ..., update_cache=False)[0]`` as a pure function, which
        ``torch.export`` can record (the cache a pytree argument): the user embedding after
        each new event, the cache unchanged. Nothing is checked or read on the host.

        Args:
            cache (ServingCache): the users' cache; its ``max_len`` (None: the model's
                ``max_cached_len``) bounds its lengths.
            item_ids, new_lengths, timestamps: the new events, as :meth:`extend`'s
                ``item_ids``, ``lengths`` and ``timestamps``.
            max_events (int | None): an upper bound on new events per user; each user's
                are padded to it (which changes no output). Default: ``max_seq_len``.

        Returns:
            torch.Tensor: [L', E].
        """
        model = self.model
        features = model.embed_features(item_ids, new_lengths, timestamps)
        max_new = model.max_seq_len if max_events is None else max_events
        out, _, _ = cached.cached_forward(
            model.transducer, features, cache, max_new, targets=False
        )
        return out

    def extend_step(
        self,
        cache: ServingCache,
        item_ids: torch.Tensor,
        new_lengths: torch.Tensor,
        timestamps: torch.Tensor,
        max_events: Optional[int] = None,
    ) -> Tuple[torch.Tensor, ServingCache]:
        """:meth:`extend` as a pure function, which ``torch.export`` can record: the cache
        goes in whole and the extended one comes back; nothing is checked, read on the host
        or changed in place.

        Args: as for :meth:`event_embeddings_step`; the cache must hold ``user_embeddings``.

        Returns:
            (rows [L', E] the user embedding after each new event, the extended cache, whose
            ``user_embeddings`` [B, E] are each user's newest and whose ``max_len`` bounds
            the new lengths).
        """
        model = self.model
        before = model.max_cached_len if cache.max_len is None else cache.max_len
        users = _user_embeddings(cache)
        features = model.embed_features(item_ids, new_lengths, timestamps)
        max_new = model.max_seq_len if max_events is None else max_events
        after = min(before + max_new, model.max_cached_len)
        out, _, new = cached.cached_forward(
            model.transducer,
            features,
            cache,
            max_new,
            targets=False,
            update_cache=True,
            max_cached_len=after,
        )
        if new is None:
            raise RuntimeError("the transducer returned no cache with update_cache=True")
        last = model.last_rows(out, new_lengths)
        return out, dataclasses.replace(new, user_embeddings=_newest(last, new_lengths, users))

    @torch.no_grad()
    def score(self, cache: ServingCache, candidate_ids: torch.Tensor) -> torch.Tensor:
        """Cosine similarity of each user's embedding with candidate items.

        Equals ``model.user_embedding(history) @ model.item_embedding(candidates)`` per user.

        Args:
            cache (ServingCache): from :meth:`prefill` or :meth:`extend` of this model.
            candidate_ids (torch.Tensor): [B, T] candidates per user, or [T] shared by all.

        Returns:
            torch.Tensor: [B, T] in ``[-1, 1]``.

        Raises:
            TypeError: ``candidate_ids`` is not a tensor.
            ValueError: not [B, T] or [T] integers, another B than the cache's, or an id
                outside the catalogue.
        """
        self.check_cache(cache)
        if isinstance(candidate_ids, torch.Tensor) and candidate_ids.dim() not in (1, 2):
            raise ValueError(
                "candidate_ids must be a [B, T] or [T] integer tensor, got shape "
                f"{tuple(candidate_ids.shape)}"
            )
        dims = candidate_ids.dim() if isinstance(candidate_ids, torch.Tensor) else 1
        check_int_tensor("candidate_ids", candidate_ids, dims)
        if candidate_ids.dim() == 2:
            check_batch("candidate_ids", candidate_ids, cache.batch_size, "the cache")
        check_item_ids(
            "candidate_ids", candidate_ids, self.model.num_items, self.model.validate_inputs
        )
        return self.score_step(cache, candidate_ids)

    def score_step(self, cache: ServingCache, candidate_ids: torch.Tensor) -> torch.Tensor:
        """:meth:`score` as a pure function (unchecked): [B, T] cosines of the cache's
        ``user_embeddings`` [B, E] with the candidates' item embeddings, ``candidate_ids``
        [B, T] or [T]."""
        user_embeddings = _user_embeddings(cache)
        items = self.model.item_embedding(candidate_ids).to(user_embeddings.dtype)
        if items.dim() == 2:
            return user_embeddings @ items.t()
        return torch.einsum("be,bte->bt", user_embeddings, items)

    @torch.no_grad()
    def catalogue(
        self, device: torch.device, chunk_size: int, out: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """[I, E] the model's normalized item embeddings, ``chunk_size`` items at a time.

        Args:
            device (torch.device): where to compute them.
            chunk_size (int): items embedded at a time.
            out (torch.Tensor | None): a catalogue to overwrite in place (a captured CUDA
                graph reads that tensor); None: a new one.
        """
        num_items = self.model.num_items
        rows = [
            self.model.item_embedding(
                torch.arange(s, min(s + chunk_size, num_items), device=device)
            )
            for s in range(0, num_items, chunk_size)
        ]
        table = torch.cat(rows)
        if out is None:
            return table
        return out.copy_(table)

    # -- export ---------------------------------------------------------------------------

    export_step = "event_embeddings_step"
    trace_forward = "event_embeddings"

    def example_inputs(
        self,
        batch: int = 4,
        history: Optional[int] = None,
        candidates: Optional[int] = None,
        seed: int = 0,
        device: Optional[torch.device] = None,
    ) -> Tuple[Any, ...]:
        """``(item_ids, lengths, timestamps)`` of the histories (``candidates`` ignored: the
        model scores the catalogue)."""
        _, lengths, ids, timestamps = self._example_histories(batch, history, seed)
        return tuple(t.to(device) for t in (ids, lengths, timestamps))

    def forward_shapes(
        self, args: Tuple[Any, ...], users: Any, history: Any, candidates: Any
    ) -> Any:
        return ({0: history}, {0: users}, {0: history})

    def check_step_sizes(self, history: int, new: int) -> None:
        if history + new > self.model.max_seq_len:
            raise ValueError(
                f"history + new ({history} + {new}) must be <= the model's max_seq_len "
                f"({self.model.max_seq_len})"
            )

    def step_example(
        self, args: Tuple[Any, ...], new: int, seed: int, users: Any, candidates: Any,
        max_batch: int,
    ) -> Tuple[ServingCache, Tuple[Any, ...], Tuple[Any, ...]]:
        """The cache of ``args``' histories, up to ``new`` appended events per user (after
        the newest event, a minute apart), and their dims (``candidates`` unused)."""
        ids, lengths, timestamps = args
        cache = self.prefill(ids, lengths, timestamps)
        gen = torch.Generator().manual_seed(seed + 1)
        new_lengths = example_new_lengths(lengths.shape[0], new, gen)
        total = int(new_lengths.sum())
        new_ids = torch.randint(0, self.model.num_items, (total,), generator=gen)
        new_ts = int(timestamps.max()) + torch.arange(1, total + 1) * 60
        request = tuple(t.to(ids.device) for t in (new_ids, new_lengths, new_ts))
        events = Dim("new_tokens", max=max(2, max_batch * new))
        return cache, request, ({0: events}, {0: users}, {0: events})

    @torch.no_grad()
    def item_table(self, chunk_size: int = 65536) -> Optional[torch.Tensor]:
        """[I, E] each item's ``model.item_embedding`` (the L2-normalized row of its table,
        in the model's dtype and with its quantized table when quantized): what
        :meth:`recommend <tzrec_gr.serving.ServingSession.recommend>` ranks against."""
        check_positive("chunk_size", chunk_size)
        return self.catalogue(next(self.model.parameters()).device, chunk_size)

    # -- the session's protocol -----------------------------------------------------------

    @property
    def max_events(self) -> int:
        return self.model.max_seq_len

    @property
    def extends_incrementally(self) -> bool:
        return True

    @property
    def user_embedding_width(self) -> int:
        """E: its caches keep each user's embedding (``user_embeddings`` [B, E])."""
        return self.model.embedding_dim

    @torch.no_grad()
    def encode(
        self,
        features: Features,
        contextual: Optional[torch.Tensor],
        query_time: Optional[torch.Tensor],
    ) -> ServingCache:
        # (no contextual features; the time anchor is each user's newest event)
        return self._prefill(
            features[UIH_ITEM_ID],
            features[UIH_LENGTHS],
            features[UIH_TIMESTAMPS],
            self.model.max_seq_len,
        )

    @torch.no_grad()
    def extend_histories(
        self, cache: ServingCache, events: Histories, device: torch.device
    ) -> ServingCache:
        f = self.history_features(events, device)
        new = self.extend_features(cache, f, longest(f[UIH_LENGTHS]))
        return dataclasses.replace(new, max_len=longest(new.lengths))

    @torch.no_grad()
    def extend_features(
        self,
        cache: ServingCache,
        features: Features,
        max_events: int,
        new_lengths: Optional[torch.Tensor] = None,
    ) -> ServingCache:
        """:meth:`extend_step`'s cache, the new events given as ``uih.*`` features on the
        device (the lengths' host copy known; at most ``max_events`` per user). Reads
        nothing on the host, so a CUDA graph can capture it (:mod:`._extend_graphs`).

        Args:
            new_lengths (torch.Tensor | None): [B] the real new events per user where
                ``features`` give every user the same number, padded at the end (a
                graph's buffers): each user embedding is the one after the newest real
                event. None: the features' lengths are the real ones.
        """
        lengths = features[UIH_LENGTHS]
        out, new = self.extend_step(
            cache, features[UIH_ITEM_ID], lengths, features[UIH_TIMESTAMPS], max_events
        )
        if new_lengths is None:
            return new
        users = lengths.shape[0]
        per_user = out.shape[0] // users if users else 0
        newest = (new_lengths - 1).clamp(min=0)
        rows = torch.arange(users, device=out.device) * per_user + newest
        last = out.index_select(0, rows)
        return dataclasses.replace(
            new, user_embeddings=_newest(last, new_lengths, _user_embeddings(cache))
        )

    def cuda_graphs(
        self,
        *,
        device: torch.device,
        pool: GraphPool,
        batch_buckets: Sequence[int],
        length_buckets: Optional[Sequence[int]],
        candidate_buckets: Optional[Sequence[int]],
        max_graphs: int,
        chunk_size: int,
        catalogue: Callable[[], torch.Tensor],
        strict: bool,
    ) -> Tuple[Optional[GraphSet], str]:
        model = self.model
        graphs = RecommendGraphs(
            catalogue,
            model.num_items,
            model.embedding_dim,
            self.dtype,
            device,
            pool,
            batch_buckets,
            length_buckets or powers_of_two_up_to(model.max_seq_len, 64),
            chunk_size,
            max_graphs,
        )
        return graphs, ""

    # -- internals ------------------------------------------------------------------------

    def _prefill(
        self,
        item_ids: torch.Tensor,
        lengths: torch.Tensor,
        timestamps: torch.Tensor,
        max_seq_len: int,
    ) -> ServingCache:
        model = self.model
        features = model.embed_features(item_ids, lengths, timestamps)
        out, cache = cached.prefill(model.transducer, features, max_seq_len)
        if out.full_embeddings is None:
            raise RuntimeError("the transducer must return full embeddings")
        users = model.last_rows(out.full_embeddings, lengths)
        return dataclasses.replace(cache, user_embeddings=users)


register_server("hstu-retrieval", RetrievalServer)  # the record tzrec_gr.models.retrieval registers
register_predict_kind(RetrievalServer.kind, TOP_K)
