"""Leave-one-out split: per user, the last event is the test target, the one before it the
validation target, and the rest the training history.

For one user with events ``a b c d e`` (oldest first)::

    train       a b c
    validation  a b c  -> d
    test        a b c d  -> e

Users with fewer than 3 events would have an empty history before their validation target,
so they are not evaluated: all their events stay in ``train`` and their rows are listed in
``LeaveOneOutSplit.unevaluated``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tzrec_bench.data.dataset import SequenceDataset

MIN_EVALUATED_LENGTH = 3


@dataclass(frozen=True, eq=False)
class HeldOut:
    """One held-out target per evaluated user, with the history before it.

    Attributes:
        rows (np.ndarray): [U_e] int64, the users' rows in the split dataset.
        history (SequenceDataset): row ``i`` is user ``rows[i]``'s events before its target.
        targets (np.ndarray): [U_e] int64 dense item ids.
        target_timestamps (np.ndarray): [U_e] int64 Unix seconds.
    """

    rows: np.ndarray
    history: SequenceDataset
    targets: np.ndarray
    target_timestamps: np.ndarray

    def __len__(self) -> int:
        return len(self.rows)


@dataclass(frozen=True, eq=False)
class LeaveOneOutSplit:
    """What :func:`leave_one_out` returns.

    Attributes:
        train (SequenceDataset): every user (same rows as the source), without the two held
            out events of the evaluated ones.
        valid (HeldOut): the second-to-last event of each evaluated user.
        test (HeldOut): the last event of each evaluated user; its history includes the
            validation target.
        unevaluated (np.ndarray): [U_s] int64 rows with fewer than 3 events, kept whole in
            ``train``.
    """

    train: SequenceDataset
    valid: HeldOut
    test: HeldOut
    unevaluated: np.ndarray


def _held_out(ds: SequenceDataset, rows: np.ndarray, history_lengths: np.ndarray) -> HeldOut:
    starts = ds.offsets[rows]
    target = starts + history_lengths
    return HeldOut(
        rows=rows,
        history=ds.take(rows, starts, history_lengths),
        targets=ds.item_ids[target],
        target_timestamps=ds.timestamps[target],
    )


def leave_one_out(ds: SequenceDataset) -> LeaveOneOutSplit:
    """Split ``ds`` per user by time: see the module docstring for the layout."""
    lengths = ds.lengths
    evaluated = lengths >= MIN_EVALUATED_LENGTH
    rows = np.flatnonzero(evaluated).astype(np.int64)
    return LeaveOneOutSplit(
        train=ds.head(np.where(evaluated, lengths - 2, lengths)),
        valid=_held_out(ds, rows, lengths[rows] - 2),
        test=_held_out(ds, rows, lengths[rows] - 1),
        unevaluated=np.flatnonzero(~evaluated).astype(np.int64),
    )
