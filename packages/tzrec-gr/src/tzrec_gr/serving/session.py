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
``extend(user_ids, events)`` appends to. Every input is checked on the host (naming the
argument and the user's row) before a kernel runs.

On a CUDA device the ranking ``score`` replays CUDA graphs of the model's ``score_step``,
one per padded bucket of (users, cached tokens, candidates), captured on the first request
in the bucket (:mod:`tzrec_gr.serving._graphs`); requests outside every bucket run eager.
``graph_stats()`` reports the captures, their time and memory, and the replays.
"""

from __future__ import annotations

import dataclasses
import itertools
import pathlib
from typing import Any, Dict, Hashable, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from tzrec_gr.features import (
    CANDIDATE_ITEM_ID,
    CANDIDATE_LENGTHS,
    CANDIDATE_TIMESTAMPS,
    CONTEXTUAL,
    UIH_ACTIONS,
    UIH_ITEM_ID,
    UIH_LENGTHS,
    UIH_TIMESTAMPS,
)
from tzrec_gr.serving._graphs import ScoreGraphs, powers_of_two_up_to
from tzrec_gr.serving.cache import ServingCache
from tzrec_gr.serving.inputs import Candidates, Histories
from tzrec_gr.serving.topk import TopK, catalogue_topk
from tzrec_ops.jagged import host_copy, mirror, offsets_from_lengths, to_device

__all__ = ["CHECKPOINT_FORMAT", "ServingSession"]


def _models() -> Any:
    # imported on use: tzrec_gr.models imports the serving modules
    import tzrec_gr.models

    return tzrec_gr.models


#: the ``format`` of tzrec-bench's checkpoints that :meth:`ServingSession.from_checkpoint` reads
CHECKPOINT_FORMAT = 1

UserIds = Union[Sequence[Hashable], torch.Tensor]
CandidatesArg = Union[Candidates, torch.Tensor, Sequence[Sequence[int]]]
_versions = itertools.count()


@dataclasses.dataclass
class _User:
    """One opened user: the events so far (CPU) and their encoded rows (device)."""

    item_ids: torch.Tensor
    timestamps: torch.Tensor
    actions: Optional[torch.Tensor]
    contextual: Optional[torch.Tensor]  # [C * Fc] device
    query_time: Optional[torch.Tensor]  # 0-D device
    request_time: Optional[int]  # the same on the host (ranking)
    keys: Tuple[torch.Tensor, ...]
    values: Tuple[torch.Tensor, ...]
    length: int  # cached tokens
    user_embedding: Optional[torch.Tensor]  # [E] device (retrieval)
    version: int


def _user_list(name: str, user_ids: UserIds) -> List[Hashable]:
    if isinstance(user_ids, torch.Tensor):
        if user_ids.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(user_ids.shape)}")
        return user_ids.tolist()
    if isinstance(user_ids, (str, bytes)) or not isinstance(user_ids, Iterable):
        raise ValueError(f"{name} must be a sequence of user ids, got {type(user_ids).__name__}")
    ids = list(user_ids)
    seen = set()
    for i, u in enumerate(ids):
        if u in seen:
            raise ValueError(f"{name}[{i}] = {u!r} appears twice; give each user once")
        seen.add(u)
    return ids


def _joined(
    old: Optional[torch.Tensor], new: Optional[torch.Tensor], start: int, stop: int, keep: int
) -> Optional[torch.Tensor]:
    """The newest ``keep`` of ``old`` followed by ``new[start:stop]`` (CPU), or None."""
    if old is None or new is None:
        return None
    return torch.cat([old, new[start:stop].detach().cpu()])[-keep:]


class ServingSession:
    """Serve a trained model: ``recommend`` (retrieval), ``score`` (ranking), per-user state.

    Args:
        model (HSTURetrieval | HSTURanking): the trained model; the session moves it to
            ``device`` and sets eval mode (it serves in the model's dtype).
        device (torch.device | str | None): where to serve. Default: the model's.
        cuda_graphs (str): ``"auto"`` (graphs on a CUDA device, eager elsewhere), ``"on"``
            (a CUDA device required; a step that cannot be captured raises) or ``"off"``.
            Only the ranking ``score`` is captured. Default: ``"auto"``.
        batch_buckets (Sequence[int]): the users per graph bucket. Default: 1, 2, 4, ..., 64.
        length_buckets (Sequence[int] | None): cached tokens per user per bucket. Default:
            powers of two from 64 up to the model's ``max_cached_len``.
        candidate_buckets (Sequence[int] | None): candidates per user per bucket. Default:
            powers of two up to the model's ``max_targets``.
        max_graphs (int): the most graphs captured; later buckets run eager. Default: 32.
        chunk_size (int): catalogue items scored at a time by ``recommend``. Default: 65536.

    Raises:
        TypeError: ``model`` is not one of the two models.
        ValueError: a bad option (named).

    Example::

        session = ServingSession(model)                      # or .from_checkpoint("best.pt")
        top = session.recommend(Histories.from_lists([[3, 5, 8], [1]]), k=10)
        top.ids, top.scores                                  # [2, 10] each
        session.open(["ann", "bob"], histories)              # keep their encoded histories
        session.extend(["ann"], Histories.from_lists([[9]], [[12]]))
        session.recommend(["ann", "bob"], k=10)
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
        max_graphs: int = 32,
        chunk_size: int = 65536,
    ) -> None:
        if not isinstance(model, (_models().HSTURetrieval, _models().HSTURanking)):
            raise TypeError(
                f"model must be an HSTURetrieval or an HSTURanking, got {type(model).__name__}"
            )
        if cuda_graphs not in ("auto", "on", "off"):
            raise ValueError(f"cuda_graphs must be 'auto', 'on' or 'off', got {cuda_graphs!r}")
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
        if device is None:
            device = next(model.parameters()).device
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.kind = "retrieval" if isinstance(model, _models().HSTURetrieval) else "ranking"
        self.chunk_size = chunk_size
        self._users: Dict[Hashable, _User] = {}
        self._group: Optional[Tuple[Tuple[Any, ...], ServingCache]] = None
        self._catalogue: Optional[torch.Tensor] = None
        self._graphs: Optional[ScoreGraphs] = None
        self._strict_graphs = cuda_graphs == "on"
        cuda = self.device.type == "cuda"
        if cuda_graphs == "on" and not cuda:
            raise ValueError(f"cuda_graphs='on' needs a CUDA device, got {self.device}")
        if cuda and cuda_graphs != "off" and self.kind == "ranking":
            windowed = [
                i
                for i, layer in enumerate(model.transducer.stu.stu_layers)
                if getattr(layer, "max_attn_len", 0)
            ]
            if windowed:  # the padded cache would move the window
                if cuda_graphs == "on":
                    raise ValueError(
                        f"cuda_graphs='on' needs STU layers without max_attn_len; layer "
                        f"{windowed[0]} has one"
                    )
            else:
                for name, values in (
                    ("batch_buckets", batch_buckets),
                    ("length_buckets", length_buckets),
                    ("candidate_buckets", candidate_buckets),
                ):
                    if values is not None and (
                        not values
                        or any(
                            isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values
                        )
                    ):
                        raise ValueError(f"{name} must be ints >= 1, got {values!r}")
                self._graphs = ScoreGraphs(
                    model,
                    batch_buckets,
                    length_buckets or powers_of_two_up_to(model.max_cached_len, 64),
                    candidate_buckets or powers_of_two_up_to(model.max_targets),
                    max_graphs,
                )

    @classmethod
    def from_checkpoint(
        cls,
        path: Union[str, pathlib.Path],
        *,
        device: Optional[Union[torch.device, str]] = None,
        backend: Optional[str] = None,
        **kwargs: Any,
    ) -> ServingSession:
        """A session over the model of a tzrec-bench checkpoint (``best.pt``).

        Args:
            path: a ``torch.save`` dict with ``format`` 1, ``model_config``
                (``{"model": class name, "kwargs": constructor args}``) and ``model`` (the
                state dict).
            device: where to serve. Default: the CPU.
            backend: the ops backend to build the model with. Default: the saved one.
            **kwargs: the constructor's other options (``cuda_graphs``...).

        Raises:
            FileNotFoundError: no file at ``path``.
            ValueError: the file is not such a checkpoint, or its state dict does not fit.
        """
        path = pathlib.Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no checkpoint at {path}")
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises RuntimeError, EOFError, UnpicklingError...
            raise ValueError(f"{path}: cannot be loaded as a checkpoint ({exc})") from exc
        if not isinstance(payload, dict) or not {"format", "model_config", "model"} <= set(payload):
            raise ValueError(
                f"{path} is not a tzrec-bench checkpoint (a dict with 'format', "
                "'model_config' and 'model')"
            )
        if payload["format"] != CHECKPOINT_FORMAT:
            raise ValueError(
                f"{path}: checkpoint format {payload['format']!r}, expected {CHECKPOINT_FORMAT}"
            )
        model = _models().build_from_config(payload["model_config"], backend)
        try:
            model.load_state_dict(payload["model"])
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"the state dict in {path} does not fit the model: {exc}") from exc
        return cls(model, device=device or "cpu", **kwargs)

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

        Raises:
            TypeError: the model is a ranking model.
            ValueError: a bad history (named, with the user's row) or an unknown user id.
        """
        self._require("retrieval", "recommend", "score(users, candidates)")
        if isinstance(users, Histories):
            self._check(users)
            cache = self._prefill(users)
            embeddings = cache.user_embeddings
            seen = (users.item_ids, users.offsets)
        else:
            states = self._states("users", users)
            embeddings = torch.stack([s.user_embedding for s in states])  # type: ignore[misc]
            seen_ids = [s.item_ids for s in states]
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
        self._require("ranking", "score", "recommend(users, k)")
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
            query_time = self._query_time(users)
        else:
            states = self._states("users", users)
            cache = self._assemble(users, states)  # type: ignore[arg-type]
            query_time = torch.tensor([s.request_time for s in states], dtype=torch.int64)
        if cands.batch_size != cache.batch_size:
            raise ValueError(
                f"candidates are for {cands.batch_size} users but users has "
                f"{cache.batch_size}; they must match"
            )
        cands.check(model.num_items, model.max_targets)
        lengths = cands.lengths.detach().cpu().to(torch.int64)
        timestamps = cands.timestamps
        if timestamps is None:
            timestamps = query_time.repeat_interleave(lengths)
        logits = self._score_cache(cache, cands.item_ids, lengths, timestamps)
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
        ids = _user_list("user_ids", user_ids)
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

        Exact (what ``open`` of the longer histories gives, up to rounding). A retrieval
        model, or a ranking model without time encoding and contextual features, runs only
        the new events against the kept keys and values; otherwise (time gaps and
        positions counted back from the newest event change every kept token) the session
        encodes the longer histories again. A history that outgrows the model's bound
        keeps its newest events (then re-encoded).

        Args:
            user_ids: opened users, distinct.
            events (Histories): their new events (a user may get none), not older than
                their newest so far; ``query_time`` (ranking) replaces the users' query
                time (default: the newest event's time).
        """
        ids = _user_list("user_ids", user_ids)
        states = self._states("user_ids", ids)
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
        bound = self._max_events()
        offsets = events.offsets
        longer = [
            tuple(
                _joined(old, new, int(offsets[b]), int(offsets[b + 1]), bound)
                for old, new in (
                    (s.item_ids, events.item_ids),
                    (s.timestamps, events.timestamps),
                    (s.actions, events.actions),
                )
            )
            for b, s in enumerate(states)
        ]
        lengths = events.offsets[1:] - events.offsets[:-1]
        fits = all(s.item_ids.numel() + int(n) <= bound for s, n in zip(states, lengths))
        incremental = fits and (
            self.kind == "retrieval"
            or (not self.model.use_time_encoding and self.model.contextual_seq_len == 0)
        )
        if events.query_time is not None:
            query_time = events.query_time.detach().cpu()
        else:
            query_time = torch.tensor(
                [
                    int(ts[-1])
                    if ts.numel()
                    else s.request_time
                    if s.request_time is not None
                    else 0
                    for (_, ts, _), s in zip(longer, states)
                ]
            )
        history = Histories(
            item_ids=torch.cat([h[0] for h in longer]),
            lengths=torch.tensor([h[0].numel() for h in longer], dtype=torch.int64),
            timestamps=torch.cat([h[1] for h in longer]),
            actions=None if self.kind == "retrieval" else torch.cat([h[2] for h in longer]),
            contextual=(
                None
                if states[0].contextual is None
                else torch.stack([s.contextual for s in states]).cpu()
            ),
            query_time=query_time if self.kind == "ranking" else None,
        )
        with torch.no_grad():
            if not incremental:
                cache = self._prefill(history)
            else:
                cache = self._assemble(ids, states)
                dev = self._on_device(events)
                if self.kind == "retrieval":
                    _, cache = self.model.extend(
                        cache, dev[UIH_ITEM_ID], dev[UIH_LENGTHS], dev[UIH_TIMESTAMPS]
                    )
                else:
                    cache = self.model.extend(cache, dev)
        self._store(ids, history, cache)

    def close(self, user_ids: UserIds) -> None:
        """Forget these users (unknown ids are ignored)."""
        for u in _user_list("user_ids", user_ids):
            self._users.pop(u, None)
        self._group = None

    def __contains__(self, user_id: Hashable) -> bool:
        return user_id in self._users

    def __len__(self) -> int:
        return len(self._users)

    @property
    def user_ids(self) -> List[Hashable]:
        """The opened users, in the order they were opened."""
        return list(self._users)

    def refresh(self) -> None:
        """Forget what the session derived from the weights (the normalized catalogue);
        call it after changing the model's weights, and ``open`` the users again."""
        self._catalogue = None
        self._group = None

    def graph_stats(self) -> Dict[str, Any]:
        """The CUDA graphs so far: ``enabled``, ``captures``, ``replays``, ``eager_calls``
        (calls outside every bucket), ``graphs`` (per bucket: ``bucket``, ``capture_ms``,
        ``memory_bytes`` = static inputs plus the pool memory the capture reserved,
        ``replays``) and ``failed`` (buckets whose capture failed, with the error)."""
        if self._graphs is None:
            return {
                "enabled": False,
                "captures": 0,
                "replays": 0,
                "eager_calls": 0,
                "graphs": [],
                "failed": {},
            }
        return {"enabled": True, **self._graphs.stats()}

    # -- internals ------------------------------------------------------------------------

    def _require(self, kind: str, call: str, other: str) -> None:
        if self.kind != kind:
            raise TypeError(
                f"{call} needs an HSTU{kind.capitalize()} model; this session serves an "
                f"{type(self.model).__name__}, which answers {other}"
            )

    def _max_events(self) -> int:
        model = self.model
        return model.max_seq_len if self.kind == "retrieval" else model.max_uih_len

    def _check(
        self,
        histories: Histories,
        *,
        allow_empty: bool = False,
        contextual: bool = True,
        after: Optional[List[Optional[int]]] = None,
    ) -> None:
        if not isinstance(histories, Histories):
            raise ValueError(f"histories must be a Histories, got {type(histories).__name__}")
        model = self.model
        ranking = self.kind == "ranking"
        width = 0
        if ranking and contextual and model.contextual_seq_len > 0:
            pre = model.transducer.input_preprocessor
            width = pre.contextual_seq_len() * pre.contextual_feature_dim
        histories.check(
            model.num_items,
            allow_empty=allow_empty,
            needs_actions=ranking,
            contextual_width=width,
            after=after,
        )
        if after is None:
            bound = self._max_events()
            lengths = histories.offsets[1:] - histories.offsets[:-1]
            if bool((lengths > bound).any()):
                b = int((lengths > bound).nonzero()[0, 0])
                raise ValueError(
                    f"histories of user {b} has {int(lengths[b])} events, more than the "
                    f"model takes ({bound}); keep the newest {bound}"
                )

    def _on_device(self, h: Histories) -> Dict[str, torch.Tensor]:
        out = {
            UIH_ITEM_ID: h.item_ids.to(self.device),
            UIH_LENGTHS: to_device(h.lengths.detach().cpu().to(torch.int64), self.device),
            UIH_TIMESTAMPS: h.timestamps.to(self.device),
        }
        if h.actions is not None and self.kind == "ranking":
            out[UIH_ACTIONS] = h.actions.to(self.device)
        return out

    def _query_time(self, h: Histories) -> torch.Tensor:
        """[B] CPU: the given query times, or each user's newest timestamp."""
        if h.query_time is not None:
            return h.query_time.detach().cpu().to(torch.int64)
        return h.newest_timestamps()

    def _prefill(self, h: Histories) -> ServingCache:
        dev = self._on_device(h)
        model = self.model
        if self.kind == "retrieval":
            return model.prefill(dev[UIH_ITEM_ID], dev[UIH_LENGTHS], dev[UIH_TIMESTAMPS])
        if model.contextual_seq_len > 0:
            assert h.contextual is not None
            dtype = next(model.parameters()).dtype
            dev[CONTEXTUAL] = h.contextual.to(self.device, dtype)
        return model.prefill(dev, self._query_time(h).to(self.device))

    def _items(self) -> torch.Tensor:
        """[I, E] the model's normalized item embeddings, computed once."""
        if self._catalogue is None:
            model = self.model
            with torch.no_grad():
                rows = [
                    model.item_embedding(
                        torch.arange(
                            s, min(s + self.chunk_size, model.num_items), device=self.device
                        )
                    )
                    for s in range(0, model.num_items, self.chunk_size)
                ]
            self._catalogue = torch.cat(rows)
        return self._catalogue

    def _store(self, ids: List[Hashable], h: Histories, cache: ServingCache) -> None:
        offsets = host_copy(cache.offsets).values
        hoff = h.offsets
        request_time = self._query_time(h) if self.kind == "ranking" else None
        query_time = cache.query_time
        if query_time is None and request_time is not None:
            query_time = request_time.to(self.device)
        for b, u in enumerate(ids):
            start, stop = int(offsets[b]), int(offsets[b + 1])
            es, ee = int(hoff[b]), int(hoff[b + 1])
            self._users.pop(u, None)  # re-opened users move to the end
            self._users[u] = _User(
                item_ids=h.item_ids[es:ee].detach().cpu(),
                timestamps=h.timestamps[es:ee].detach().cpu(),
                actions=None if h.actions is None else h.actions[es:ee].detach().cpu(),
                contextual=None if cache.contextual is None else cache.contextual[b],
                query_time=None if query_time is None else query_time[b],
                request_time=None if request_time is None else int(request_time[b]),
                keys=tuple(k[start:stop] for k in cache.keys),
                values=tuple(v[start:stop] for v in cache.values),
                length=stop - start,
                user_embedding=(
                    None if cache.user_embeddings is None else cache.user_embeddings[b]
                ),
                version=next(_versions),
            )
        self._group = None

    def _states(self, name: str, users: UserIds) -> List[_User]:
        ids = _user_list(name, users)
        if not ids:
            raise ValueError(f"{name} is empty; give at least one user")
        missing = [u for u in ids if u not in self._users]
        if missing:
            raise ValueError(
                f"{name} holds users that were not opened: {missing[:5]!r}; open them "
                "first (session.open(user_ids, histories)) or pass Histories"
            )
        return [self._users[u] for u in ids]

    def _assemble(self, users: UserIds, states: List[_User]) -> ServingCache:
        """The users' kept rows as one batch cache (the last one reused when the same
        users, unchanged, come again: a graph then skips copying it)."""
        key = tuple((u, s.version) for u, s in zip(_user_list("users", users), states))
        if self._group is not None and self._group[0] == key:
            return self._group[1]
        lengths_host = torch.tensor([s.length for s in states], dtype=torch.int64)
        lengths = to_device(lengths_host, self.device)
        layers = len(states[0].keys)
        qt = [s.query_time for s in states]
        ctx = [s.contextual for s in states]
        emb = [s.user_embedding for s in states]
        cache = ServingCache(
            keys=tuple(torch.cat([s.keys[i] for s in states]) for i in range(layers)),
            values=tuple(torch.cat([s.values[i] for s in states]) for i in range(layers)),
            offsets=mirror(offsets_from_lengths, lengths),
            lengths=lengths,
            query_time=(torch.stack(qt) if qt[0] is not None and self.model_timed() else None),
            contextual=torch.stack(ctx) if ctx[0] is not None else None,
            user_embeddings=torch.stack(emb) if emb[0] is not None else None,
            max_len=int(lengths_host.max()),
            owner=self.model.transducer.owner_id,
        )
        self._group = (key, cache)
        return cache

    def model_timed(self) -> bool:
        """Whether the model encodes time (the cache then holds each user's query time)."""
        encoder = self.model.transducer.positional_encoder
        return encoder is not None and encoder.use_time_encoding

    def _score_cache(
        self,
        cache: ServingCache,
        ids: torch.Tensor,
        lengths: torch.Tensor,
        timestamps: torch.Tensor,
    ) -> torch.Tensor:
        """[L_t, K] logits; ``lengths`` [B] on the CPU."""
        if ids.device.type == "cpu" and timestamps.device.type == "cpu":  # one transfer
            both = torch.stack([ids.to(torch.int64), timestamps.to(torch.int64)])
            ids, timestamps = both.to(self.device, non_blocking=True).unbind(0)
        else:
            ids, timestamps = ids.to(self.device), timestamps.to(self.device)
        graphs = self._graphs
        if graphs is not None:
            bucket = graphs.bucket(
                cache.batch_size,
                int(host_copy(cache.lengths).values.max()),
                int(lengths.max()) if lengths.numel() else 0,
            )
            if bucket is not None:
                out = graphs.score(bucket, cache, ids, lengths, timestamps, self._strict_graphs)
                if out is not None:
                    return out
            graphs.eager_calls += 1
        candidates = {
            CANDIDATE_ITEM_ID: ids,
            CANDIDATE_LENGTHS: to_device(lengths, self.device),
            CANDIDATE_TIMESTAMPS: timestamps,
        }
        return self.model.score(cache, candidates)
