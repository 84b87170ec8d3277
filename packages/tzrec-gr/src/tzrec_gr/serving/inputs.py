"""What a :class:`~tzrec_gr.serving.ServingSession` takes: users' histories and candidates.

Legend: B = users, L = events of all users, L_t = candidates of all users, C * Fc = the
ranking model's contextual width.

Both are jagged batches, user-major (user 0's rows first), with ``lengths`` [B]. Build them
from Python lists of the model's item ids with ``from_lists``, from tensors (model ids too:
the fast path), or from the users' raw ids with ``from_raw(vocabulary, ...)``, which maps
them through a checkpoint's :class:`~tzrec_gr.vocabulary.IdVocabularies` (one vectorised
lookup per batch; an unknown raw id is a ValueError naming the user and the id). Keep them
on the CPU: the session checks their values there (naming the argument and the user's row)
before any kernel runs, then moves them to the model's device without reading the device
back.

This module is serving's one door: a request is checked here (shapes and dtypes when built,
values against the model in ``check``) and the servers encode it without checking it again.
The integer-tensor check is the models' own (:func:`tzrec_gr.models.inputs.check_int_tensor`):
a non-tensor is a TypeError naming the argument, a wrong rank or dtype a ValueError.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Any, List, Optional, Sequence, Union

import numpy as np
import torch

from tzrec_gr.models.inputs import check_int_tensor
from tzrec_gr.serving._host import host_offsets, lengths_of
from tzrec_gr.vocabulary import IdVocabularies, Vocabulary
from tzrec_ops.jagged import first_true

__all__ = ["Candidates", "Histories"]


def _int_rows(name: str, rows: Sequence[Sequence[int]]) -> List[torch.Tensor]:
    try:
        return [torch.as_tensor(list(r), dtype=torch.int64).reshape(-1) for r in rows]
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"{name} must be one sequence of integers per user: {exc}") from exc


def _item_vocabulary(vocabulary: Any) -> Vocabulary:
    """The items' :class:`Vocabulary` of ``vocabulary`` (an IdVocabularies or a Vocabulary)."""
    if isinstance(vocabulary, IdVocabularies):
        return vocabulary.items
    if isinstance(vocabulary, Vocabulary):
        return vocabulary
    if vocabulary is None:
        raise ValueError(
            "from_raw needs the model's item vocabulary, got None: the checkpoint holds no "
            "vocabulary; give model ids to from_lists"
        )
    raise TypeError(
        f"vocabulary must be an IdVocabularies or a Vocabulary, got {type(vocabulary).__name__}"
    )


def _id_array(flat: List[Any]) -> np.ndarray:
    """``flat`` as an array :meth:`Vocabulary.rows` looks up without a Python loop when the
    ids are all integers (int64 or uint64) or all strings; an object array otherwise."""
    if not flat:
        return np.zeros(0, dtype=np.int64)
    if all(isinstance(v, str) for v in flat):
        return np.asarray(flat, dtype=np.str_)
    if all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in flat):
        array = np.asarray(flat)  # object for an integer past 64 bits: no row, as it should
        return array if array.dtype.kind in "iuO" else np.asarray(flat, dtype=object)
    array = np.empty(len(flat), dtype=object)
    array[:] = flat
    return array


def _raw_rows(
    name: str, vocabulary: Any, raw_ids: Sequence[Sequence[Any]]
) -> List[torch.Tensor]:
    """One int64 tensor of model rows per user, from each user's raw ids (one lookup)."""
    items = _item_vocabulary(vocabulary)
    per_user = [list(r) for r in raw_ids]
    flat: List[Any] = [v for r in per_user for v in r]
    rows = items.rows(_id_array(flat))
    offsets = np.zeros(len(per_user) + 1, dtype=np.int64)
    np.cumsum([len(r) for r in per_user], out=offsets[1:])
    unknown = np.flatnonzero(rows < 0)
    if unknown.size:
        i = int(unknown[0])
        b = int(np.searchsorted(offsets, i, side="right")) - 1
        raise ValueError(
            f"{name} of user {b} (position {i - int(offsets[b])}): unknown raw item id "
            f"{flat[i]!r}, not in the vocabulary of {len(items)} items"
        )
    return [torch.from_numpy(rows[a:z].copy()) for a, z in zip(offsets[:-1], offsets[1:])]


