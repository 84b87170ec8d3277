"""The service's events in SQLite (the standard library's ``sqlite3``).

One table of appended events, in arrival order, and one of facts about the database (which
data it was made for). The journal is in WAL mode with ``synchronous=FULL``: an append is
committed, and so on disk, before :meth:`EventStore.append` returns, which is before the
service acknowledges it; a killed process (``kill -9``) loses no acknowledged event.

Raw ids (integers or strings) are stored as JSON text, so ``17`` and ``"17"`` stay apart.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

__all__ = ["EventStore", "StoredEvent", "StoreMismatch"]

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

    Safe to call from several threads (one connection behind a lock).
    """

    def __init__(self, path: Union[str, Path], data_fingerprint: str = "") -> None:
        self.path = str(path)
        if self.path != ":memory:" and not Path(self.path).parent.is_dir():
            raise FileNotFoundError(f"--db: no folder {Path(self.path).parent} for {self.path}")
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        self._check_fingerprint(data_fingerprint)

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

    def append(self, events: Sequence[StoredEvent]) -> int:
        """Append ``events`` in one transaction, committed before returning; their count."""
        rows = [(json.dumps(e.user), json.dumps(e.item), int(e.timestamp), e.action)
                for e in events]
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.executemany(
                    "INSERT INTO events (user, item, timestamp, action) VALUES (?, ?, ?, ?)", rows)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
        return len(rows)

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
        """Close the connection (every append is committed already)."""
        with self._lock:
            self._db.close()
