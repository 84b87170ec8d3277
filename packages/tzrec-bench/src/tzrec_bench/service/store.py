"""The service's events in SQLite (the standard library's ``sqlite3``).

One table of appended events, in arrival order, and one of facts about the database (which
data it was made for). The journal is in WAL mode with ``synchronous=FULL``: an append is
committed, and so on disk, before it is reported done, which is before the service
acknowledges it; a killed process (``kill -9``) loses no acknowledged event.

Appends come two ways: :meth:`EventStore.append` commits on the caller's thread;
:meth:`EventStore.submit` hands the events to the store's writer thread, which commits all
the submissions waiting at that moment in one transaction (one fsync for the group: group
commit) on its own connection, and answers each submission's future after the commit. The
service's batcher submits, so scoring never waits behind a disk write. Submissions are
committed in the order submitted; a failed commit fails its group and every later
submission (the store is then :attr:`~EventStore.failed`: the service wants a restart).

Raw ids (integers or strings) are stored as JSON text, so ``17`` and ``"17"`` stay apart.
"""

from __future__ import annotations

import json
import queue
import sqlite3
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from tzrec_bench.service.batcher import Overloaded

__all__ = ["EventStore", "StoreFailed", "StoredEvent", "StoreMismatch"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    user TEXT NOT NULL,
    item TEXT NOT NULL,
    timestamp INTEGER NOT NULL,
    action INTEGER
);
CREATE INDEX IF NOT EXISTS events_by_user ON events (user, seq);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


class StoreMismatch(ValueError):
    """The database was made for other data than the service reads."""


class StoreFailed(RuntimeError):
    """A commit failed earlier: the store takes no more events until the service restarts."""


@dataclass(frozen=True)
class StoredEvent:
    """One appended event: its user's and item's raw ids, its time and action bitmask."""

    user: Any
    item: Any
    timestamp: int
    action: Optional[int] = None