def _cat(rows: List[torch.Tensor]) -> torch.Tensor:
    return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)


def _user_of(bounds: List[int], row: int) -> int:
    """The user of ``row``, for the host offsets ``bounds`` [B + 1]."""
    return bisect.bisect_right(bounds, row) - 1


def _check_lengths(name: str, lengths: torch.Tensor, rows: int, rows_name: str) -> torch.Tensor:
    """``lengths`` [B] >= 0 summing to ``rows`` (one read of ``lengths``); returns the host
    offsets [B + 1]."""
    counts = lengths.tolist()
    if counts and min(counts) < 0:
        b = next(b for b, n in enumerate(counts) if n < 0)
        raise ValueError(f"{name}[{b}] must be >= 0, got {counts[b]}")
    if sum(counts) != rows:
        raise ValueError(
            f"{name} sums to {sum(counts)} but {rows_name} has {rows} rows; they must match"
        )
    return host_offsets(counts)


def _first_over(lengths: List[int], bound: int) -> Optional[int]:
    """The first user with more than ``bound`` rows, or None."""
    if not lengths or max(lengths) <= bound:
        return None
    return next(b for b, n in enumerate(lengths) if n > bound)


def _check_ids(name: str, ids: torch.Tensor, bounds: List[int], num_items: int) -> None:
    """Every id in ``[0, num_items)`` (the range read first: one pass when they are)."""
    host = ids.cpu()
    if not host.numel():
        return
    low, high = torch.aminmax(host)
    if int(low) >= 0 and int(high) < num_items:
        return
    i = first_true((host < 0) | (host >= num_items))
    b = _user_of(bounds, i)
    raise ValueError(
        f"{name} of user {b} (position {i - bounds[b]}) is {int(host[i])}, not an "
        f"item of the catalogue [0, {num_items})"
    )


def _check_sorted(ts: torch.Tensor, bounds: List[int]) -> None:
    """Each user's timestamps ``ts`` (host) non-decreasing; a step back from one user's
    last event to the next user's first is allowed (looked for only when there is one)."""
    if ts.numel() < 2:
        return
    back = ts[1:] < ts[:-1]
    if not bool(back.any()):
        return
    firsts = [a for a in bounds[1:-1] if 0 < a < ts.numel()]
    back[torch.tensor(firsts, dtype=torch.int64) - 1] = False
    if bool(back.any()):
        i = first_true(back) + 1
        b = _user_of(bounds, i)
        p = i - bounds[b]
        raise ValueError(
            f"histories.timestamps of user {b} are not sorted: position {p} "
            f"({int(ts[i])}) is older than position {p - 1} ({int(ts[i - 1])})"
        )


