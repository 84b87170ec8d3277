"""Preprocessed data sets cached as folders of ``.npy`` arrays, memory-mapped when loaded.

An entry is a folder ``<name>-<where>-<what>/``. ``where`` hashes the source files' paths and
the reading options (column mapping, ``min_events``); ``what`` hashes the files' contents, the
loader's version and :data:`CACHE_FORMAT`. The content is a BLAKE2 digest of the files' bytes
when they total at most :data:`DIGEST_LIMIT`, else their sizes and modification times (a
same-size edit that keeps the modification time is then not seen). Hashing costs each load
0.15 s of CPU per 100 MB (about 650 MB/s on one core of a 2-core Xeon, files in the page
cache; 220-470 MB/s of wall time with the cores shared; a cold disk adds its read time): at
most ~0.4 s at the 256 MiB limit, about what the check of the entry below costs. A changed
file or loader misses the cache; the entries of the same files and options with other
contents are then removed. It holds::

    offsets.npy     [U + 1] int64     item_ids.npy    [N] int64     timestamps.npy [N] int64
    ratings.npy     [N] float32       actions.npy     [N] int64     (when the data has them)
    users.npy       [U] raw user ids  items.npy       [I] raw item ids (int64 or str)
    meta.json       the name, counts, each file's BLAKE2 digest and the data's fingerprint

A load maps the arrays (``numpy.load(mmap_mode="r")``: no copy, the pages are read when
touched) after checking every file against its digest, read in blocks with no mapping, so an
entry truncated or damaged later (a bit flipped on disk) is built again from the source files,
never read as other numbers. The data's fingerprint is a digest of the digests: two logs with
the same events, ids and order have the same one, whatever their file names.

Concurrent loads (several jobs on one log, data-parallel ranks) are safe. An entry is built
under a file lock, ``<name>-<where>.lock`` beside the entries (``filelock``: ``flock`` on
Linux, released by the OS when its process dies; the empty file is kept, as deleting a lock
file that another process may be opening lets two processes hold it), by one process at a
time; the others say on stderr that they wait for it (up to :data:`LOCK_TIMEOUT`), then map
its entry. A build writes into a temporary folder ``<entry>.<pid>.tmp``, renamed to the entry
when complete: an entry is never seen half-written, and the folder of a process killed
half-way is never read and is removed by the next build of the same source. An entry is never
changed once published; stale or damaged ones are renamed away, under the lock, before they
are deleted, so a process that has mapped one keeps reading it (on Linux, removed files stay
readable while mapped).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, Iterator, Optional, Sequence

import numpy as np
from filelock import FileLock, Timeout

from tzrec_bench.data.dataset import SequenceDataset

CACHE_ENV = "TZREC_BENCH_CACHE"
# bumped when the entry layout changes (3: folders of memory-mapped .npy arrays)
CACHE_FORMAT = 3
META = "meta.json"
#: per-event arrays, and whether each must be there
EVENT_ARRAYS = {"item_ids": True, "timestamps": True, "ratings": False, "actions": False}
_BLOCK = 1 << 24  # bytes hashed per read
#: source files totalling at most this many bytes are keyed on a digest of their bytes, above
#: it on sizes and modification times: hashing them costs every load ~0.4 s of CPU at the
#: limit (see the module docstring), while logs larger than this are rarely edited in place
DIGEST_LIMIT = 256 << 20
#: seconds a load waits for another process building the same entry (a large log takes
#: minutes) before it gives up with a message naming the lock file
LOCK_TIMEOUT = 3600.0


class CacheLockTimeout(TimeoutError):
    """Another process held an entry's build lock for longer than the wait allowed (the
    message names the lock file and how to clear it)."""


def default_cache_dir() -> Path:
    """``$TZREC_BENCH_CACHE`` if set, else ``~/.cache/tzrec-bench``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "tzrec-bench")


def _digest(value: object) -> str:
    return hashlib.sha256(json.dumps(value).encode()).hexdigest()[:16]


