"""Grouping spooled events by user into a cache entry: the k-core filter, a chunked counting
sort (stable: the file order is kept among a user's events), and a stable sort by time
within each user, writing the entry's memory-mapped ``.npy`` arrays.

Per-event columns arrive as :class:`Spool` files in file order (the event-log reader's
second pass, or a named data set parsed in memory); they are read back in chunks of
:data:`CHUNK` events with plain file reads, so memory holds the output's pages and a few
chunks' temporaries, never the whole log twice.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Iterator, Tuple

import numpy as np

from tzrec_bench.data.cache import seal
from tzrec_bench.data.dataset import SequenceDataset
from tzrec_bench.data.text_format import DataFormatError

CHUNK = 1 << 20  # events per chunk (a few tens of MB of temporaries)


class Spool:
    """A temporary file of one per-event column, appended to in order and read back in
    chunks with plain file reads (nothing stays mapped)."""

    def __init__(self, path: Path, dtype: type) -> None:
        self.path, self.dtype = path, np.dtype(dtype)
        self.length = 0
        self._file = open(path, "wb")

    def append(self, values: np.ndarray) -> None:
        self._file.write(np.ascontiguousarray(values, dtype=self.dtype).tobytes())
        self.length += len(values)

    def close(self) -> None:
        self._file.close()

    def chunks(self) -> Iterator[Tuple[int, np.ndarray]]:
        with open(self.path, "rb") as f:
            for start in range(0, self.length, CHUNK):
                count = min(CHUNK, self.length - start)
                yield start, np.fromfile(f, dtype=self.dtype, count=count)


def write_sequences(folder: Path, ds: SequenceDataset, min_events: int,
                    meta: Dict[str, object]) -> None:
    """An in-memory data set (a named set's parse) as a cache entry, through the same
    grouping and k-core filter as a log."""
    spools = {"user": Spool(folder / "user.tmp", np.int64),
              "item": Spool(folder / "item.tmp", np.int64),
              "time": Spool(folder / "time.tmp", np.int64)}
    spools["user"].append(np.repeat(np.arange(ds.num_users, dtype=np.int64), ds.lengths))
    spools["item"].append(ds.item_ids)
    spools["time"].append(ds.timestamps)
    for role, values, dtype in (("rating", ds.ratings, np.float32),
                                ("action", ds.actions, np.int64)):
        if values is not None:
            spools[role] = Spool(folder / f"{role}.tmp", dtype)
            spools[role].append(values)
    for spool in spools.values():
        spool.close()
    write_grouped(folder, ds.name, spools, np.asarray(ds.user_raw_ids),
                  np.asarray(ds.item_raw_ids), min_events, meta)
    for spool in spools.values():
        spool.path.unlink()


# -- grouping --------------------------------------------------------------------------------


def _counts(spool: Spool, keep: np.ndarray, size: int) -> np.ndarray:
    total = np.zeros(size, dtype=np.int64)
    for start, codes in spool.chunks():
        total += np.bincount(codes[keep[start:start + len(codes)]], minlength=size)
    return total


def _k_core(spools: Dict[str, Spool], num_users: int, num_items: int,
            min_events: int) -> np.ndarray:
    """[N] bool: the events left once users and items with fewer than ``min_events`` events
    are dropped, again and again until none is left to drop."""
    keep = np.ones(spools["user"].length, dtype=bool)
    while True:
        few_users = _counts(spools["user"], keep, num_users) < min_events
        few_items = _counts(spools["item"], keep, num_items) < min_events
        dropped = 0
        for (start, users), (_, items) in zip(spools["user"].chunks(),
                                              spools["item"].chunks()):
            part = keep[start:start + len(users)]
            drop = part & (few_users[users] | few_items[items])
            dropped += int(drop.sum())
            part &= ~drop
        if not dropped:
            return keep


def write_grouped(folder: Path, name: str, spools: Dict[str, Spool], user_ids: np.ndarray,
                  item_ids: np.ndarray, min_events: int, meta: Dict[str, object]) -> None:
    """Groups the spooled events (file order) by user, sorted by time within each user
    (stable: ties keep the file order), into the entry's ``.npy`` arrays, then seals it."""
    keep = (_k_core(spools, len(user_ids), len(item_ids), min_events) if min_events > 1
            else np.ones(spools["user"].length, dtype=bool))
    user_counts = _counts(spools["user"], keep, len(user_ids))
    item_counts = _counts(spools["item"], keep, len(item_ids))
    user_kept, item_kept = user_counts > 0, item_counts > 0
    if not user_kept.any():
        raise DataFormatError(f"{meta['source']}: no events left after the k-core filter "
                              f"(--min-events {min_events})")
    user_row = np.cumsum(user_kept) - 1
    item_row = np.cumsum(item_kept) - 1
    offsets = np.concatenate([[0], np.cumsum(user_counts[user_kept])]).astype(np.int64)
    np.save(folder / "offsets.npy", offsets)
    np.save(folder / "users.npy", user_ids[user_kept])
    np.save(folder / "items.npy", item_ids[item_kept])
    paths = {role: folder / f"{name}.npy" for role, name in (
        ("item", "item_ids"), ("time", "timestamps"), ("rating", "ratings"),
        ("action", "actions")) if role in spools}
    placed = Spool(folder / "placed.tmp", np.int64)
    _place_first(spools, keep, user_row, offsets, placed, paths["item"], item_row)
    placed.close()
    for role in paths.keys() - {"item"}:  # one output mapped at a time: half the pages
        _place(spools[role], keep, placed, paths[role])
    placed.path.unlink()
    _sort_by_time(offsets, paths)
    seal(folder, {"name": name, "num_items": int(item_kept.sum()), **meta})


def _place_first(spools: Dict[str, Spool], keep: np.ndarray, user_row: np.ndarray,
                 offsets: np.ndarray, placed: Spool, path: Path, item_row: np.ndarray) -> None:
    """The counting sort: each kept event's place in the grouped arrays (spooled to
    ``placed``, in file order), and the item column written there."""
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.int64, shape=(int(offsets[-1]),))
    cursor = offsets[:-1].copy()
    for (start, users), (_, items) in zip(spools["user"].chunks(), spools["item"].chunks()):
        part = keep[start:start + len(users)]
        rows = user_row[users[part]]
        if not len(rows):  # every event of this chunk was filtered out
            continue
        order = np.argsort(rows, kind="stable")
        rows = rows[order]
        firsts = np.flatnonzero(np.concatenate([[True], rows[1:] != rows[:-1]]))
        sizes = np.diff(np.append(firsts, len(rows)))
        where = np.empty(len(rows), dtype=np.int64)
        where[order] = cursor[rows] + np.arange(len(rows)) - np.repeat(firsts, sizes)
        cursor[rows[firsts]] += sizes
        placed.append(where)
        out[where] = item_row[items[part]]
    out.flush()


