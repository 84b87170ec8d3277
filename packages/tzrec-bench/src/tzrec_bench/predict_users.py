"""Users by their raw ids: their histories from the event log a run was trained on, read
through :func:`tzrec_bench.data.load_dataset` with the run's column mapping and
``--min-events`` (so the same cache entry as training), for ``predict --users`` and
``show --user``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from tzrec_bench.data import SequenceDataset, load_dataset
from tzrec_bench.data.load import is_named
from tzrec_bench.train.config import TrainConfig
from tzrec_gr.vocabulary import Vocabulary

__all__ = ["RunData", "UserLookup", "history", "load_run_data", "lookup_users", "read_user_ids",
           "user_records"]

_NAMED = 5  # unknown users named one by one; the rest are counted
_DEFAULTS = TrainConfig()


@dataclass(frozen=True)
class RunData:
    """A run's event log, loaded as training loaded it, and how it was described."""

    dataset: SequenceDataset
    source: str  # the log's path or data set name, and the --min-events applied, in words


def load_run_data(config: Dict[str, Any], data: Optional[str]) -> RunData:
    """The event log of a run (``config``: its saved settings), or ``data`` read with the
    run's ``--columns`` and ``--min-events`` (a named data set: no column mapping).

    Raises:
        FileNotFoundError: no log at the path (the saved one: naming ``--data``);
        DataFormatError: as :func:`load_dataset`; ValueError: no data given and none saved.
    """
    def saved(key: str) -> Any:
        return config.get(key, getattr(_DEFAULTS, key))

    name = data if data is not None else saved("data")
    if not name:
        raise ValueError("--data: the checkpoint names no data; give the event log")
    if not is_named(name) and not Path(name).exists():
        where = "--data" if data is not None else "the run's --data (give --data LOG)"
        raise FileNotFoundError(f"{where}: no event log at {name}")
    min_events = int(saved("min_events") or 0)
    options: Dict[str, Any] = {}
    if name == "synthetic":
        options = {"num_users": saved("synthetic_users"), "num_items": saved("synthetic_items")}
    named = is_named(name)
    dataset = load_dataset(
        name,
        saved("data_dir") if named and name == saved("data") else None,
        saved("cache_dir"),
        int(saved("seed")),
        columns=None if named else saved("columns"),
        min_events=min_events,
        **options,
    )
    rule = f" after --min-events {min_events}" if min_events > 1 else ""
    return RunData(dataset, f"{name}{rule}")


def read_user_ids(users: Optional[str], users_file: Optional[str]) -> List[str]:
    """The ids of ``--users A,B,C`` or of ``--users-file F`` (one id a line, blank lines
    skipped), as text.

    Raises:
        ValueError: no id at all, naming the option; FileNotFoundError: no file.
    """
    if users_file is not None:
        path = Path(users_file)
        if not path.is_file():
            raise FileNotFoundError(f"--users-file: no file at {path}")
        ids = [line.strip() for line in path.read_text(encoding="utf-8-sig").splitlines()]
        option = "--users-file"
    else:
        ids = [part.strip() for part in (users or "").split(",")]
        option = "--users"
    ids = [i for i in ids if i]
    if not ids:
        raise ValueError(f"{option}: no user id given")
    return ids


@dataclass(frozen=True)
class UserLookup:
    """Raw user ids looked up in a data set: the rows of those it holds, and the others."""

    found: List[Tuple[Any, int]]  # (raw id, row), in the order asked
    unknown: List[str]

    def unknown_line(self, source: str) -> str:
        """``2 of 5 users are not in LOG: 'a', 'b'`` (the first few named)."""
        shown = ", ".join(repr(u) for u in self.unknown[:_NAMED])
        more = f" and {len(self.unknown) - _NAMED} more" if len(self.unknown) > _NAMED else ""
        total = len(self.unknown) + len(self.found)
        return f"{len(self.unknown)} of {total} users are not in {source}: {shown}{more}"


def lookup_users(dataset: SequenceDataset, ids: Sequence[str]) -> UserLookup:
    """The rows of the users ``ids`` (text, read as the log's kind of user id)."""
    users = Vocabulary(dataset.user_raw_ids)
    raw = [users.parse(i) for i in ids]
    rows = users.rows(_as_array(raw)).tolist() if raw else []
    found = [(r, row) for r, row in zip(raw, rows) if row >= 0]
    return UserLookup(found, [text for text, row in zip(ids, rows) if row < 0])


def _as_array(raw: List[Any]) -> np.ndarray:
    if all(isinstance(r, int) for r in raw):
        return np.asarray(raw, dtype=np.int64)
    return np.asarray(raw, dtype=object)


def history(dataset: SequenceDataset, row: int, raw_items: bool = True) -> Dict[str, Any]:
    """A user's record as predict reads it: ``item_ids`` (raw ids, or the data set's item
    rows) and ``timestamps``, oldest first (and ``actions`` when the log has them)."""
    start, stop = int(dataset.offsets[row]), int(dataset.offsets[row + 1])
    items = dataset.item_ids[start:stop]
    record: Dict[str, Any] = {
        "item_ids": dataset.item_raw_ids[items].tolist() if raw_items else items.tolist(),
        "timestamps": dataset.timestamps[start:stop].tolist(),
    }
    if dataset.actions is not None:
        record["actions"] = dataset.actions[start:stop].tolist()
    return record


def user_records(
    dataset: SequenceDataset, lookup: UserLookup, raw_items: bool
) -> Iterator[Tuple[int, Dict[str, Any]]]:
    """``(number, record)`` of each found user, numbered from 1 in the order asked."""
    for number, (user, row) in enumerate(lookup.found, start=1):
        yield number, {"user_id": user, **history(dataset, row, raw_items)}
