""":class:`RankingServer`: the serving of an :class:`~tzrec_gr.models.HSTURanking`: prefill
histories, score candidates, append events.

Legend: B = users, L_t = candidate tokens, K = tasks.

``score`` and ``extend`` check their inputs, read the new tokens' longest length on the host
and call the pure steps ``score_step`` and ``extend_step``: functions of a
:class:`~tzrec_gr.stu.ServingCache` and plain tensors that check nothing, read nothing
on the host and change nothing, which ``torch.export`` records (the new tokens padded to the
model's bound, which changes no output).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
from torch.export import Dim

from tzrec_gr.features import (
    CANDIDATE_ITEM_ID,
    CANDIDATE_LENGTHS,
    CANDIDATE_TIMESTAMPS,
    CONTEXTUAL,
    QUERY_TIME,
    UIH_ACTIONS,
    UIH_ITEM_ID,
    UIH_LENGTHS,
    UIH_TIMESTAMPS,
)
from tzrec_gr.models import HSTURanking
from tzrec_gr.models.inputs import check_appended, check_batch, check_bound
from tzrec_gr.serving import transducer as cached
from tzrec_gr.serving._graphs import GraphPool, GraphSet, powers_of_two_up_to
from tzrec_gr.serving._predict import SCORES
from tzrec_gr.serving._rows import Limits, register_predict_kind
from tzrec_gr.serving._score_graphs import ScoreGraphs, windowed_layer
from tzrec_gr.serving.inputs import Histories
from tzrec_gr.serving.server import (
    Features,
    ModelServer,
    check_positive,
    example_new_lengths,
    register_server,
)
from tzrec_gr.stu import ServingCache
from tzrec_gr.stu.serving_cache import constant_lengths, longest

Batch = Dict[str, torch.Tensor]

__all__ = ["RankingServer"]

_CANDIDATE_KEYS = (CANDIDATE_ITEM_ID, CANDIDATE_LENGTHS, CANDIDATE_TIMESTAMPS)


class RankingServer(ModelServer):
    """Serves an :class:`~tzrec_gr.models.HSTURanking`: per-task logits of candidates
    against cached histories.

    Args:
        model (HSTURanking): the trained model, in eval mode when serving.

    Example::

        server = RankingServer(model.eval())
        cache = server.prefill(history, query_time)     # histories, once
        logits = server.score(cache, candidates)        # any number of candidate sets

    :meth:`score_step` and :meth:`extend_step` are the same steps as pure functions of the
    cache (a pytree) and the new tokens, which ``torch.export`` can record (:meth:`score`
    and :meth:`extend` check their inputs and call them).

    Raises:
        TypeError: ``model`` is not an HSTURanking.
    """

    kind = "ranking"
    model_class = HSTURanking
    call = "score"
    answers = "score(users, candidates)"
    request_size = "candidates"
    needs_actions = True
    keeps_query_time = True
    has_extend_step = True

    # -- the tensor API -------------------------------------------------------------------

    @torch.no_grad()
    def prefill(
        self,
        history: Batch,
        query_time: Optional[torch.Tensor] = None,
        max_uih_len: Optional[int] = None,
    ) -> ServingCache:
        """Encode B users' histories once and cache every layer's keys and values.

        Args:
            history (Dict[str, torch.Tensor]): the ``uih.*`` features of the model's
                ``forward`` (and ``contextual`` with C > 0); no candidates.
            query_time (torch.Tensor | None): [B] integer request time of each user, the
                anchor of every time gap (required with time encoding; candidates scored
                against this cache are measured from it too).
            max_uih_len (int | None): as in ``forward``.

        Returns:
            ServingCache: for :meth:`score` (and :meth:`extend`) of this model.
        """
        model = self.model
        max_uih_len = check_bound("max_uih_len", max_uih_len, model.max_uih_len)
        self.check_cache(None)
        users = model.check_history("history", history, max_uih_len, contextual=True)
        if model.use_time_encoding and query_time is None:
            raise ValueError(
                "query_time is required: the time gaps of the cached history and of the "
                "candidates scored against it are measured from it"
            )
        model.check_query_time("query_time", query_time, users)
        return self._prefill(history, query_time, max_uih_len)

    @torch.no_grad()
    def score(self, cache: ServingCache, candidates: Batch) -> torch.Tensor:
        """Logits of candidates against cached histories; the cache is unchanged.

        Exact: equals the model's ``forward(history + candidates)`` with ``query_time`` =
        the one given to :meth:`prefill` (up to rounding), because targets attend to the
        history and themselves only, and the divisor is fixed. Call it any number of times
        with the same cache.

        Args:
            cache (ServingCache): from :meth:`prefill` (or :meth:`extend`) of this model.
            candidates (Dict[str, torch.Tensor]): ``candidate.item_id`` [L_t],
                ``candidate.sequence_length`` [B] (at most ``max_targets`` each),
                ``candidate_timestamp.sequence`` [L_t].

        Returns:
            torch.Tensor: [L_t, K] logits, candidates in input order.
        """
        self.check_cache(cache)
        self.model.check_candidates(
            "candidates", candidates, self.model.max_targets, cache.batch_size
        )
        return self.score_step(cache, candidates, longest(candidates[CANDIDATE_LENGTHS]))

    def score_step(
        self,
        cache: ServingCache,
        candidates: Batch,
        max_candidates: Optional[int] = None,
    ) -> torch.Tensor:
        """:meth:`score` as a pure function, which ``torch.export`` can record (the cache a
        pytree argument): nothing is checked, nothing read on the host and nothing changed.

        Args:
            cache (ServingCache): the users' cache; its ``max_len`` (None: the model's
                ``max_cached_len``) bounds its lengths.
            candidates (Dict[str, torch.Tensor]): as for :meth:`score`.
            max_candidates (int | None): an upper bound on candidates per user; each user's
                are padded to it (which changes no output). Default: ``max_targets``.

        Returns:
            torch.Tensor: [L_t, K] logits, candidates in input order.
        """
        model = self.model
        like = candidates[CANDIDATE_LENGTHS]
        features, cand = model.embed_features(
            {**_no_history(cache.batch_size, like), **candidates}
        )
        max_new = model.max_targets if max_candidates is None else max_candidates
        user, _, _ = cached.cached_forward(
            model.transducer, features, cache, max_new, targets=True
        )
        return model.head(user, cand)

    @torch.no_grad()
    def extend(self, cache: ServingCache, events: Batch) -> ServingCache:
        """Append ``events['uih.sequence_length'][b]`` new events to user b's history.

        Runs only the new events against the cached keys and values; the result equals
        :meth:`prefill` of the longer history (up to rounding). That needs a model built
        with ``use_time_encoding=False`` and no contextual features; otherwise
        ``NotImplementedError``, and the longer history must be prefilled again, because
        the cached keys and values depend on the newest event:

        * time encoding adds to each history token's input a position counted back from the
          newest event (``min(n - p + C, Kp - 1)`` for token p of n) and a time bucket of
          its gap to the query time, which moves with the newest event. Δ new events shift
          every cached position by Δ and re-measure every gap, so every cached token's
          first-layer input changes, and so do its keys and values in every layer;
        * the C contextual tokens attend to the whole history, so their outputs, and their
          keys and values in the later layers, change with every new event.

        Args:
            cache (ServingCache): from :meth:`prefill` or :meth:`extend` of this model.
            events (Dict[str, torch.Tensor]): the new events as ``uih.*`` features; a
                user's cached and new events together stay within ``max_uih_len``.

        Returns:
            ServingCache: the extended cache (the given one is unchanged).
        """
        model = self.model
        self.check_cache(cache)
        self._check_extendable()
        model.check_history("events", events, model.max_uih_len, contextual=False)
        lengths = events[UIH_LENGTHS]
        check_batch(f"events[{UIH_LENGTHS!r}]", lengths, cache.batch_size, "the cache")
        check_appended(
            f"events[{UIH_LENGTHS!r}]",
            cache.lengths,
            lengths,
            self._tokens_per_event(),
            model.max_uih_len,
            "max_uih_len",
        )
        return self._extend(cache, events)

    def extend_step(
        self,
        cache: ServingCache,
        events: Batch,
        max_events: Optional[int] = None,
    ) -> ServingCache:
        """:meth:`extend` as a pure function, which ``torch.export`` can record: the cache
        goes in whole and the extended one comes back; nothing is checked, read on the host
        or changed in place.

        Args:
            cache (ServingCache): as for :meth:`score_step`.
            events (Dict[str, torch.Tensor]): as for :meth:`extend`.
            max_events (int | None): an upper bound on new events per user. Default:
                ``max_uih_len``.

        Returns:
            ServingCache: the extended cache; its ``max_len`` bounds the new lengths.

        Raises:
            NotImplementedError: the model encodes time or has contextual features.
        """
        model = self.model
        self._check_extendable()
        before = model.max_cached_len if cache.max_len is None else cache.max_len
        max_new = model.max_uih_len if max_events is None else max_events
        after = min(before + self._tokens_per_event() * max_new, model.max_cached_len)
        like = events[UIH_LENGTHS]
        features, _ = model.embed_features({**events, **_no_candidates(cache.batch_size, like)})
        _, _, new = cached.cached_forward(
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
        return new

    # -- export ---------------------------------------------------------------------------

    export_step = "score_step"
    trace_forward = "candidate_logits"

    @property
    def max_candidates(self) -> int:
        return self.model.max_targets

    def warm_up_length(self, events: int) -> int:
        """The tokens a user with ``events`` events keeps cached (its contextual prefix and
        each event's tokens)."""
        return self.model.transducer.input_preprocessor.max_output_len(events, 0)

    def example_inputs(
        self,
        batch: int = 4,
        history: Optional[int] = None,
        candidates: Optional[int] = None,
        seed: int = 0,
        device: Optional[torch.device] = None,
    ) -> Tuple[Any, ...]:
        """``(features,)``: the histories' and candidates' features (the candidates'
        lengths uniform in [1, candidates], the first user's ``candidates - 1``, shown after
        the newest event), with the contextual features where the model takes them."""
        model = self.model
        gen, lengths, ids, timestamps = self._example_histories(batch, history, seed)
        total = int(lengths.sum())
        candidates = model.max_targets if candidates is None else candidates
        check_positive("candidates", candidates)
        if candidates > model.max_targets:
            raise ValueError(
                f"candidates ({candidates}) must be <= the model's max_targets "
                f"({model.max_targets})"
            )
        targets = example_new_lengths(batch, candidates, gen)
        n = int(targets.sum())
        pre = model.transducer.input_preprocessor
        features = {
            UIH_ITEM_ID: ids,
            UIH_LENGTHS: lengths,
            UIH_ACTIONS: torch.randint(0, 256, (total,), generator=gen),
            UIH_TIMESTAMPS: timestamps,
            CANDIDATE_ITEM_ID: torch.randint(0, model.num_items, (n,), generator=gen),
            CANDIDATE_LENGTHS: targets,
            CANDIDATE_TIMESTAMPS: torch.full((n,), int(timestamps.max()) + 600),
        }
        width = pre.contextual_seq_len() * pre.contextual_feature_dim
        if width:
            features[CONTEXTUAL] = torch.randn(batch, width, generator=gen)
        return ({k: v.to(device) for k, v in features.items()},)

    def forward_shapes(
        self, args: Tuple[Any, ...], users: Any, history: Any, candidates: Any
    ) -> Any:
        (features,) = args
        shapes: Dict[str, Any] = {}
        for key in features:
            if key in (UIH_LENGTHS, CANDIDATE_LENGTHS, QUERY_TIME):
                shapes[key] = {0: users}
            elif key == CONTEXTUAL:
                shapes[key] = {0: users, 1: Dim.STATIC}
            elif key in _CANDIDATE_KEYS:
                shapes[key] = {0: candidates}
            else:
                shapes[key] = {0: history}
        return (shapes,)

    def step_example(
        self, args: Tuple[Any, ...], new: int, seed: int, users: Any, candidates: Any,
        max_batch: int,
    ) -> Tuple[ServingCache, Tuple[Any, ...], Tuple[Any, ...]]:
        """The cache of ``args``' histories (queried at the newest candidate time), the
        candidates, and the dims of the cache's query time and contextual features and of
        the candidates."""
        (features,) = args
        history_keys = (UIH_ITEM_ID, UIH_LENGTHS, UIH_ACTIONS, UIH_TIMESTAMPS, CONTEXTUAL)
        history = {k: v for k, v in features.items() if k in history_keys}
        batch = features[UIH_LENGTHS].shape[0]
        query_time = features[CANDIDATE_TIMESTAMPS].max().repeat(batch)
        cache = self.prefill(history, query_time)
        request = {k: features[k] for k in _CANDIDATE_KEYS}
        shapes = (
            None if cache.query_time is None else {0: users},
            None if cache.contextual is None else {0: users, 1: Dim.STATIC},
            {k: {0: users} if k == CANDIDATE_LENGTHS else {0: candidates} for k in request},
        )
        return cache, (request,), shapes

    def package_fields(self) -> Dict[str, int]:
        return dict(
            max_events=int(self.model.max_uih_len),
            max_candidates=int(self.model.max_targets),
            contextual_width=int(self.contextual_width),
            num_tasks=int(self.model.num_tasks),
        )

    # -- the session's protocol -----------------------------------------------------------

    @property
    def max_events(self) -> int:
        return self.model.max_uih_len

    def predict_limits(self, tasks: Optional[Sequence[str]] = None) -> Limits:
        """The :class:`~tzrec_gr.serving.files.Limits` of predictions from files: the
        candidates and contextual features a row may hold, and an output column per task.

        Args:
            tasks: a name per task for the output columns. Default: ``task_0``,
                ``task_1``, ...

        Raises:
            ValueError: ``tasks`` has another number of names than the model has tasks.
        """
        model = self.model
        width = self.contextual_width
        default = tuple(f"task_{i}" for i in range(model.num_tasks))
        names = tuple(tasks) if tasks is not None else default
        if len(names) != model.num_tasks:
            raise ValueError(
                f"tasks has {len(names)} names but the model has {model.num_tasks} tasks"
            )
        return Limits(self.kind, model.num_items, self.max_events, model.max_targets, width, names)

    @property
    def contextual_width(self) -> int:
        if self.model.contextual_seq_len == 0:
            return 0
        pre = self.model.transducer.input_preprocessor
        return pre.contextual_seq_len() * pre.contextual_feature_dim

    @property
    def extends_incrementally(self) -> bool:
        return not self.model.use_time_encoding and self.model.contextual_seq_len == 0

    @property
    def user_embedding_width(self) -> int:
        """0: its caches keep no user embeddings."""
        return 0

    def history_features(self, histories: Histories, device: torch.device) -> Features:
        out = super().history_features(histories, device)
        if histories.actions is not None:
            out[UIH_ACTIONS] = histories.actions.to(device)
        return out

    @torch.no_grad()
    def encode(
        self,
        features: Batch,
        contextual: Optional[torch.Tensor],
        query_time: Optional[torch.Tensor],
    ) -> ServingCache:
        if self.model.contextual_seq_len > 0 and contextual is not None:
            features = {**features, CONTEXTUAL: contextual.to(self.dtype)}
        return self._prefill(features, query_time, self.model.max_uih_len)

    @torch.no_grad()
    def extend_histories(
        self, cache: ServingCache, events: Histories, device: torch.device
    ) -> ServingCache:
        return self._extend(cache, self.history_features(events, device))

    @torch.no_grad()
    def extend_features(
        self,
        cache: ServingCache,
        features: Batch,
        max_events: int,
        new_lengths: Optional[torch.Tensor] = None,
    ) -> ServingCache:
        """:meth:`extend_step` of new events given as ``uih.*`` features on the device (the
        lengths' host copy known; at most ``max_events`` per user). Reads nothing on the
        host, so a CUDA graph can capture it (:mod:`._extend_graphs`). ``new_lengths``
        (the real counts where the features pad every user's to one number) changes
        nothing here: the cache keeps no per-user output."""
        return self.extend_step(cache, features, max_events)

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
        windowed = windowed_layer(model)
        if windowed is not None:  # the padded cache would move the window
            if strict:
                raise ValueError(
                    f"cuda_graphs='on' needs STU layers without max_attn_len; layer "
                    f"{windowed} has one"
                )
            return None, f"STU layer {windowed} has max_attn_len (a sliding window)"
        graphs = ScoreGraphs(
            self,
            device,
            pool,
            batch_buckets,
            length_buckets or powers_of_two_up_to(model.max_cached_len, 64),
            candidate_buckets or powers_of_two_up_to(model.max_targets),
            max_graphs,
        )
        return graphs, ""

    # -- internals ------------------------------------------------------------------------

    def _prefill(
        self, history: Batch, query_time: Optional[torch.Tensor], max_uih_len: int
    ) -> ServingCache:
        users = history[UIH_LENGTHS].shape[0]
        lengths = history[UIH_LENGTHS]
        features, _ = self.model.embed_features({**history, **_no_candidates(users, lengths)})
        _, cache = cached.prefill(
            self.model.transducer, features, max_uih_len, query_time=query_time
        )
        return cache

    def _extend(self, cache: ServingCache, events: Batch) -> ServingCache:
        new = self.extend_features(cache, events, longest(events[UIH_LENGTHS]))
        return dataclasses.replace(new, max_len=longest(new.lengths))

    def _tokens_per_event(self) -> int:
        return 2 if self.model.transducer.input_preprocessor.enable_interleaving else 1

    def _check_extendable(self) -> None:
        if self.model.use_time_encoding or self.model.contextual_seq_len > 0:
            why = (
                "with time encoding, every cached token's position (counted back from the "
                "newest event) and time gap (to the query time) change"
                if self.model.use_time_encoding
                else "the contextual tokens attend to the whole history, so their keys and "
                "values change"
            )
            raise NotImplementedError(
                "RankingServer.extend needs use_time_encoding=False and no contextual "
                f"features: {why} when history grows; prefill the longer history instead"
            )


def _empty(keys: Sequence[str], users: int, like: torch.Tensor) -> Batch:
    """No history or no candidates: ``keys`` (ids, lengths, timestamps[, actions])."""
    empty = torch.zeros(0, dtype=torch.int64, device=like.device)
    lengths = constant_lengths(0, users, like.device)
    return {k: lengths if k.endswith("sequence_length") else empty for k in keys}


def _no_candidates(users: int, like: torch.Tensor) -> Batch:
    return _empty((CANDIDATE_ITEM_ID, CANDIDATE_LENGTHS, CANDIDATE_TIMESTAMPS), users, like)


def _no_history(users: int, like: torch.Tensor) -> Batch:
    return _empty((UIH_ITEM_ID, UIH_LENGTHS, UIH_ACTIONS, UIH_TIMESTAMPS), users, like)


register_server("hstu-ranking", RankingServer)  # the record tzrec_gr.models.ranking registers
register_predict_kind(RankingServer.kind, SCORES)