def cache_path(
    cache_dir: Path, name: str, version: int, files: Sequence[Path], options: object = None,
    *, digest_limit: Optional[int] = None,
) -> Path:
    """The entry for the data set read from ``files`` by loader ``name`` at ``version`` with
    reading ``options`` (any JSON value): keyed on the files' bytes when they total at most
    ``digest_limit`` bytes (default: :data:`DIGEST_LIMIT`), else on their sizes and
    modification times."""
    limit = DIGEST_LIMIT if digest_limit is None else digest_limit
    paths = [path.resolve() for path in files]
    stats = [os.stat(path) for path in paths]
    if sum(stat.st_size for stat in stats) <= limit:
        content: list = [file_digest(path) for path in paths]
    else:
        content = [(stat.st_size, stat.st_mtime_ns) for stat in stats]
    where = _digest([[str(path) for path in paths], options])
    what = _digest([CACHE_FORMAT, version, content])
    return cache_dir / f"{name}-{where}-{what}"


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
        return None  # truncated, damaged, removed meanwhile or from an incompatible writer


def load_cached(
    path: Path, name: str, build: Callable[[Path], None], *,
    lock_timeout: Optional[float] = None,
) -> SequenceDataset:
    """The entry at ``path``, else ``build(folder)``'s: ``build`` fills an empty folder with
    the entry's arrays and ``meta.json`` (a writer that ends with :func:`seal`, such as
    :func:`~tzrec_bench.data.grouping.write_grouped`), which then becomes the entry.

    Builds hold the source's lock, so a process that finds no entry waits for one being built
    (up to ``lock_timeout`` seconds, default :data:`LOCK_TIMEOUT`) instead of building it too.
    Other entries of the same source (same name and ``where`` part: same files and options)
    are removed once the new one is in place.

    Raises:
        CacheLockTimeout: another process held the lock for ``lock_timeout`` seconds.
    """
    cached = _read(path, name)
    if cached is not None:
        return cached
    path.parent.mkdir(parents=True, exist_ok=True)
    source = path.name.rsplit("-", 1)[0]
    timeout = LOCK_TIMEOUT if lock_timeout is None else lock_timeout
    with _locked(path.with_name(f"{source}.lock"), timeout):
        cached = _read(path, name)  # built by another process while this one waited
        if cached is not None:
            return cached
        # under the lock no build of this source is under way: a temporary folder is one a
        # killed process left, and an entry at ``path`` is damaged
        for leftover in path.parent.glob(f"{source}-*.tmp"):
            _remove(leftover)
        if path.exists():
            _retire(path)
        _publish(path, build)
        cached = _read(path, name)
        for stale in path.parent.glob(f"{source}-*"):
            if stale != path and stale.is_dir() and not stale.name.endswith(".tmp"):
                try:
                    _retire(stale)
                except OSError:  # not ours to move (permissions): it only takes space
                    pass
    if cached is None:  # pragma: no cover - a disk that loses what was just written
        raise OSError(f"the cache entry {path} could not be read back after writing it")
    return cached


@contextmanager
def _locked(lock_path: Path, timeout: float) -> Iterator[None]:
    """Holds ``lock_path``'s lock, saying on stderr when it has to wait for another process."""
    lock = FileLock(str(lock_path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        print(f"waiting for {lock_path}: another process is building this cache entry",
              file=sys.stderr, flush=True)
        try:
            lock.acquire(timeout=timeout)
        except Timeout:
            raise CacheLockTimeout(
                f"waited {timeout:g} s for the cache lock {lock_path}, held by another process "
                f"building the same entry: let it finish or stop it (if no process uses this "
                f"cache folder, delete {lock_path})"
            ) from None
    try:
        yield
    finally:
        lock.release()


def _publish(path: Path, build: Callable[[Path], None]) -> None:
    """Builds the entry in a temporary folder, then renames it to ``path`` (missing)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.mkdir()
    try:
        build(tmp)
        os.replace(tmp, path)  # a rename onto a missing path: atomic, the entry is whole
    finally:
        _remove(tmp)  # a failed build's


def _retire(entry: Path) -> None:
    """Removes an entry: renamed away first, so no one finds it half-deleted; processes that
    mapped its arrays keep reading them."""
    gone = entry.with_name(f"{entry.name}.{os.getpid()}.old.tmp")
    os.replace(entry, gone)
    _remove(gone)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
