"""Per-user interaction sequences, sorted by time, with items remapped to dense ids.

Legend: U = users (rows), N = events of all users, I = items.

A :class:`SequenceDataset` stores the users' sequences back to back (CSR layout): user ``u``'s
events are ``[offsets[u], offsets[u + 1])`` of every per-event array. For two users with 3 and
2 events::

    offsets    = [0, 3, 5]
    item_ids   = [7, 2, 9 | 2, 4]
    timestamps = [10, 12, 12 | 5, 30]
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union

import numpy as np

from tzrec_gr.vocabulary import IdVocabularies, Vocabulary

Rows = Union[Sequence[int], np.ndarray]
_CHECK_CHUNK = 1 << 22  # events checked at once


def segment_index(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The flat positions of the segments ``[starts[i], starts[i] + lengths[i])``, in order.

    ``segment_index([5, 0], [2, 3])`` is ``[5, 6, 0, 1, 2]``.
    """
    starts = np.asarray(starts, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    out_starts = np.cumsum(lengths) - lengths
    # each output position p of segment i reads starts[i] + (p - out_starts[i])
    return np.repeat(starts - out_starts, lengths) + np.arange(lengths.sum(), dtype=np.int64)


@dataclass(frozen=True, eq=False)
class SequenceDataset:
    """Users' interaction sequences, each sorted by time (ties: by raw item id, then file order).

    Item ids are dense: ``[0, num_items)``, in the order of the raw ids (``item_raw_ids[i]`` is
    the raw id of item ``i``). No id is reserved for padding, since the tzrec-gr models take
    jagged inputs; 0 is a real item. Users are rows ``[0, U)`` in the order of their raw ids.
    Raw ids are int64 or strings (a numpy str array). Arrays may be memory-mapped (a cached
    data set): read-only.

    Attributes:
        name (str): the data set's name, e.g. ``"ml-100k"``.
        offsets (np.ndarray): [U + 1] int64, row ``u``'s events are ``[offsets[u], offsets[u+1])``.
        item_ids (np.ndarray): [N] int64 dense item ids.
        timestamps (np.ndarray): [N] int64 Unix seconds, non-decreasing within each row.
        num_items (int): I, the number of distinct items.
        item_raw_ids (np.ndarray): [I] the raw (file) id of each dense item id, sorted.
        user_raw_ids (np.ndarray): [U] the raw (file) id of each row's user.
        ratings (np.ndarray | None): [N] float32 explicit ratings (MovieLens: 0.5 to 5).
            Default: None.
        actions (np.ndarray | None): [N] int64 action bitmasks (:class:`Action` bits).
            Default: None.
        fingerprint (str): a digest of the loaded data (the cache's), "" when not computed
            (generated data, a split's parts). Default: "".
        files (Tuple[str, ...]): the files the data was read from, in file order, relative
            to the folder given (a file given alone: its name); () for generated data and a
            split's parts. Default: ().
        skipped_files (Tuple[str, ...]): the files of an unknown kind that the folder held,
            which were not read. Default: ().
    """

    name: str
    offsets: np.ndarray
    item_ids: np.ndarray
    timestamps: np.ndarray
    num_items: int
    item_raw_ids: np.ndarray
    user_raw_ids: np.ndarray
    ratings: Optional[np.ndarray] = None
    actions: Optional[np.ndarray] = None
    fingerprint: str = ""
    files: Tuple[str, ...] = ()
    skipped_files: Tuple[str, ...] = ()

    def __post_init__(self) -> None:
        offsets, n = self.offsets, len(self.item_ids)
        if offsets.ndim != 1 or len(offsets) == 0:
            raise ValueError(f"offsets must be [U + 1]; got shape {offsets.shape}")
        if offsets[0] != 0 or offsets[-1] != n:
            raise ValueError(
                f"offsets must run from 0 to len(item_ids) = {n}; got {offsets[0]} to "
                f"{offsets[-1]}"
            )
        if np.any(np.diff(offsets) < 0):
            raise ValueError("offsets must be non-decreasing")
        for field in ("timestamps", "ratings", "actions"):
            values = getattr(self, field)
            if values is not None and values.shape != self.item_ids.shape:
                raise ValueError(
                    f"{field} must be [N] like item_ids ({n},); got {values.shape}"
                )
        if self.item_raw_ids.shape != (self.num_items,):
            raise ValueError(
                f"item_raw_ids must be [num_items] ({self.num_items},); got "
                f"{self.item_raw_ids.shape}"
            )
        if self.user_raw_ids.shape != (len(offsets) - 1,):
            raise ValueError(
                f"user_raw_ids must be [U] ({len(offsets) - 1},); got {self.user_raw_ids.shape}"
            )
        if n and (self.item_ids.min() < 0 or self.item_ids.max() >= self.num_items):
            raise ValueError(
                f"item_ids must lie in [0, {self.num_items}); got "
                f"[{self.item_ids.min()}, {self.item_ids.max()}]"
            )
        row_starts = offsets[1:-1]
        # in chunks: a memory-mapped data set is checked without an [N] temporary
        for start in range(0, max(n - 1, 0), _CHECK_CHUNK):
            stop = min(start + _CHECK_CHUNK + 1, n)  # the pairs (p, p + 1), start <= p < stop - 1
            steps = np.diff(self.timestamps[start:stop])
            first = np.searchsorted(row_starts, start + 1, side="left")
            last = np.searchsorted(row_starts, stop - 1, side="right")
            steps[row_starts[first:last] - 1 - start] = 0  # across rows: any order
            if np.any(steps < 0):
                raise ValueError("timestamps must be non-decreasing within each row")

    @classmethod
    def from_events(
        cls,
        name: str,
        user_ids: np.ndarray,
        item_ids: np.ndarray,
        timestamps: np.ndarray,
        ratings: Optional[np.ndarray] = None,
        actions: Optional[np.ndarray] = None,
    ) -> "SequenceDataset":
        """Group raw events (any order, raw ids) into time-sorted rows with dense item ids.

        Args:
            name (str): the data set's name.
            user_ids (np.ndarray): [N] raw user ids.
            item_ids (np.ndarray): [N] raw item ids.
            timestamps (np.ndarray): [N] times; sorted within a user, ties broken by raw item
                id, then by position in these arrays.
            ratings (np.ndarray | None): [N] ratings. Default: None.
            actions (np.ndarray | None): [N] action bitmasks. Default: None.
        """
        user_ids = np.asarray(user_ids, dtype=np.int64)
        item_ids = np.asarray(item_ids, dtype=np.int64)
        timestamps = np.asarray(timestamps, dtype=np.int64)
        order = np.lexsort((item_ids, timestamps, user_ids))  # stable: file order breaks ties
        users = user_ids[order]
        user_raw_ids, counts = np.unique(users, return_counts=True)
        item_raw_ids, dense = np.unique(item_ids[order], return_inverse=True)
        return cls(
            name=name,
            offsets=np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
            item_ids=dense.astype(np.int64).reshape(-1),
            timestamps=timestamps[order],
            num_items=len(item_raw_ids),
            item_raw_ids=item_raw_ids,
            user_raw_ids=user_raw_ids,
            ratings=None if ratings is None else np.asarray(ratings, np.float32)[order],
            actions=None if actions is None else np.asarray(actions, np.int64)[order],
        )

    def id_vocabularies(self, source: str = "") -> IdVocabularies:
        """The users' and items' raw ids with the data's fingerprint, as checkpoints save
        them (``source`` says where the data came from)."""
        users, items = Vocabulary(self.user_raw_ids), Vocabulary(self.item_raw_ids)
        for name, vocabulary, raw in (("user", users, self.user_raw_ids),
                                      ("item", items, self.item_raw_ids)):
            if not np.array_equal(vocabulary.ids, raw):
                raise ValueError(f"{name}_raw_ids must be sorted for rows to follow raw ids")
        return IdVocabularies(users, items, self.fingerprint, source)

    def with_files(self, files: Sequence[str],
                   skipped: Sequence[str] = ()) -> "SequenceDataset":
        """This data set, saying which files it was read from (and which were skipped)."""
        # a shallow copy: the events are not checked again, only the file names change
        named = copy.copy(self)
        object.__setattr__(named, "files", tuple(files))
        object.__setattr__(named, "skipped_files", tuple(skipped))
        return named

    @property
    def num_users(self) -> int:
        """U, the number of rows."""
        return len(self.offsets) - 1

    @property
    def num_events(self) -> int:
        """N, the number of events of all users."""
        return len(self.item_ids)

    @property
    def lengths(self) -> np.ndarray:
        """[U] int64 events per row."""
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return self.num_users

    def sequence(self, row: int) -> np.ndarray:
        """Row ``row``'s dense item ids, oldest first (a view)."""
        return self.item_ids[self.offsets[row] : self.offsets[row + 1]]

    def take(self, rows: Rows, starts: np.ndarray, lengths: np.ndarray) -> "SequenceDataset":
        """A dataset of the events ``[starts[i], starts[i] + lengths[i])`` as its row ``i``,
        which belongs to user ``rows[i]``; items keep their ids (``num_items`` is unchanged)."""
        rows = np.asarray(rows, dtype=np.int64)
        lengths = np.asarray(lengths, dtype=np.int64)
        index = segment_index(starts, lengths)

        def gather(values: Optional[np.ndarray]) -> Optional[np.ndarray]:
            return None if values is None else values[index]

        return SequenceDataset(
            name=self.name,
            offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            item_ids=self.item_ids[index],
            timestamps=self.timestamps[index],
            num_items=self.num_items,
            item_raw_ids=self.item_raw_ids,
            user_raw_ids=self.user_raw_ids[rows],
            ratings=gather(self.ratings),
            actions=gather(self.actions),
        )

    def select(self, rows: Rows) -> "SequenceDataset":
        """The rows ``rows``, whole, in that order."""
        rows = np.asarray(rows, dtype=np.int64)
        return self.take(rows, self.offsets[rows], self.lengths[rows])

    def head(self, lengths: np.ndarray) -> "SequenceDataset":
        """Every row cut to its first ``lengths[u]`` events (``lengths[u] <= len(row u)``)."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.shape != (self.num_users,) or np.any((lengths < 0) | (lengths > self.lengths)):
            raise ValueError(
                f"lengths must be [U] ({self.num_users},) with 0 <= lengths[u] <= the row's "
                f"length; got shape {lengths.shape}"
            )
        return self.take(np.arange(self.num_users), self.offsets[:-1], lengths)
