"""Jagged CPU batches of users' most recent events, in the layout tzrec-gr models take.

Legend: B = users in the batch, L = their events in total (after truncation).

For rows with 5 and 2 events and ``max_seq_len=3``, the first keeps its last 3 events::

    item_ids = [c d e | x y]      lengths = [3, 2]
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np
import torch

from tzrec_bench.data.dataset import Rows, SequenceDataset, segment_index
from tzrec_bench.data.split import HeldOut
from tzrec_ops.jagged import offsets_from_lengths


@dataclass(frozen=True, eq=False)
class SequenceBatch:
    """A batch of users' event sequences, concatenated (jagged), on the CPU.

    Attributes:
        item_ids (torch.Tensor): [L] int64 dense item ids, each user's oldest first.
        lengths (torch.Tensor): [B] int64 events per user.
        timestamps (torch.Tensor): [L] int64 Unix seconds.
        max_len (int): ``max(lengths)`` (0 for an empty batch), kept on the host.
        ratings (torch.Tensor | None): [L] float32, when the dataset has ratings.
        actions (torch.Tensor | None): [L] int64 action bitmasks, when the dataset has them.
        targets (torch.Tensor | None): [B] int64 held-out items (evaluation batches only).
        target_timestamps (torch.Tensor | None): [B] int64 their times (evaluation only).
    """

    item_ids: torch.Tensor
    lengths: torch.Tensor
    timestamps: torch.Tensor
    max_len: int
    ratings: Optional[torch.Tensor] = None
    actions: Optional[torch.Tensor] = None
    targets: Optional[torch.Tensor] = None
    target_timestamps: Optional[torch.Tensor] = None

    @property
    def offsets(self) -> torch.Tensor:
        """[B + 1] int64 where each user's events start, then L."""
        return offsets_from_lengths(self.lengths)


def make_batch(ds: SequenceDataset, rows: Rows, max_seq_len: int) -> SequenceBatch:
    """The rows ``rows`` of ``ds``, each truncated to its last ``max_seq_len`` events.

    Args:
        ds (SequenceDataset): the dataset.
        rows (Sequence[int] | np.ndarray): [B] row indices, in batch order.
        max_seq_len (int): the most events kept per user (the most recent ones).
    """
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len must be at least 1; got {max_seq_len}")
    rows = np.asarray(rows, dtype=np.int64)
    if rows.ndim != 1 or (len(rows) and (rows.min() < 0 or rows.max() >= ds.num_users)):
        raise ValueError(f"rows must be a 1-D list of rows in [0, {ds.num_users})")
    ends = ds.offsets[rows + 1]
    lengths = np.minimum(ends - ds.offsets[rows], max_seq_len)
    index = segment_index(ends - lengths, lengths)

    def gather(values: Optional[np.ndarray]) -> Optional[torch.Tensor]:
        return None if values is None else torch.from_numpy(values[index])

    return SequenceBatch(
        item_ids=torch.from_numpy(ds.item_ids[index]),
        lengths=torch.from_numpy(lengths),
        timestamps=torch.from_numpy(ds.timestamps[index]),
        max_len=int(lengths.max()) if len(lengths) else 0,
        ratings=gather(ds.ratings),
        actions=gather(ds.actions),
    )


def make_eval_batch(held_out: HeldOut, rows: Rows, max_seq_len: int) -> SequenceBatch:
    """Like :func:`make_batch` over ``held_out.history``, with the targets of those rows.

    ``rows`` index ``held_out`` (``[0, len(held_out))``), not the source dataset.
    """
    rows = np.asarray(rows, dtype=np.int64)
    batch = make_batch(held_out.history, rows, max_seq_len)
    return dataclasses.replace(
        batch,
        targets=torch.from_numpy(held_out.targets[rows]),
        target_timestamps=torch.from_numpy(held_out.target_timestamps[rows]),
    )


def row_batches(
    num_rows: int, batch_size: int, *, shuffle: bool = False, seed: int = 0
) -> Iterator[np.ndarray]:
    """``[0, num_rows)`` in chunks of ``batch_size`` (the last may be shorter), in order or
    shuffled by ``seed``."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1; got {batch_size}")
    order = np.random.default_rng(seed).permutation(num_rows) if shuffle else np.arange(num_rows)
    for start in range(0, num_rows, batch_size):
        yield order[start : start + batch_size]