@dataclasses.dataclass(frozen=True)
class Histories:
    """B users' event histories (oldest event first), or new events to append.

    Attributes:
        item_ids (torch.Tensor): [L] integer item ids, user-major.
        lengths (torch.Tensor): [B] events per user.
        timestamps (torch.Tensor): [L] integer event times, non-decreasing within a user.
        actions (torch.Tensor | None): [L] integer action bitmasks (ranking models: required).
        contextual (torch.Tensor | None): [B, C * Fc] float contextual features (ranking
            models with a contextual prefix: required on :meth:`ServingSession.open` and
            stateless calls).
        query_time (torch.Tensor | None): [B] integer request times (ranking): the anchor
            of the time encoding; candidates are scored as seen at this time. Default: each
            user's newest timestamp.

    Raises:
        TypeError: an argument is not a tensor (named).
        ValueError: shapes, dtypes or lengths that do not fit together, naming the argument.
            Values against a model (ids in the catalogue, sorted timestamps, no empty
            history) are checked by :meth:`check`, which the session calls.
    """

    item_ids: torch.Tensor
    lengths: torch.Tensor
    timestamps: torch.Tensor
    actions: Optional[torch.Tensor] = None
    contextual: Optional[torch.Tensor] = None
    query_time: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        ids = check_int_tensor("histories.item_ids", self.item_ids)
        lengths = check_int_tensor("histories.lengths", self.lengths)
        for name in ("timestamps", "actions"):
            t = getattr(self, name)
            if t is None and name == "actions":
                continue
            check_int_tensor(f"histories.{name}", t)
            if t.shape[0] != ids.shape[0]:
                raise ValueError(
                    f"histories.{name} has {t.shape[0]} rows but histories.item_ids has "
                    f"{ids.shape[0]}; they must match"
                )
        if self.contextual is not None:
            ctx = self.contextual
            if not isinstance(ctx, torch.Tensor):
                raise TypeError(
                    f"histories.contextual must be a torch.Tensor, got {type(ctx).__name__}"
                )
            if ctx.dim() != 2 or not ctx.is_floating_point():
                raise ValueError(
                    "histories.contextual must be a [B, C * Fc] float tensor, got "
                    f"{getattr(ctx, 'dtype', type(ctx).__name__)} "
                    f"{tuple(getattr(ctx, 'shape', ()))}"
                )
            if ctx.shape[0] != lengths.shape[0]:
                raise ValueError(
                    f"histories.contextual has {ctx.shape[0]} rows but histories.lengths has "
                    f"B = {lengths.shape[0]} users; they must match"
                )
        if self.query_time is not None:
            check_int_tensor("histories.query_time", self.query_time)
            if self.query_time.shape[0] != lengths.shape[0]:
                raise ValueError(
                    f"histories.query_time has {self.query_time.shape[0]} entries but "
                    f"histories.lengths has B = {lengths.shape[0]} users; they must match"
                )
        object.__setattr__(
            self,
            "_offsets",
            _check_lengths("histories.lengths", lengths, ids.shape[0], "histories.item_ids"),
        )

    @classmethod
    def from_lists(
        cls,
        item_ids: Sequence[Sequence[int]],
        timestamps: Optional[Sequence[Sequence[int]]] = None,
        actions: Optional[Sequence[Sequence[int]]] = None,
        contextual: Optional[Sequence[Sequence[float]]] = None,
        query_time: Optional[Sequence[int]] = None,
    ) -> Histories:
        """From one list per user (CPU tensors).

        ``timestamps`` None numbers each user's events 0, 1, 2... (for a model that does
        not encode time, such as :class:`~tzrec_gr.models.HSTURetrieval`).
        """
        ids = _int_rows("item_ids", item_ids)
        lengths = torch.tensor([r.numel() for r in ids], dtype=torch.int64)
        if timestamps is None:
            ts = [torch.arange(r.numel(), dtype=torch.int64) for r in ids]
        else:
            ts = _int_rows("timestamps", timestamps)
            if len(ts) != len(ids):
                raise ValueError(
                    f"timestamps has {len(ts)} users but item_ids has {len(ids)}; they must match"
                )
        for name, rows in (("timestamps", ts), ("actions", actions)):
            if rows is None:
                continue
            if name == "actions":
                rows = _int_rows("actions", rows)
            for b, (r, i) in enumerate(zip(rows, ids)):
                if r.numel() != i.numel():
                    raise ValueError(
                        f"{name}[{b}] has {r.numel()} events but item_ids[{b}] has {i.numel()}"
                    )
        acts = None if actions is None else _cat(_int_rows("actions", actions))
        return cls(
            item_ids=_cat(ids),
            lengths=lengths,
            timestamps=_cat(ts),
            actions=acts,
            contextual=None if contextual is None else torch.tensor(contextual).float(),
            query_time=None if query_time is None else torch.tensor(query_time).long(),
        )

    @classmethod
    def from_raw(
        cls,
        vocabulary: Union[IdVocabularies, Vocabulary, None],
        item_ids: Sequence[Sequence[Any]],
        timestamps: Optional[Sequence[Sequence[int]]] = None,
        actions: Optional[Sequence[Sequence[int]]] = None,
        contextual: Optional[Sequence[Sequence[float]]] = None,
        query_time: Optional[Sequence[int]] = None,
    ) -> Histories:
        """From one list of raw item ids per user (the ids of the training data's event
        log: integers or strings), mapped to the model's rows by ``vocabulary`` (a
        session's ``vocabularies``, or its ``items``); the rest as :meth:`from_lists`.

        Raises:
            ValueError: an unknown raw id (naming the user, the position and the id), or
                no vocabulary (None: a checkpoint without one).
        """
        rows = [r.tolist() for r in _raw_rows("item_ids", vocabulary, item_ids)]
        return cls.from_lists(rows, timestamps, actions, contextual, query_time)

    @property
    def batch_size(self) -> int:
        """B, the number of users."""
        return self.lengths.shape[0]

    @property
    def offsets(self) -> torch.Tensor:
        """[B + 1] int64 offsets of the users' rows (on the CPU)."""
        return self._offsets  # type: ignore[attr-defined]

    def check(
        self,
        num_items: int,
        *,
        allow_empty: bool = False,
        needs_actions: bool = False,
        contextual_width: int = 0,
        after: Optional[Sequence[Optional[int]]] = None,
        max_events: Optional[int] = None,
    ) -> None:
        """Check the values against a model (one read of the values if they are not on the
        CPU).

        Args:
            num_items (int): ids must be in ``[0, num_items)``.
            allow_empty (bool): a user may have no events (appending none). Default: False.
            needs_actions (bool): ``actions`` is required (ranking). Default: False.
            contextual_width (int): C * Fc; > 0 requires ``contextual`` of this width.
                Default: 0.
            after (Sequence[int | None] | None): each user's newest timestamp so far (for
                appended events, which must not be older). Default: None.
            max_events (int | None): the most events of one user (the model's bound).
                Default: None, no bound.

        Raises:
            ValueError: naming the argument and the user's row: an unknown item id,
                timestamps that go back in time, an empty history, a missing feature, a
                history longer than ``max_events``.
        """
        bounds = self.offsets.tolist()
        lengths = lengths_of(bounds)
        b = None if max_events is None else _first_over(lengths, max_events)
        if b is not None:
            raise ValueError(
                f"histories of user {b} has {lengths[b]} events, more than the "
                f"model takes ({max_events}); keep the newest {max_events}"
            )
        if not allow_empty and 0 in lengths:
            b = lengths.index(0)
            raise ValueError(f"histories of user {b} is empty: every user needs at least one event")
        _check_ids("histories.item_ids", self.item_ids, bounds, num_items)
        ts = self.timestamps.cpu()
        _check_sorted(ts, bounds)
        if after is not None:
            for b in range(self.batch_size):
                start, stop = bounds[b], bounds[b + 1]
                if after[b] is not None and stop > start and int(ts[start]) < after[b]:
                    raise ValueError(
                        f"histories.timestamps of user {b} start at {int(ts[start])}, older "
                        f"than that user's newest event so far ({after[b]})"
                    )
        if needs_actions and self.actions is None:
            raise ValueError("histories.actions is required by a ranking model")
        if contextual_width > 0:
            if self.contextual is None:
                raise ValueError(
                    f"histories.contextual [B, {contextual_width}] is required: the model "
                    "has a contextual prefix"
                )
            if self.contextual.shape[1] != contextual_width:
                raise ValueError(
                    f"histories.contextual must have {contextual_width} columns (C * Fc), "
                    f"got {self.contextual.shape[1]}"
                )
            if not bool(torch.isfinite(self.contextual).all()):
                row = first_true((~torch.isfinite(self.contextual.cpu())).any(dim=1))
                raise ValueError(f"histories.contextual of user {row} has a NaN or inf")

    @classmethod
    def of_checked(cls, lengths: torch.Tensor, **fields: Optional[torch.Tensor]) -> Histories:
        """Histories the session builds on the host from events it checked when they
        came (a user's kept events, with new ones appended): ``lengths`` [B] CPU int64
        and the other fields as the constructor's, not checked again."""
        histories = object.__new__(cls)
        for f in dataclasses.fields(cls):
            object.__setattr__(histories, f.name, fields.get(f.name))
        object.__setattr__(histories, "lengths", lengths)
        object.__setattr__(histories, "_offsets", host_offsets(lengths.tolist()))
        return histories

    def query_times(self) -> torch.Tensor:
        """[B] int64 CPU: ``query_time`` when given, else each user's newest timestamp."""
        if self.query_time is not None:
            return self.query_time.cpu().to(torch.int64)
        return self.newest_timestamps()

    def newest_timestamps(self) -> torch.Tensor:
        """[B] int64 each user's newest timestamp (0 for a user without events), CPU."""
        ts = self.timestamps.cpu().to(torch.int64)
        offsets = self.offsets
        last = (offsets[1:] - 1).clamp(min=0)
        newest = ts[last] if ts.numel() else torch.zeros(self.batch_size, dtype=torch.int64)
        return torch.where(offsets[1:] > offsets[:-1], newest, torch.zeros_like(newest))


