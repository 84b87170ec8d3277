"""One serving API over both models: top-K recommendations, candidate scores, per-user state.

Legend: B = users, K = items returned (``recommend``) or tasks (``score``), T = candidates
per user, L_t = candidates of all users.

:class:`ServingSession` wraps a trained :class:`~tzrec_gr.models.HSTURetrieval` or
:class:`~tzrec_gr.models.HSTURanking` (or a tzrec-bench checkpoint,
:meth:`ServingSession.from_checkpoint`) and answers, in eval mode and without gradients:

* ``recommend(users, k)`` (retrieval): the top-K items of the whole catalogue per user
  (:func:`~tzrec_gr.serving.topk.catalogue_topk`), the items the user has seen excluded;
* ``score(users, candidates)`` (ranking): per-task probabilities of each candidate;

for ``users`` given either as :class:`~tzrec_gr.serving.inputs.Histories` (encoded now, kept
by no one) or as ids of users opened before with ``open(user_ids, histories)``, whose
encoded histories (:class:`~tzrec_gr.serving.ServingCache` rows) the session keeps and
``extend(user_ids, events)`` appends to (at once where only the new events need to run;
with time encoding, whose kept keys and values depend on the newest event, the history is
encoded again at the user's next request). Every input is checked on the host (naming the
argument and the user's row) before a kernel runs.

On a CUDA device two calls replay CUDA graphs, one per padded bucket of request shapes:
the ranking ``score`` (the model's ``score_step``; buckets of users, cached tokens and
candidates, :mod:`~tzrec_gr.serving._score_graphs`) and the retrieval ``recommend`` of
opened users (the top-K scan of their stored embeddings; buckets of users, k and seen
items, :mod:`~tzrec_gr.serving._recommend_graphs`). So does encoding whole histories, for
both models (``open``, users encoded again after ``extend``, :class:`Histories` given to
a call; buckets of users and events in all, :mod:`~tzrec_gr.serving._encode_graphs`), and
the incremental ``extend`` (buckets of users, cached tokens and new events,
:mod:`~tzrec_gr.serving._extend_graphs`). A bucket's graph is captured by
:meth:`ServingSession.warm_up` before any request, or else by the first request in it;
requests outside every bucket run eager. ``graph_stats()`` reports the captures, their
time and memory, and the replays.

The session's parts live beside it: the model's server (:class:`~.ranking.RankingServer` or
:class:`~.retrieval.RetrievalServer`, whose common protocol, :class:`~.server.ModelServer`,
checks and encodes a request's histories), the opened users' state (:mod:`._users`), the
graphs (:mod:`._session_graphs`, :mod:`._graphs` and the four above); checkpoints are read
by :mod:`tzrec_gr.checkpoint`. This file stays past 600 lines as the one public class of
serving: most of its length is the docstrings of the calls users make.
"""

from __future__ import annotations

import pathlib
import time
from typing import Any, Dict, Hashable, List, Optional, Sequence, Tuple, Type, Union, cast

import torch
from torch import nn

from tzrec_gr.checkpoint import load_model
from tzrec_gr.features import CANDIDATE_ITEM_ID, CANDIDATE_LENGTHS, CANDIDATE_TIMESTAMPS
from tzrec_gr.serving._graphs import GraphPool, check_buckets, fit
from tzrec_gr.serving._host import lengths_of
from tzrec_gr.serving._recommend_graphs import RecommendGraphs
from tzrec_gr.serving._score_graphs import ScoreGraphs
from tzrec_gr.serving._session_graphs import Graphs, build_graphs, graph_stats, warm_up_graphs
from tzrec_gr.serving._users import (
    UserIds,
    UserState,
    UserStore,
    longer_histories,
    user_list,
)
from tzrec_gr.serving._warm_up import encoding_sizes, warm_up_encoding
from tzrec_gr.serving.inputs import Candidates, Histories
from tzrec_gr.serving.ranking import RankingServer
from tzrec_gr.serving.retrieval import RetrievalServer
from tzrec_gr.serving.server import ModelServer, server_for
from tzrec_gr.serving.topk import TopK, catalogue_topk
from tzrec_gr.stu import ServingCache
from tzrec_gr.stu.serving_cache import longest
from tzrec_gr.vocabulary import IdVocabularies
from tzrec_ops.jagged import offsets_from_lengths, to_device