def _place(spool: Spool, keep: np.ndarray, placed: Spool, path: Path) -> None:
    """Another column written at the places :func:`_place_first` found."""
    length = int(np.count_nonzero(keep))
    out = np.lib.format.open_memmap(path, mode="w+", dtype=spool.dtype, shape=(length,))
    with open(placed.path, "rb") as places:
        for start, values in spool.chunks():
            part = keep[start:start + len(values)]
            out[np.fromfile(places, dtype=np.int64, count=int(part.sum()))] = values[part]
    out.flush()


def _sort_by_time(offsets: np.ndarray, paths: Dict[str, Path]) -> None:
    """Sorts each user's events by time, stably, a chunk of users at a time; the columns
    are mapped for writing only when some user's events are out of order."""
    times = np.load(paths["time"], mmap_mode="r")
    columns: Dict[str, np.ndarray] = {}
    first = 0
    num_users = len(offsets) - 1
    while first < num_users:
        last = max(int(np.searchsorted(offsets, offsets[first] + CHUNK, side="right")) - 1,
                   first + 1)
        last = min(last, num_users)
        a, b = int(offsets[first]), int(offsets[last])
        lengths = np.diff(offsets[first:last + 1])
        steps = np.diff(times[a:b])
        boundaries = (np.cumsum(lengths)[:-1] - 1)
        steps[boundaries[(boundaries >= 0) & (boundaries < len(steps))]] = 0
        if np.any(steps < 0):
            if not columns:
                columns = {role: np.load(path, mmap_mode="r+") for role, path in paths.items()}
            row = np.repeat(np.arange(last - first), lengths)
            order = np.lexsort((columns["time"][a:b], row))
            for array in columns.values():
                array[a:b] = array[a:b][order]
        first = last
    for array in columns.values():
        array.flush()
