"""Users' histories for the service: the training log's events, then the appended ones.

On start the log is read as training read it (:func:`tzrec_bench.predict_users.
load_run_data`: the run's column mapping, ``--min-events`` and cache), and the events the
database holds are laid on top, in the order they were appended. A user's model input is
their events whose items the model knows (mapped through the checkpoint's item vocabulary),
newest ``max_events`` kept; the others are counted and left out, never an error.
"""

from __future__ import annotations

import itertools
from typing import AbstractSet, Any, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np

from tzrec_bench.data import SequenceDataset
from tzrec_bench.predict_users import history
from tzrec_bench.service.store import StoredEvent
from tzrec_gr.vocabulary import Vocabulary

__all__ = ["ModelInput", "UserHistories"]

#: a user's model input: item rows, timestamps and (when the model reads them) actions
ModelInput = Tuple[List[int], List[int], Optional[List[int]]]


class UserHistories:
    """Every user's events: the log's (read on demand) and the appended ones (in memory).

    Args:
        dataset: the run's event log as loaded for training.
        items: the model's item vocabulary (raw id -> model row).
        appended: the stored events by user (:meth:`EventStore.by_user`).
        max_events: the most events the model takes per user (the newest are kept).
    """

    def __init__(self, dataset: SequenceDataset, items: Vocabulary,
                 appended: Dict[Any, List[StoredEvent]], max_events: int) -> None:
        self.dataset = dataset
        self.items = items
        self.users = Vocabulary(dataset.user_raw_ids)
        self.max_events = int(max_events)
        self._appended: Dict[Any, List[Tuple[int, int, Optional[int]]]] = {}
        self._newest: Dict[Any, int] = {}
        for user, events in appended.items():
            self.add(user, events)
        self._popular = self._popularity()

    def parse_user(self, value: Any) -> Any:
        """The raw user id of a request's ``user``, read as the log's kind of id (``"17"``
        and ``17`` are one id, as in predict's JSON input).

        Raises:
            ValueError: an integer id outside the 64-bit range.
        """
        return _fits(self.users.parse(str(value)))

    def parse_item(self, value: Any) -> Any:
        """The raw item id of a request's item, read as the model's kind of id (ValueError:
        an integer outside the 64-bit range)."""
        return _fits(self.items.parse(str(value)))

    def log_row(self, user: Any) -> int:
        """The user's row in the log, or -1."""
        return int(self.users.rows(_id_array([user]))[0])

    def known(self, user: Any) -> bool:
        """The user has events (in the log or appended)."""
        return user in self._appended or self.log_row(user) >= 0

    def newest(self, user: Any) -> Optional[int]:
        """The time of the user's newest event (None: no event)."""
        if user in self._newest:
            return self._newest[user]
        row = self.log_row(user)
        if row < 0:
            return None
        stop = int(self.dataset.offsets[row + 1])
        start = int(self.dataset.offsets[row])
        return int(self.dataset.timestamps[stop - 1]) if stop > start else None

    def item_rows(self, raw_items: Sequence[Any]) -> List[int]:
        """The model rows of raw item ids; -1 for an item the model does not know."""
        if not len(raw_items):
            return []
        return self.items.rows(_id_array(raw_items)).tolist()

    def add(self, user: Any, events: Sequence[StoredEvent]) -> None:
        """Lay appended ``events`` (stored already) on the user's history."""
        rows = self.item_rows([e.item for e in events])
        kept = self._appended.setdefault(user, [])
        kept.extend((row, int(e.timestamp), e.action) for row, e in zip(rows, events))
        if events:
            self._newest[user] = int(events[-1].timestamp)

    def drop_newest(self, user: Any, count: int) -> None:
        """Take the user's newest ``count`` appended events off (their commit failed)."""
        kept = self._appended.get(user, [])
        del kept[len(kept) - min(count, len(kept)):]
        if kept:
            self._newest[user] = kept[-1][1]
        else:
            self._appended.pop(user, None)
            self._newest.pop(user, None)

    def older_items(self, user: Any) -> Set[int]:
        """The model rows of the user's known items that only events older than the newest
        ``max_events`` known ones hold: seen, though not in the model's input (what
        ``exclude_seen`` leaves out besides the session's cached items, as predict does)."""
        log_row = self.log_row(user)
        appended = self._appended.get(user, ())
        in_log = 0 if log_row < 0 else int(self.dataset.offsets[log_row + 1]
                                               - self.dataset.offsets[log_row])
        if in_log + len(appended) <= self.max_events:  # (cheap: most users)
            return set()
        rows: List[int] = []
        if log_row >= 0:
            rows = self.item_rows(history(self.dataset, log_row, raw_items=True)["item_ids"])
        rows.extend(row for row, _, _ in appended)
        known = [row for row in rows if row >= 0]
        return set(known[:-self.max_events]) - set(known[-self.max_events:])

    def model_input(self, user: Any) -> Optional[ModelInput]:
        """The user's events the model knows, newest ``max_events``; None when none."""
        rows: List[int] = []
        times: List[int] = []
        actions: List[Optional[int]] = []
        log_row = self.log_row(user)
        if log_row >= 0:
            record = history(self.dataset, log_row, raw_items=True)
            rows = self.item_rows(record["item_ids"])
            times = list(record["timestamps"])
            actions = list(record.get("actions") or [None] * len(rows))
        for row, timestamp, action in self._appended.get(user, ()):
            rows.append(row)
            times.append(timestamp)
            actions.append(action)
        keep = [i for i, row in enumerate(rows) if row >= 0][-self.max_events:]
        if not keep:
            return None
        kept_actions = [actions[i] for i in keep]
        return ([rows[i] for i in keep], [times[i] for i in keep],
                None if any(a is None for a in kept_actions) else kept_actions)  # type: ignore

    def _popularity(self) -> np.ndarray:
        """Model rows by their events in the log, most first (ties: smaller row)."""
        data_to_model = self.item_rows(self.dataset.item_raw_ids.tolist())
        counts = np.bincount(self.dataset.item_ids, minlength=len(data_to_model))
        by_row = np.zeros(len(self.items), dtype=np.int64)
        mapped = np.asarray(data_to_model, dtype=np.int64)
        ok = mapped >= 0
        np.add.at(by_row, mapped[ok], counts[ok])
        self._counts = by_row
        return np.lexsort((np.arange(len(by_row)), -by_row))

    def popular(self, k: int, exclude: AbstractSet[int] = frozenset()
                ) -> Tuple[List[Any], List[float]]:
        """The ``k`` most frequent items of the log not in ``exclude`` (model rows), as raw
        ids, with their share of the log's events as the score."""
        total = max(int(self._counts.sum()), 1)
        rows = (int(r) for r in self._popular)
        chosen = list(itertools.islice((r for r in rows if r not in exclude), k))
        return self.items.raw(chosen), [float(self._counts[r]) / total for r in chosen]

    @property
    def appended_users(self) -> int:
        """Users with appended events."""
        return len(self._appended)


def _fits(raw: Any) -> Any:
    if isinstance(raw, int) and not -2**63 <= raw < 2**63:
        raise ValueError("integer ids must fit in 64 bits")
    return raw


def _id_array(raw: Sequence[Any]) -> np.ndarray:
    """Raw ids as an int64 array when all are integers, else as objects (which the
    vocabulary reads one by one)."""
    if all(isinstance(i, int) and not isinstance(i, bool) for i in raw):
        return np.asarray(list(raw), dtype=np.int64)
    return np.asarray(list(raw), dtype=object)
