"""Preprocessed datasets cached as parquet, so that a second load skips parsing and sorting.

A cache file is named ``<name>-<where>-<what>.parquet``: ``where`` hashes the source files'
paths, ``what`` hashes their sizes and modification times, the loader's version and
:data:`CACHE_FORMAT`. A changed file, or a new loader version, misses the cache; the stale file
for the same paths is then replaced. Files are written to a temporary name and renamed, so a
crash never leaves a half-written cache behind. Data pages carry CRC checksums, verified on
reading: a cache file that is truncated or damaged later (a bit flipped on disk) is parsed
again from the source files, never read as other numbers.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tzrec_bench.data.dataset import SequenceDataset

CACHE_ENV = "TZREC_BENCH_CACHE"
# bumped when the table layout below changes (2: page checksums)
CACHE_FORMAT = 2
# what reading a damaged parquet file raises: bad metadata, failed checksums or
# decompression, missing columns, columns of another type or length
_READ_ERRORS = (pa.ArrowException, OSError, EOFError, KeyError, ValueError, IndexError, TypeError)


def default_cache_dir() -> Path:
    """``$TZREC_BENCH_CACHE`` if set, else ``~/.cache/tzrec-bench``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "tzrec-bench")


def _digest(value: object) -> str:
    return hashlib.sha256(json.dumps(value).encode()).hexdigest()[:16]


def cache_path(cache_dir: Path, name: str, version: int, files: Sequence[Path]) -> Path:
    """Where the dataset read from ``files`` by loader ``name`` at ``version`` is cached."""
    paths = [str(path.resolve()) for path in files]
    stats = [(os.stat(path).st_size, os.stat(path).st_mtime_ns) for path in paths]
    return cache_dir / f"{name}-{_digest(paths)}-{_digest([CACHE_FORMAT, version, stats])}.parquet"


def to_table(ds: SequenceDataset) -> pa.Table:
    """One row per event, in the dataset's order, with raw ids beside the dense item id."""
    columns = {
        "user_raw_id": np.repeat(ds.user_raw_ids, ds.lengths),
        "item_raw_id": ds.item_raw_ids[ds.item_ids],
        "item_id": ds.item_ids,
        "timestamp": ds.timestamps,
    }
    if ds.ratings is not None:
        columns["rating"] = ds.ratings
    if ds.actions is not None:
        columns["action"] = ds.actions
    return pa.table(columns)


def from_table(name: str, table: pa.Table) -> SequenceDataset:
    """The inverse of :func:`to_table`: rows are already grouped and sorted."""
    users = table.column("user_raw_id").to_numpy()
    items = table.column("item_id").to_numpy()
    starts = np.flatnonzero(np.diff(users)) + 1  # where the user changes
    firsts = np.concatenate([[0], starts]).astype(np.int64) if len(users) else starts
    num_items = int(items.max()) + 1 if len(items) else 0
    item_raw_ids = np.zeros(num_items, dtype=np.int64)
    item_raw_ids[items] = table.column("item_raw_id").to_numpy()
    names = table.column_names
    return SequenceDataset(
        name=name,
        offsets=np.append(firsts, len(users)).astype(np.int64),
        item_ids=items,
        timestamps=table.column("timestamp").to_numpy(),
        num_items=num_items,
        item_raw_ids=item_raw_ids,
        user_raw_ids=users[firsts],
        ratings=table.column("rating").to_numpy() if "rating" in names else None,
        actions=table.column("action").to_numpy() if "action" in names else None,
    )


def load_cached(
    path: Path, name: str, build: Callable[[], SequenceDataset]
) -> SequenceDataset:
    """The dataset cached at ``path``, else ``build()``'s, written there for next time.

    An unreadable cache file is rebuilt; other cache files of the same source (same name and
    ``where`` part) are removed once the new one is written.
    """
    cached = _read(path, name)
    if cached is not None:
        return cached
    ds = build()
    path.parent.mkdir(parents=True, exist_ok=True)
    # one temporary name per process: data-parallel ranks may build the same entry at once
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        pq.write_table(to_table(ds), tmp, write_page_checksum=True)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    where = path.name.rsplit("-", 1)[0]
    for stale in path.parent.glob(f"{where}-*.parquet"):
        if stale != path:
            stale.unlink(missing_ok=True)
    return ds


def _read(path: Path, name: str) -> Optional[SequenceDataset]:
    if not path.is_file():
        return None
    try:
        return from_table(name, pq.read_table(path, page_checksum_verification=True))
    except _READ_ERRORS:
        return None  # truncated, damaged or from an incompatible writer: rebuild it