__all__ = ["ServingSession", "server_for"]


CandidatesArg = Union[Candidates, torch.Tensor, Sequence[Sequence[int]]]


class ServingSession:
    """Serve a trained model: ``recommend`` (retrieval), ``score`` (ranking), per-user state.

    Args:
        model (HSTURetrieval | HSTURanking): the trained model; the session moves it to
            ``device`` and sets eval mode (it serves in the model's dtype).
        device (torch.device | str | None): where to serve. Default: the model's.
        cuda_graphs (str): ``"auto"`` (graphs on a CUDA device, eager elsewhere), ``"on"``
            (a CUDA device required; a step that cannot be captured raises) or ``"off"``.
            The ranking ``score``, the retrieval ``recommend`` of opened users, the
            whole-history encode and the incremental ``extend`` are captured. Default:
            ``"auto"``.
        batch_buckets (Sequence[int]): the users per graph bucket (``recommend`` uses the
            powers of two up to the largest). Default: 1, 2, 4, ..., 64.
        length_buckets (Sequence[int] | None): per user per bucket, ranking: cached tokens
            (default: powers of two from 64 up to the model's ``max_cached_len``);
            retrieval: seen items (default: powers of two from 64 up to ``max_seq_len``);
            the incremental ``extend``: cached tokens before it (the same defaults).
        candidate_buckets (Sequence[int] | None): candidates per user per bucket (ranking).
            Default: powers of two up to the model's ``max_targets``.
        event_buckets (Sequence[int] | None): events of all users of a whole-history
            encode per bucket. Default: powers of two from 64 up to the largest batch
            bucket times the model's ``max_events``.
        extend_buckets (Sequence[int] | None): new events per user of an incremental
            ``extend`` per bucket. Default: powers of two up to 16 (at most the model's
            ``max_events``).
        encode_graphs (bool): capture the whole-history encode too (with ``cuda_graphs``
            not ``"off"``). Default: True.
        max_graphs (int): the most graphs captured per call (``score`` or ``recommend``,
            the encode and the extend); later buckets run eager. Default: 32.
        chunk_size (int): catalogue items scored at a time by ``recommend``. Default: 65536.
        vocabularies (IdVocabularies | None): the raw ids of the model's items (and of the
            training data's users), which :meth:`from_checkpoint` reads from the checkpoint;
            None: the session knows model ids only. Default: None.

    Attributes:
        model (HSTURetrieval | HSTURanking): the model, on ``device``, in eval mode.
        server (RetrievalServer | RankingServer): its server (:func:`server_for`).
        vocabularies (IdVocabularies | None): as given (None: no raw ids known).

    Ids: every call takes and returns the model's item ids (rows ``0..num_items-1``), the
    fast path of tensors. Raw ids go through the vocabulary at the door:
    ``Histories.from_raw(session.vocabularies, ...)``, ``Candidates.from_raw(...)`` and
    ``top.raw_ids(session.vocabularies)``.

    Raises:
        TypeError: ``model`` is not one of the two models.
        ValueError: a bad option (named), or a vocabulary of another size than the
            catalogue.

    Example::

        session = ServingSession(model)                      # or .from_checkpoint("best.pt")
        top = session.recommend(Histories.from_lists([[3, 5, 8], [1]]), k=10)
        top.ids, top.scores                                  # [2, 10] each
        session.open(["ann", "bob"], histories)              # keep their encoded histories
        session.extend(["ann"], Histories.from_lists([[9]], [[12]]))
        session.recommend(["ann", "bob"], k=10)
        session.warm_up(batch_sizes=[16], k=[10])            # CUDA graphs before requests
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        device: Optional[Union[torch.device, str]] = None,
        cuda_graphs: str = "auto",
        batch_buckets: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
        length_buckets: Optional[Sequence[int]] = None,
        candidate_buckets: Optional[Sequence[int]] = None,
        event_buckets: Optional[Sequence[int]] = None,
        extend_buckets: Optional[Sequence[int]] = None,
        encode_graphs: bool = True,
        max_graphs: int = 32,
        chunk_size: int = 65536,
        vocabularies: Optional[IdVocabularies] = None,
    ) -> None:
        server = server_for(model)  # a TypeError for any other model, before anything moves
        if cuda_graphs not in ("auto", "on", "off"):
            raise ValueError(f"cuda_graphs must be 'auto', 'on' or 'off', got {cuda_graphs!r}")
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
        if device is None:
            device = next(model.parameters()).device
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()  # in place: the server's model
        self.server = server
        self.chunk_size = chunk_size
        if vocabularies is not None and not isinstance(vocabularies, IdVocabularies):
            raise TypeError(
                f"vocabularies must be an IdVocabularies or None, got {type(vocabularies).__name__}"
            )
        if vocabularies is not None:
            vocabularies.check_catalogue(
                int(getattr(model, "num_items", len(vocabularies.items))), "vocabularies"
            )
        self.vocabularies = vocabularies
        self._users = UserStore(self.device)
        self._catalogue: Optional[torch.Tensor] = None
        self._pool = GraphPool()
        self._strict_graphs = cuda_graphs == "on"
        self._warm_up: Optional[Dict[str, Any]] = None
        graphs = build_graphs(
            server,
            self.device,
            self._pool,
            cuda_graphs=cuda_graphs,
            batch_buckets=batch_buckets,
            length_buckets=length_buckets,
            candidate_buckets=candidate_buckets,
            event_buckets=event_buckets,
            extend_buckets=extend_buckets,
            encode_graphs=encode_graphs,
            max_graphs=max_graphs,
            chunk_size=chunk_size,
            catalogue=self._items,
        )
        self._graphs, self._encode_graphs = graphs.step, graphs.encode
        self._extend_graphs, self._no_graphs = graphs.extend, graphs.no_graphs
        self._batch_buckets = tuple(sorted(batch_buckets))

    @property
    def batch_buckets(self) -> Tuple[int, ...]:
        """The users per graph bucket, ascending (a batch runs in the smallest that holds it;
        larger batches run eager)."""
        return self._batch_buckets

    @property
    def kind(self) -> str:
        """``"retrieval"`` or ``"ranking"``: the server's label (for messages and files)."""
        return self.server.kind

    @classmethod
    def from_checkpoint(
        cls,
        path: Union[str, pathlib.Path],
        *,
        device: Optional[Union[torch.device, str]] = None,
        backend: Optional[str] = None,
        **kwargs: Any,
    ) -> ServingSession:
        """A session over the model of a tzrec-bench checkpoint (``best.pt``), with the
        checkpoint's id vocabularies (:attr:`vocabularies`; None for a checkpoint without
        them).

        Args:
            path: a checkpoint file or a run's folder (its ``best.pt``, else
                ``checkpoint.pt``), in the format of :mod:`tzrec_gr.checkpoint`.
            device: where to serve. Default: the CPU.
            backend: the ops backend to build the model with. Default: the saved one.
            **kwargs: the constructor's other options (``cuda_graphs``...).

        Raises:
            FileNotFoundError: no file at ``path``.
            ValueError: the file is not such a checkpoint, or its state dict does not fit
                (a :class:`~tzrec_gr.checkpoint.CheckpointError`).
        """
        model, vocabularies = load_model(path, backend)
        return cls(model, device=device or "cpu", vocabularies=vocabularies, **kwargs)

    # -- public API -----------------------------------------------------------------------

    @torch.no_grad()
    def recommend(
        self, users: Union[Histories, UserIds], k: int = 10, *, exclude_seen: bool = True
    ) -> TopK:
        """The top-``k`` items of the catalogue for each user (retrieval models).

        Args:
            users: :class:`Histories` to encode now, or ids of opened users.
            k (int): items per user, in ``[1, num_items]``.
            exclude_seen (bool): never return an item of the user's history. Default: True.

        Returns:
            TopK: ``ids`` [B, k] and ``scores`` [B, k] (cosines), best first, ties by
            smaller id; ``-1`` / ``-inf`` fill the slots of a user with fewer than ``k``
            unseen items.

        On CUDA, opened users' calls replay a CUDA graph of the scan when the request fits
        a bucket (same ids and scores as eager); :class:`Histories` (encoded now) run
        eager.

        Raises:
            TypeError: the model is a ranking model.
            ValueError: a bad history (named, with the user's row) or an unknown user id.
        """
        self._require(RetrievalServer, "recommend")
        if isinstance(users, Histories):
            self._check(users)
            cache = self._prefill(users)
            embeddings = cache.user_embeddings
            seen = (users.item_ids, users.offsets)
        else:
            states = self._encoded(users, self._users.states("users", users))
            embeddings = torch.stack([s.user_embedding for s in states])  # type: ignore[misc]
            seen_ids = [s.item_ids for s in states]
            top = self._recommend_graph(embeddings, seen_ids if exclude_seen else None, k)
            if top is not None:
                return top
            lengths = torch.tensor([t.numel() for t in seen_ids], dtype=torch.int64)
            seen = (torch.cat(seen_ids), offsets_from_lengths(lengths))
        assert embeddings is not None
        return catalogue_topk(
            embeddings,
            self._items(),
            k,
            exclude=seen if exclude_seen else None,
            chunk_size=self.chunk_size,
        )

    @torch.no_grad()
    def score(self, users: Union[Histories, UserIds], candidates: CandidatesArg) -> torch.Tensor:
        """Per-task probabilities of each user's candidates (ranking models).

        Equal (up to rounding) to ``sigmoid(model(history + candidates))`` with the
        history's ``query_time``.

        Args:
            users: :class:`Histories` to encode now, or ids of opened users.
            candidates: :class:`Candidates`, a [B, T] integer tensor, or one id list per
                user (at most the model's ``max_targets`` each). Without timestamps the
                candidates are shown at their user's query time.

        Returns:
            torch.Tensor: float32 [L_t, K] in input order, or [B, T, K] for a [B, T] tensor.

        Raises:
            TypeError: the model is a retrieval model.
            ValueError: a bad history or candidate (named, with the user's row), a
                different number of users in the two, or an unknown user id.
        """
        self._require(RankingServer, "score")
        model = self.model
        dense = isinstance(candidates, torch.Tensor)
        if isinstance(candidates, Candidates):
            cands = candidates
        elif dense:
            cands = Candidates.from_dense(candidates)  # type: ignore[arg-type]
        else:
            cands = Candidates.from_lists(candidates)  # type: ignore[arg-type]
        if isinstance(users, Histories):
            self._check(users)
            cache = self._prefill(users)
            query_time = users.query_times()
        else:
            states = self._encoded(users, self._users.states("users", users))
            cache = self._assemble(users, states)  # type: ignore[arg-type]
            query_time = torch.tensor([s.request_time for s in states], dtype=torch.int64)
        if cands.batch_size != cache.batch_size:
            raise ValueError(
                f"candidates are for {cands.batch_size} users but users has "
                f"{cache.batch_size}; they must match"
            )
        cands.check(model.num_items, model.max_targets)
        lengths = cands.lengths.cpu().to(torch.int64)
        timestamps = cands.timestamps
        if timestamps is None:
            timestamps = query_time.repeat_interleave(lengths)
        logits = self._score_cache(cache, cands.item_ids, lengths, timestamps, query_time)
        probs = torch.sigmoid(logits.float())
        if dense:
            return probs.reshape(cands.batch_size, -1, probs.shape[-1])
        return probs

    def open(self, user_ids: UserIds, histories: Histories) -> None:
        """Encode ``histories`` and keep them for these users (replacing a user's own).

        Args:
            user_ids: B distinct hashable ids (or a 1-D integer tensor).
            histories (Histories): the users' histories, one each, none empty.
        """
        ids = user_list("user_ids", user_ids)
        if len(ids) != histories.batch_size:
            raise ValueError(
                f"user_ids has {len(ids)} users but histories has {histories.batch_size}; "
                "they must match"
            )
        self._check(histories)
        with torch.no_grad():
            cache = self._prefill(histories)
        self._store(ids, histories, cache)

    def extend(self, user_ids: UserIds, events: Histories) -> None:
        """Append new events to opened users' histories.

        Exact: later answers are what ``open`` of the longer histories gives (up to
        rounding). A retrieval model, or a ranking model without time encoding and
        contextual features, runs only the new events against the kept keys and values,
        at once (on CUDA, replayed in a CUDA graph when the call fits a bucket of users,
        cached tokens and new events per user; eager otherwise). Otherwise the kept keys
        and values depend on the newest event (see
        :meth:`RankingServer.extend <tzrec_gr.serving.RankingServer.extend>`) and the
        history must be encoded whole: the session keeps the events and encodes the
        history at the user's next ``score`` or ``recommend``, once however many extends
        came before, in one batch with the other users of that call that need it. So it
        does when a history outgrows the model's bound (keeping its newest events), for
        every user of that call. A user that gets no events (nor a new query time) keeps
        its encoded rows. The events are checked here, on the host, in every case.

        Args:
            user_ids: opened users, distinct.
            events (Histories): their new events (a user may get none), not older than
                their newest so far; ``query_time`` (ranking) replaces the users' query
                time (default: the newest event's time).
        """
        ids = user_list("user_ids", user_ids)
        states = self._users.states("user_ids", ids)
        if len(ids) != events.batch_size:
            raise ValueError(
                f"user_ids has {len(ids)} users but events has {events.batch_size}; they must match"
            )
        self._check(
            events,
            allow_empty=True,
            contextual=False,
            after=[int(s.timestamps[-1]) if s.timestamps.numel() else None for s in states],
        )
        server = self.server
        bound = server.max_events
        history = longer_histories(
            states,
            events,
            bound,
            actions=server.needs_actions,
            query_time=server.keeps_query_time,
        )
        lengths = lengths_of(events.offsets.tolist())
        fits = all(s.item_ids.numel() + n <= bound for s, n in zip(states, lengths))
        if fits and server.extends_incrementally and not any(s.stale for s in states):
            with torch.no_grad():
                cache = self._extend(self._assemble(ids, states), events)
            self._store(ids, history, cache)
            return
        self._users.defer(ids, history, lengths, server.request_times(history))

    def close(self, user_ids: UserIds) -> None:
        """Forget these users (unknown ids are ignored)."""
        self._users.forget(user_list("user_ids", user_ids))

    def __contains__(self, user_id: Hashable) -> bool:
        return user_id in self._users

    def __len__(self) -> int:
        return len(self._users)

    @property
    def user_ids(self) -> List[Hashable]:
        """The opened users, in the order they were opened."""
        return list(self._users.users)

    def refresh(self) -> None:
        """Recompute what the session derived from the weights (the normalized catalogue,
        in place: captured graphs read it); call it after changing the model's weights,
        and ``open`` the users again."""
        if self._catalogue is not None:
            self._retrieval().catalogue(self.device, self.chunk_size, out=self._catalogue)
        self._users.forget_batch()

    def warm_up(
        self,
        *,
        batch_sizes: Optional[Sequence[int]] = None,
        lengths: Optional[Sequence[int]] = None,
        candidates: Optional[Sequence[int]] = None,
        k: Optional[Sequence[int]] = None,
        exclude_seen: bool = True,
        histories: Sequence[int] = (),
        events: Sequence[int] = (),
    ) -> Dict[str, Any]:
        """Capture the CUDA graphs of the buckets these request sizes fall in, before any
        request, from synthetic inputs (built from the model's sizes; no user needed), and
        run the calls that stay eager once per given shape.

        Without it a bucket's graph is captured inside the first request that needs it
        (seconds with Triton autotuning). Buckets are captured in order (batch slowest,
        smallest first) while ``max_graphs`` leaves room; the rest are reported as
        ``skipped``. Without CUDA graphs (a CPU device, ``cuda_graphs="off"``, a ranking
        model with a sliding attention window) nothing is captured: the report says why.

        Encoding whole histories (``open``, extended users encoded again) is captured
        too, per bucket of users and events in all: ``histories`` captures the buckets
        of each of ``batch_sizes`` users of each of ``histories`` events (reported under
        ``encode_graphs``, in the same form). So is the incremental ``extend`` (models
        that extend incrementally), per bucket of users, cached tokens and new events per
        user: ``histories`` and ``events`` capture the buckets of each of ``batch_sizes``
        users of each of ``histories`` events extended by each of ``events`` (within
        ``max_events``; reported under ``extend_graphs``). Encodes and extends outside
        those buckets run eager, their kernels tuned at the first call of each shape:
        ``histories`` and ``events`` run every one of those calls once before any
        request, at the batch bucket of each of ``batch_sizes``
        (:mod:`~tzrec_gr.serving._warm_up`; through the graphs where captured).

        Args:
            batch_sizes (Sequence[int] | None): users per request. Default: every
                ``batch_buckets`` value.
            lengths (Sequence[int] | None): ranking: cached tokens per user (as
                ``length_buckets``); retrieval: seen items per user. Default: every
                ``length_buckets`` value.
            candidates (Sequence[int] | None): candidates per user (ranking only). Default:
                every ``candidate_buckets`` value.
            k (Sequence[int] | None): items per user of ``recommend`` (retrieval only).
                Default: (10,), ``recommend``'s default.
            exclude_seen (bool): the ``recommend`` calls exclude seen items (retrieval
                only). Default: True.
            histories (Sequence[int]): events per user of whole histories to encode, in
                ``[1, max_events]``. Default: none.
            events (Sequence[int]): new events per user of an incremental ``extend`` to
                capture and run after each of those (models that extend incrementally).
                Default: none.

        Returns:
            Dict[str, Any]: ``captured``, ``present`` (captured before), ``skipped`` (no
            room), ``failed`` (bucket -> error), ``capture_ms``, ``memory_bytes`` (static
            inputs and pool memory of the captures made now), ``encoded`` and ``extended``
            (the eager shapes run), ``encode_seconds``, ``seconds`` (wall time) and
            ``reason`` (why nothing could be captured, else None), ``encode_graphs`` and
            ``extend_graphs`` (the encode's and the extend's captures: ``captured``... as
            above). ``graph_stats()`` keeps it as ``warm_up``.

        Raises:
            ValueError: a size is not an int >= 1 or falls in no bucket (named), or an
                option of the other model kind is given.
        """
        started = time.perf_counter()
        sizes = {"batch_sizes": batch_sizes, "lengths": lengths, "candidates": candidates, "k": k}
        for name, values in sizes.items():
            check_buckets(name, values)
        for server in (RetrievalServer, RankingServer):
            name = server.request_size
            if name != self.server.request_size and sizes[name] is not None:
                raise ValueError(
                    f"{name} is for {server.call} ({server.kind}); this session serves {self.kind}"
                )
        encoding_sizes(self.server, histories, events)
        buckets = self._batch_buckets
        users = [fit(b, buckets) or b for b in batch_sizes or buckets]
        report = warm_up_graphs(
            self._graph_sets(),
            sizes,
            exclude_seen,
            {"batch_sizes": users, "histories": histories, "events": events},
        )
        report.update(
            warm_up_encoding(
                self.server,
                self.device,
                users,
                list(histories),
                list(events),
                self._prefill,
                self._extend,
            )
        )
        report["seconds"] = time.perf_counter() - started
        self._warm_up = report
        return report

    def graph_stats(self) -> Dict[str, Any]:
        """The CUDA graphs so far: ``enabled``, ``step`` (``"score"``, ``"recommend"`` or
        None), ``captures``, ``replays``, ``eager_calls`` (calls outside every bucket),
        ``capture_ms`` and ``memory_bytes`` (totals over the graphs), ``graphs`` (per
        bucket: ``bucket``, ``capture_ms``, ``memory_bytes`` = static inputs plus the pool
        memory the capture reserved, ``replays``, ``warm_up`` = captured by
        :meth:`warm_up`), ``failed`` (buckets whose capture failed, with the error),
        ``encode`` and ``extend`` (the same for the whole-history encode's and the
        incremental extend's graphs, each with its own ``enabled``) and ``warm_up`` (the
        last :meth:`warm_up`'s report, or None)."""
        return graph_stats(self._graph_sets(), self._warm_up)

    def graph_counts(self) -> Tuple[int, int]:
        """(captures, eager calls) so far, over the step's, the encode's and the extend's
        graphs: the two counters of :meth:`graph_stats` that grow when a request meets a
        shape ``warm_up`` did not cover, read without building the report (cheap enough to
        call around every request)."""
        sets = self._graph_sets().sets()
        return sum(g.captures for g in sets), sum(g.eager_calls for g in sets)

    # -- internals ------------------------------------------------------------------------

    def _require(self, server: Type[ModelServer], call: str) -> None:
        """TypeError unless this session's server answers ``call`` (``server``'s)."""
        if self.server.call != call:
            raise TypeError(
                f"{call} needs an {server.model_name} model; this session serves an "
                f"{type(self.model).__name__}, which answers {self.server.answers}"
            )

    def _retrieval(self) -> RetrievalServer:
        """The server, which answers ``recommend`` (its caller checked: :meth:`_require`)."""
        return cast(RetrievalServer, self.server)

    def _check(self, histories: Histories, **kwargs: Any) -> None:
        self.server.check_histories(histories, **kwargs)

    def _prefill(self, h: Histories) -> ServingCache:
        """Encode checked whole histories: replayed in a CUDA graph when they fit a
        bucket, else eager."""
        graphs = self._encode_graphs
        cache = None if graphs is None else graphs.encode_request(h, self._strict_graphs)
        return cache if cache is not None else self.server.prefill_histories(h, self.device)

    def _extend(self, cache: ServingCache, events: Histories) -> ServingCache:
        """``cache`` with checked new ``events`` appended (incrementally): replayed in a
        CUDA graph when they fit a bucket, else eager."""
        graphs = self._extend_graphs
        out = None if graphs is None else graphs.extend_request(cache, events, self._strict_graphs)
        return out if out is not None else self.server.extend_histories(cache, events, self.device)

    def _graph_sets(self) -> Graphs:
        return Graphs(self._graphs, self._encode_graphs, self._extend_graphs, self._no_graphs)

    def _store(self, ids: List[Hashable], h: Histories, cache: ServingCache) -> None:
        self._users.store(ids, h, cache, self.server.request_times(h))

    def _encoded(self, users: UserIds, states: List[UserState]) -> List[UserState]:
        return self._users.encoded(users, states, self.server, self._prefill)

    def _assemble(self, users: UserIds, states: List[Any]) -> ServingCache:
        return self._users.assemble(
            users, states, timed=self.server.time_encoded, owner=self.server.owner_id
        )

    def _items(self) -> torch.Tensor:
        """[I, E] the model's normalized item embeddings, computed once."""
        if self._catalogue is None:
            self._catalogue = self._retrieval().catalogue(self.device, self.chunk_size)
        return self._catalogue

    def _recommend_graph(
        self, embeddings: torch.Tensor, seen: Optional[List[torch.Tensor]], k: int
    ) -> Optional[TopK]:
        """The opened users' top-k replayed in a CUDA graph, or None (then run eager)."""
        graphs = self._graphs
        if not isinstance(graphs, RecommendGraphs):
            return None
        return graphs.recommend_request(embeddings, seen, k, self._strict_graphs)

    def _score_cache(
        self,
        cache: ServingCache,
        ids: torch.Tensor,
        lengths: torch.Tensor,
        timestamps: torch.Tensor,
        query_time: torch.Tensor,
    ) -> torch.Tensor:
        """[L_t, K] logits; ``lengths`` and the users' ``query_time`` [B] on the CPU."""
        graphs = self._graphs
        if isinstance(graphs, ScoreGraphs):
            out = graphs.score_request(
                cache, ids, lengths, timestamps, query_time, self._strict_graphs
            )
            if out is not None:
                return out
        if ids.device.type == "cpu" and timestamps.device.type == "cpu":  # one transfer
            both = torch.stack([ids.to(torch.int64), timestamps.to(torch.int64)])
            ids, timestamps = both.to(self.device, non_blocking=True).unbind(0)
        else:
            ids, timestamps = ids.to(self.device), timestamps.to(self.device)
        candidates = {
            CANDIDATE_ITEM_ID: ids,
            CANDIDATE_LENGTHS: to_device(lengths, self.device),
            CANDIDATE_TIMESTAMPS: timestamps,
        }
        server = cast(RankingServer, self.server)  # it answers score: _require checked
        return server.score_step(cache, candidates, longest(candidates[CANDIDATE_LENGTHS]))