@dataclasses.dataclass(frozen=True)
class Candidates:
    """Candidate items to score for each of B users.

    Attributes:
        item_ids (torch.Tensor): [L_t] integer item ids, user-major.
        lengths (torch.Tensor): [B] candidates per user.
        timestamps (torch.Tensor | None): [L_t] integer times the candidates are shown.
            Default: each user's query time.
    """

    item_ids: torch.Tensor
    lengths: torch.Tensor
    timestamps: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        ids = check_int_tensor("candidates.item_ids", self.item_ids)
        lengths = check_int_tensor("candidates.lengths", self.lengths)
        if self.timestamps is not None:
            check_int_tensor("candidates.timestamps", self.timestamps)
            if self.timestamps.shape[0] != ids.shape[0]:
                raise ValueError(
                    f"candidates.timestamps has {self.timestamps.shape[0]} rows but "
                    f"candidates.item_ids has {ids.shape[0]}; they must match"
                )
        object.__setattr__(
            self,
            "_offsets",
            _check_lengths("candidates.lengths", lengths, ids.shape[0], "candidates.item_ids"),
        )

    @classmethod
    def from_lists(
        cls,
        item_ids: Sequence[Sequence[int]],
        timestamps: Optional[Sequence[Sequence[int]]] = None,
    ) -> Candidates:
        """From one list per user (CPU tensors)."""
        ids = _int_rows("item_ids", item_ids)
        ts = None
        if timestamps is not None:
            rows = _int_rows("timestamps", timestamps)
            if [r.numel() for r in rows] != [r.numel() for r in ids]:
                raise ValueError("timestamps must hold one time per candidate of item_ids")
            ts = _cat(rows)
        lengths = torch.tensor([r.numel() for r in ids], dtype=torch.int64)
        return cls(_cat(ids), lengths, ts)

    @classmethod
    def from_raw(
        cls,
        vocabulary: Union[IdVocabularies, Vocabulary, None],
        item_ids: Sequence[Sequence[Any]],
        timestamps: Optional[Sequence[Sequence[int]]] = None,
    ) -> Candidates:
        """From one list of raw item ids per user, mapped by ``vocabulary`` (as
        :meth:`Histories.from_raw`).

        Raises:
            ValueError: an unknown raw id (naming the user, the position and the id).
        """
        rows = [r.tolist() for r in _raw_rows("candidates", vocabulary, item_ids)]
        return cls.from_lists(rows, timestamps)

    @classmethod
    def from_dense(cls, item_ids: torch.Tensor) -> Candidates:
        """From a [B, T] integer tensor: T candidates per user."""
        check_int_tensor("candidates", item_ids, 2)
        lengths = torch.full((item_ids.shape[0],), item_ids.shape[1], dtype=torch.int64)
        return cls(item_ids.reshape(-1), lengths)

    @property
    def batch_size(self) -> int:
        """B, the number of users."""
        return self.lengths.shape[0]

    @property
    def offsets(self) -> torch.Tensor:
        """[B + 1] int64 offsets of the users' candidates (on the CPU)."""
        return self._offsets  # type: ignore[attr-defined]

    def check(self, num_items: int, max_per_user: int) -> None:
        """Ids in ``[0, num_items)`` and at most ``max_per_user`` candidates per user.

        Raises:
            ValueError: naming ``candidates`` and the user's row.
        """
        bounds = self.offsets.tolist()
        lengths = lengths_of(bounds)
        b = _first_over(lengths, max_per_user)
        if b is not None:
            raise ValueError(
                f"candidates of user {b}: {lengths[b]}, more than the model's "
                f"max_targets ({max_per_user})"
            )
        _check_ids("candidates.item_ids", self.item_ids, bounds, num_items)
