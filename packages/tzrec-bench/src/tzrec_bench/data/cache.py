"""Preprocessed data sets cached as folders of ``.npy`` arrays, memory-mapped when loaded.

An entry is a folder ``<name>-<where>-<what>/``: ``where`` hashes the source files' paths,
``what`` hashes their sizes and modification times, the reading options (column mapping,
``min_events``), the loader's version and :data:`CACHE_FORMAT`. A changed file, option or
loader misses the cache; the stale entry for the same paths is then removed. It holds::

    offsets.npy     [U + 1] int64     item_ids.npy    [N] int64     timestamps.npy [N] int64
    ratings.npy     [N] float32       actions.npy     [N] int64     (when the data has them)
    users.npy       [U] raw user ids  items.npy       [I] raw item ids (int64 or str)
    meta.json       the name, counts, each file's BLAKE2 digest and the data's fingerprint

Entries are written into a temporary folder and renamed, so a crash never leaves a
half-written one behind; under torchrun rank 0 builds and the other ranks map the result. A
later load maps the arrays (``numpy.load(mmap_mode="r")``: no copy, the pages are read when
touched) after checking every file against its digest, read in blocks with no mapping, so an
entry truncated or damaged later (a bit flipped on disk) is built again from the source files,
never read as other numbers. The data's fingerprint is a digest of the digests: two logs with
the same events, ids and order have the same one, whatever their file names.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence

import numpy as np

from tzrec_bench.data.dataset import SequenceDataset

CACHE_ENV = "TZREC_BENCH_CACHE"
# bumped when the entry layout changes (3: folders of memory-mapped .npy arrays)
CACHE_FORMAT = 3
META = "meta.json"
#: per-event arrays, and whether each must be there
EVENT_ARRAYS = {"item_ids": True, "timestamps": True, "ratings": False, "actions": False}
_BLOCK = 1 << 24  # bytes hashed per read


def default_cache_dir() -> Path:
    """``$TZREC_BENCH_CACHE`` if set, else ``~/.cache/tzrec-bench``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "tzrec-bench")


def _digest(value: object) -> str:
    return hashlib.sha256(json.dumps(value).encode()).hexdigest()[:16]


def cache_path(
    cache_dir: Path, name: str, version: int, files: Sequence[Path], options: object = None
) -> Path:
    """The entry for the data set read from ``files`` by loader ``name`` at ``version`` with
    reading ``options`` (any JSON value)."""
    paths = [str(path.resolve()) for path in files]
    stats = [(os.stat(path).st_size, os.stat(path).st_mtime_ns) for path in paths]
    what = _digest([CACHE_FORMAT, version, stats, options])
    return cache_dir / f"{name}-{_digest(paths)}-{what}"


def file_digest(path: Path) -> str:
    """BLAKE2b of the file's bytes, read in blocks (nothing mapped into memory)."""
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def seal(folder: Path, meta: Dict[str, object]) -> str:
    """Writes ``meta.json`` with every ``.npy`` file's digest and the data's fingerprint;
    returns the fingerprint."""
    digests = {path.name: file_digest(path) for path in sorted(folder.glob("*.npy"))}
    fingerprint = hashlib.blake2b(
        json.dumps(sorted(digests.items())).encode(), digest_size=8
    ).hexdigest()
    (folder / META).write_text(
        json.dumps({**meta, "format": CACHE_FORMAT, "digests": digests,
                    "fingerprint": fingerprint}, indent=1)
    )
    return fingerprint


def _read(folder: Path, name: str) -> Optional[SequenceDataset]:
    """The entry at ``folder``, mapped, or None when it is missing, incomplete or damaged."""
    try:
        meta = json.loads((folder / META).read_text())
        digests = meta["digests"]
        if meta.get("format") != CACHE_FORMAT or not isinstance(digests, dict):
            return None
        for file_name, digest in digests.items():
            if file_digest(folder / file_name) != digest:
                return None

        def array(field: str) -> Optional[np.ndarray]:
            if f"{field}.npy" not in digests:
                return None
            return np.load(folder / f"{field}.npy", mmap_mode="r", allow_pickle=False)

        if any(array(f) is None for f in ("offsets", "users", "items", *(
                f for f, required in EVENT_ARRAYS.items() if required))):
            return None
        return SequenceDataset(
            name=name,
            offsets=array("offsets"),
            item_ids=array("item_ids"),
            timestamps=array("timestamps"),
            num_items=int(meta["num_items"]),
            item_raw_ids=array("items"),
            user_raw_ids=array("users"),
            ratings=array("ratings"),
            actions=array("actions"),
            fingerprint=str(meta["fingerprint"]),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None  # truncated, damaged or from an incompatible writer: rebuild it


def load_cached(
    path: Path, name: str, build: Callable[[Path], None]
) -> SequenceDataset:
    """The entry at ``path``, else ``build(folder)``'s: ``build`` fills an empty folder with
    the entry's arrays and ``meta.json`` (:func:`write_dataset`, or a streaming writer that
    ends with :func:`seal`), which then becomes the entry.

    Other entries of the same source (same name and ``where`` part) are removed once the new
    one is in place.
    """
    cached = _read(path, name)
    if cached is not None:
        return cached
    path.parent.mkdir(parents=True, exist_ok=True)
    # one temporary folder per process: data-parallel ranks may build the same entry at once
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        build(tmp)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    where = path.name.rsplit("-", 1)[0]
    for stale in path.parent.glob(f"{where}-*"):
        if stale != path and stale.is_dir() and not stale.name.endswith(".tmp"):
            shutil.rmtree(stale, ignore_errors=True)
    ds = _read(path, name)
    if ds is None:  # pragma: no cover - a disk that loses what was just written
        raise OSError(f"the cache entry {path} could not be read back after writing it")
    return ds