class EventStore:
    """Appended events in a SQLite file (``":memory:"``: in memory, for tests).

    Args:
        path: the database file (created with its folder's parent existing).
        data_fingerprint: what identifies the event log (its fingerprint); a database made
            for another log is refused (:class:`StoreMismatch`), as its events would follow
            other histories. Empty: no check.
        max_pending: the most submissions waiting for the writer; more are refused
            (:class:`~tzrec_bench.service.batcher.Overloaded`).

    Attributes:
        on_commit: called on the writer thread with ``(events, seconds)`` after each group
            commit (None: not told).
        committed: events committed since opening.

    Safe to call from several threads. Reads take one connection behind a lock; the writer
    thread (started at the first :meth:`submit`) writes through a second one, so WAL lets
    reads go on during its commits (an in-memory database has one connection for both).
    """

    def __init__(self, path: Union[str, Path], data_fingerprint: str = "",
                 max_pending: int = 4096) -> None:
        self.path = str(path)
        if self.path != ":memory:" and not Path(self.path).parent.is_dir():
            raise FileNotFoundError(f"--db: no folder {Path(self.path).parent} for {self.path}")
        self._lock = threading.Lock()
        self._db = self._connect()
        try:
            self._db.executescript(_SCHEMA)
            self._check_fingerprint(data_fingerprint)
        except BaseException:
            self._db.close()  # a refused database is not left open
            raise
        if self.path == ":memory:":
            self._write_db, self._write_lock = self._db, self._lock
        else:
            self._write_db, self._write_lock = self._connect(), threading.Lock()
        self.max_pending = max_pending
        self.on_commit: Optional[Callable[[int, float], None]] = None
        self.committed = 0
        self._pending: "queue.Queue[Optional[Tuple[List[tuple], Future]]]" = queue.Queue()
        self._writer: Optional[threading.Thread] = None
        self._failure: Optional[BaseException] = None

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        return db

    def _check_fingerprint(self, fingerprint: str) -> None:
        row = self._db.execute("SELECT value FROM meta WHERE key = 'data'").fetchone()
        if row is None:
            with self._lock:
                self._db.execute("INSERT INTO meta VALUES ('data', ?)", (fingerprint,))
        elif fingerprint and row[0] and row[0] != fingerprint:
            raise StoreMismatch(
                f"--db: {self.path} holds events for other data (fingerprint {row[0]}, this "
                f"log's is {fingerprint}); give another --db"
            )

    @staticmethod
    def _rows(events: Sequence[StoredEvent]) -> List[tuple]:
        return [(json.dumps(e.user), json.dumps(e.item), int(e.timestamp), e.action)
                for e in events]

    def _commit(self, rows: List[tuple]) -> None:
        """Insert ``rows`` in one transaction on the write connection."""
        with self._write_lock:
            self._write_db.execute("BEGIN IMMEDIATE")
            try:
                self._write_db.executemany(
                    "INSERT INTO events (user, item, timestamp, action) VALUES (?, ?, ?, ?)", rows)
            except BaseException:
                self._write_db.execute("ROLLBACK")
                raise
            self._write_db.execute("COMMIT")
        self.committed += len(rows)

    def append(self, events: Sequence[StoredEvent]) -> int:
        """Append ``events`` in one transaction, committed before returning; their count.
        (Not to be mixed with :meth:`submit` where order between the two matters.)"""
        rows = self._rows(events)
        self._commit(rows)
        return len(rows)

    def submit(self, events: Sequence[StoredEvent]) -> "Future[int]":
        """Hand ``events`` to the writer; the future is their count once committed.

        Raises:
            Overloaded: ``max_pending`` submissions are waiting already.
            StoreFailed: a commit failed earlier.
            TypeError: an id that is not JSON (before anything is queued).
        """
        if self._failure is not None:
            raise StoreFailed(f"--db {self.path}: a commit failed ({self._failure}); "
                              "restart the service") from self._failure
        if self._pending.qsize() >= self.max_pending:
            raise Overloaded(f"{self.max_pending} appends are waiting for the database")
        future: "Future[int]" = Future()
        self._pending.put((self._rows(events), future))
        if self._writer is None:
            self._writer = threading.Thread(target=self._write, name="tzrec-store-writer",
                                            daemon=True)
            self._writer.start()
        return future

    @property
    def failed(self) -> bool:
        """A commit failed: the store takes no more events."""
        return self._failure is not None

    def _write(self) -> None:
        """The writer thread: commit every submission waiting, as one transaction, answer
        them, repeat; ends at the None that :meth:`close` queues."""
        while True:
            first = self._pending.get()
            if first is None:
                return
            group = [first]
            done = False
            while True:  # what waits now joins the group (never waits for more)
                try:
                    item = self._pending.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    done = True
                    break
                group.append(item)
            self._settle(group)
            if done:
                return

    def _settle(self, group: List[Tuple[List[tuple], Future]]) -> None:
        started = time.perf_counter()
        rows = [row for part, _ in group for row in part]
        try:
            if self._failure is not None:
                raise StoreFailed(f"--db {self.path}: a commit failed ({self._failure}); "
                                  "restart the service")
            if rows:  # (a flush's marker alone has none)
                self._commit(rows)
        except Exception as exc:
            if self._failure is None:
                self._failure = exc
            for _, future in group:
                future.set_exception(exc)
            return
        if self.on_commit is not None:
            self.on_commit(len(rows), time.perf_counter() - started)
        for part, future in group:
            future.set_result(len(part))

    def flush(self) -> None:
        """Wait until every submission so far is settled (committed or failed)."""
        if self._writer is not None:
            marker: "Future[int]" = Future()
            self._pending.put(([], marker))
            marker.exception()

    def events(self) -> Iterator[StoredEvent]:
        """Every stored event, in the order appended."""
        with self._lock:
            rows = self._db.execute(
                "SELECT user, item, timestamp, action FROM events ORDER BY seq").fetchall()
        for user, item, timestamp, action in rows:
            yield StoredEvent(json.loads(user), json.loads(item), int(timestamp), action)

    def by_user(self) -> Dict[Any, List[StoredEvent]]:
        """Every stored event grouped by user (a list per user, in the order appended)."""
        grouped: Dict[Any, List[StoredEvent]] = {}
        for event in self.events():
            grouped.setdefault(event.user, []).append(event)
        return grouped

    def count(self) -> int:
        """How many events are stored."""
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM events").fetchone()[0])

    def close(self) -> None:
        """Commit what was submitted, stop the writer and close the connections."""
        if self._writer is not None:
            self._pending.put(None)
            self._writer.join()
            self._writer = None
        with self._write_lock:
            if self._write_db is not self._db:
                self._write_db.close()
        with self._lock:
            self._db.close()
