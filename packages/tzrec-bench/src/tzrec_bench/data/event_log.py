"""Any interaction log as a data set: Parquet, CSV, JSONL or ``user item`` text, a file or a
folder of files, streamed by pyarrow into a memory-mapped cache entry.

One event per row. The columns are found by name (:class:`Columns`, ``--columns``)::

    user     the user's id          integers or strings            required
    item     the item's id          integers or strings            required
    time     when                   integers (Unix seconds), or    optional: without it, the
                                    Parquet/JSON timestamps/dates  file order is the time order
    rating   an explicit rating     numbers                        optional
    action   an action bitmask      integers                       optional

Other columns are ignored. Formats go by suffix, each optionally gzip-compressed (``.gz``):
``.parquet``/``.pq``, ``.csv`` (a header row names the columns), ``.jsonl``/``.ndjson``/
``.json`` (one object per line) and ``.txt``/``.tsv``-less text (``user item [time]`` per
line, separated by spaces or tabs, no header: the columns are called ``user``, ``item`` and
``time``). A folder is read file by file in the order of the files' names, each file in
row order: that is the *file order*. Events are grouped by user and sorted by time; ties (and
every event without a time column) keep the file order. Ids in CSV and text are read as
text: a column whose every value is a canonical integer (``"42"``, not ``"042"``) holds
integer ids, any other holds string ids.

Reading takes two passes over the files in record batches (no per-event Python loop, no
full in-memory copy): the first checks every value and collects the distinct users and
items (their sorted ids become rows ``0..U-1`` and ``0..I-1``), the second writes each
event's rows into temporary files; then the events are grouped by user with a counting sort
into the entry's memory-mapped arrays, chunk by chunk, and sorted by time within each user.
An optional k-core filter (``min_events``) first drops, repeatedly, the users and items
with fewer than ``min_events`` events. Errors name the file, the row (the first data row is
1) and the column.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.dataset as pads

from tzrec_bench.data.cache import seal
from tzrec_bench.data.dataset import SequenceDataset
from tzrec_bench.data.text_format import DataFormatError

#: file suffix (before an optional .gz) -> format
FORMATS = {
    ".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".jsonl": "json",
    ".ndjson": "json", ".json": "json", ".txt": "text",
}
TEXT_COLUMNS = ("user", "item", "time")
BATCH_ROWS = 1 << 19  # rows per record batch read
CHUNK = 1 << 20  # events per chunk when grouping (a few tens of MB of temporaries)
_INT64 = np.iinfo(np.int64)


@dataclass(frozen=True)
class Columns:
    """Which column of the log holds what; ``None`` for a column the log does not have.

    Defaults: ``user_id``, ``item_id``, ``timestamp`` (optional: used when present), no
    rating, no action. Text files (``.txt``) always use ``user``, ``item``, ``time``.
    """

    user: str = "user_id"
    item: str = "item_id"
    time: Optional[str] = "timestamp"
    rating: Optional[str] = None
    action: Optional[str] = None

    @classmethod
    def parse(cls, text: Optional[str]) -> "Columns":
        """``"user=uid,item=sku,time=ts"``: keys ``user``, ``item``, ``time``, ``rating``,
        ``action``; unnamed keys keep their defaults; ``time=`` (empty) means no time column.

        Raises:
            ValueError: an unknown key or a malformed pair, naming it.
        """
        if not text:
            return cls()
        keys = [f.name for f in fields(cls)]
        values: Dict[str, Optional[str]] = {}
        for pair in text.split(","):
            key, sep, value = pair.partition("=")
            key = key.strip()
            if not sep or key not in keys:
                raise ValueError(
                    f"--columns: {pair!r} is not KEY=COLUMN with KEY one of {', '.join(keys)}"
                )
            if key in values:
                raise ValueError(f"--columns: {key} given twice")
            value = value.strip()
            if not value and key in ("user", "item"):
                raise ValueError(f"--columns: {key} needs a column name")
            values[key] = value or None
        return cls(**values)

    def text(self) -> str:
        """The ``--columns`` text that :meth:`parse` reads back."""
        return ",".join(f"{f.name}={getattr(self, f.name) or ''}" for f in fields(self))


def _format_of(path: Path) -> Optional[str]:
    suffixes = path.suffixes[-2:] if path.suffix == ".gz" else path.suffixes[-1:]
    return FORMATS.get(suffixes[0].lower()) if suffixes else None


def find_files(path: Path) -> List[Path]:
    """The log's files: ``path`` itself, or the files of a folder (recursively) whose
    suffix names a format, sorted by name.

    Raises:
        FileNotFoundError: no such path, or a folder with no readable file, naming it.
        DataFormatError: a file whose suffix names no format.
    """
    if path.is_file():
        if _format_of(path) is None:
            raise DataFormatError(
                f"{path}: unknown format; expected a file ending in "
                f"{', '.join(FORMATS)} (optionally .gz)"
            )
        return [path]
    if path.is_dir():
        found = sorted(p for p in path.rglob("*") if p.is_file() and _format_of(p) is not None
                       and not p.name.startswith((".", "_")))
        if found:
            return found
        raise FileNotFoundError(f"{path}: no file ending in {', '.join(FORMATS)} (optionally "
                                ".gz) in this folder")
    raise FileNotFoundError(f"no such file or folder: {path}")


# -- reading record batches ------------------------------------------------------------------


@dataclass
class _Batch:
    """One record batch's events, standardised, with its first row's number in its file."""

    path: Path
    first_row: int
    user: pa.Array
    item: pa.Array
    time: Optional[pa.Array]
    rating: Optional[pa.Array]
    action: Optional[pa.Array]


def _wanted(columns: Columns, fmt: str) -> Dict[str, str]:
    """role -> column name in a file of format ``fmt``."""
    if fmt == "text":
        return {"user": "user", "item": "item", "time": "time"}
    return {role: getattr(columns, role) for role in ("user", "item", "time", "rating",
                                                       "action") if getattr(columns, role)}


def _arrow_error(path: Path, exc: Exception, names: Sequence[str]) -> DataFormatError:
    """pyarrow's message made to name the file, the line and the column."""
    text = str(exc).split(": ", 1)[-1] if "Could not open" in str(exc) else str(exc)
    text = re.sub(r"^.*?(In CSV column|CSV parse error|JSON parse error)", r"\1", text)
    match = re.search(r"In CSV column #(\d+): Row #(\d+): (.*)", text)
    if match and int(match.group(1)) < len(names):
        column, line, problem = names[int(match.group(1))], match.group(2), match.group(3)
        return DataFormatError(f"{path}: line {line}, column {column!r}: {problem}")
    match = re.search(r"Row #(\d+): (.*)", text)
    if match:
        return DataFormatError(f"{path}: line {match.group(1)}: {match.group(2)}")
    return DataFormatError(f"{path}: {text}")


def _dataset(path: Path, fmt: str, wanted: Dict[str, str]) -> Tuple[pads.Dataset, List[str]]:
    """A pyarrow dataset over one file, and its column names in file order."""
    if fmt == "parquet":
        dataset = pads.dataset(path, format="parquet")
    elif fmt == "json":
        dataset = pads.dataset(path, format="json")
    else:
        ids = {wanted["user"]: pa.string(), wanted["item"]: pa.string()}
        typed = {**ids, **({wanted["time"]: pa.int64()} if "time" in wanted else {}),
                 **({wanted["rating"]: pa.float64()} if "rating" in wanted else {}),
                 **({wanted["action"]: pa.int64()} if "action" in wanted else {})}
        if fmt == "text":
            names = _text_names(path)
            typed = {name: typed[name] for name in names}
            read = pacsv.ReadOptions(column_names=names)
            parse = pacsv.ParseOptions(delimiter=_text_delimiter(path))
        else:
            read, parse = pacsv.ReadOptions(), pacsv.ParseOptions()
        dataset = pads.dataset(path, format=pads.CsvFileFormat(
            read_options=read, parse_options=parse,
            convert_options=pacsv.ConvertOptions(column_types=typed, strings_can_be_null=False),
        ))
    return dataset, dataset.schema.names


def _open_text_head(path: Path) -> str:
    import gzip

    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8", errors="replace") as f:
            return f.readline()
    except (OSError, EOFError) as exc:
        raise DataFormatError(f"{path}: cannot be read ({type(exc).__name__}: {exc})") from exc


def _text_delimiter(path: Path) -> str:
    return "\t" if "\t" in _open_text_head(path) else " "


def _text_names(path: Path) -> List[str]:
    line = _open_text_head(path).strip()
    count = len(line.split()) if line else 0
    if count not in (2, 3):
        raise DataFormatError(
            f"{path}: line 1: {count} fields; expected 'user item' or 'user item time' per "
            "line, separated by spaces or tabs"
        )
    return list(TEXT_COLUMNS[:count])


def _batches(path: Path, columns: Columns) -> Iterator[_Batch]:
    """The file's events in record batches, columns checked to exist."""
    fmt = _format_of(path)
    wanted = _wanted(columns, fmt)
    try:
        dataset, names = _dataset(path, fmt, wanted)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OSError) as exc:
        # pyarrow reads the first block to build the dataset: its errors name columns by index
        header = (_text_names(path) if fmt == "text" else
                  [name.strip().strip('"') for name in _open_text_head(path).split(",")]
                  if fmt == "csv" else [])
        raise _arrow_error(path, exc, header) from exc
    optional_time = fmt != "text" and columns.time == Columns.time
    missing = [f"{role} ({name!r})" for role, name in wanted.items()
               if name not in names and not (role == "time" and (optional_time or fmt == "text"))]
    if missing:
        raise DataFormatError(
            f"{path}: no column for {', '.join(missing)}; its columns are "
            f"{', '.join(names)} (map them with --columns user=...,item=...,time=...)"
        )
    present = {role: name for role, name in wanted.items() if name in names}
    # little read-ahead: the batches are consumed one at a time, and memory stays flat
    scanner = dataset.scanner(columns=list(present.values()), batch_size=BATCH_ROWS,
                              batch_readahead=1, fragment_readahead=1)
    row = 1
    try:
        for batch in scanner.to_batches():
            if not batch.num_rows:
                continue
            get = {role: batch.column(name) for role, name in present.items()}
            yield _Batch(path, row, get["user"], get["item"], get.get("time"),
                         get.get("rating"), get.get("action"))
            row += batch.num_rows
    except (pa.ArrowInvalid, pa.ArrowTypeError, OSError, EOFError) as exc:
        raise _arrow_error(path, exc, names) from exc


# -- checking values -------------------------------------------------------------------------


def _where(batch: _Batch, index: int, role: str, name: str) -> str:
    return f"{batch.path}: row {batch.first_row + index}, column {name!r}"


def _first_null(array: pa.Array) -> Optional[int]:
    if not array.null_count:
        return None
    return int(np.flatnonzero(~np.asarray(array.is_valid()))[0])


def _id_kind(array: pa.Array) -> Optional[str]:
    if pa.types.is_dictionary(array.type):
        return _id_kind(array.dictionary)
    if pa.types.is_integer(array.type):
        return "int"
    if pa.types.is_string(array.type) or pa.types.is_large_string(array.type):
        return "str"
    return None


def _plain(array: pa.Array) -> pa.Array:
    if pa.types.is_dictionary(array.type):
        array = array.dictionary_decode()
    if pa.types.is_large_string(array.type):
        array = array.cast(pa.string())
    return array


def _checked_ids(batch: _Batch, role: str, name: str) -> pa.Array:
    array = getattr(batch, role)
    null = _first_null(array)
    if null is not None:
        raise DataFormatError(f"{_where(batch, null, role, name)}: empty; every event needs "
                              f"a {role} id")
    kind = _id_kind(array)
    if kind is None:
        raise DataFormatError(f"{batch.path}: column {name!r} holds {array.type} values; "
                              f"expected {role} ids that are integers or strings")
    array = _plain(array)
    if pa.types.is_uint64(array.type):
        too_big = np.flatnonzero(np.asarray(array) > _INT64.max)
        if len(too_big):
            raise DataFormatError(f"{_where(batch, int(too_big[0]), role, name)}: "
                                  f"{array[int(too_big[0])]} does not fit in int64")
    return array.cast(pa.int64()) if kind == "int" else array


def _checked_time(batch: _Batch, name: str) -> np.ndarray:
    array = batch.time
    null = _first_null(array)
    if null is not None:
        raise DataFormatError(f"{_where(batch, null, 'time', name)}: empty; every event needs "
                              "a time (or map no time column: --columns time=)")
    if pa.types.is_timestamp(array.type):
        seconds = array.cast(pa.int64()).to_numpy() // {"s": 1, "ms": 10**3, "us": 10**6,
                                                         "ns": 10**9}[array.type.unit]
        return seconds.astype(np.int64)
    if pa.types.is_date(array.type):
        return array.cast(pa.date32()).cast(pa.int32()).to_numpy().astype(np.int64) * 86_400
    if pa.types.is_integer(array.type):
        values = array.to_numpy()
        if values.dtype == np.uint64 and len(values) and values.max() > _INT64.max:
            bad = int(np.flatnonzero(values > _INT64.max)[0])
            raise DataFormatError(f"{_where(batch, bad, 'time', name)}: {values[bad]} does "
                                  "not fit in int64")
        return values.astype(np.int64)
    raise DataFormatError(f"{batch.path}: column {name!r} holds {array.type} values; "
                          "expected times as integer Unix seconds, timestamps or dates")


def _checked_numbers(batch: _Batch, role: str, name: str, dtype: type) -> np.ndarray:
    array = getattr(batch, role)
    null = _first_null(array)
    if null is not None:
        raise DataFormatError(f"{_where(batch, null, role, name)}: empty")
    integer = pa.types.is_integer(array.type)
    if not (integer or (dtype is np.float32 and pa.types.is_floating(array.type))):
        raise DataFormatError(f"{batch.path}: column {name!r} holds {array.type} values; "
                              f"expected {'integers' if dtype is np.int64 else 'numbers'}")
    values = array.to_numpy()
    if values.dtype == np.uint64 and len(values) and values.max() > _INT64.max:
        bad = int(np.flatnonzero(values > _INT64.max)[0])
        raise DataFormatError(f"{_where(batch, bad, role, name)}: {values[bad]} does not fit "
                              "in int64")
    return values.astype(dtype)


def _canonical_ints(strings: pa.Array) -> bool:
    """Whether every string is an integer written the one way ``str(int)`` writes it."""
    matched = pc.match_substring_regex(strings, r"^(0|-?[1-9][0-9]{0,18})$")
    if not pc.all(matched).as_py():
        return False
    return bool(pc.all(pc.equal(pc.cast(pc.cast(strings, pa.int64()), pa.string()),
                                strings)).as_py())


# -- the two passes --------------------------------------------------------------------------


class _IdCollector:
    """The distinct ids of one role over every batch, and their kind."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.kind: Optional[str] = None
        self.first_path: Optional[Path] = None
        self.parts: List[pa.Array] = []
        self.size = 0

    def add(self, batch: _Batch, array: pa.Array) -> None:
        kind = "int" if pa.types.is_integer(array.type) else "str"
        if self.kind is None:
            self.kind, self.first_path = kind, batch.path
        elif kind != self.kind:
            raise DataFormatError(
                f"{batch.path}: {self.role} ids are {kind}s here but {self.kind}s in "
                f"{self.first_path}; every file must use one kind of {self.role} id"
            )
        self.parts.append(pc.unique(array))
        self.size += len(self.parts[-1])
        if self.size > 4 * BATCH_ROWS and len(self.parts) > 1:  # keep the lists short
            self.parts = [pc.unique(pa.concat_arrays(self.parts))]
            self.size = len(self.parts[0])

    def vocabulary(self, text_ids: bool) -> pa.Array:
        """The sorted distinct ids: integers, strings, or (``text_ids``: read as text from
        CSV/text files) integers when every one is a canonical integer."""
        ids = pc.unique(pa.concat_arrays(self.parts)) if self.parts else pa.array([], pa.int64())
        if self.kind == "str" and text_ids and len(ids) and _canonical_ints(ids):
            ids = pc.cast(ids, pa.int64())
        return ids.take(pc.sort_indices(ids))


def _numpy_ids(ids: pa.Array) -> np.ndarray:
    """Sorted ids as int64 or a numpy str array (what ``.npy`` maps without pickling)."""
    if pa.types.is_integer(ids.type):
        return ids.to_numpy().astype(np.int64)
    return ids.to_numpy(zero_copy_only=False).astype(np.str_)


class _Spool:
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


def _codes(array: pa.Array, vocabulary: pa.Array) -> np.ndarray:
    """Each id's row in the sorted ``vocabulary`` (every id is in it)."""
    if pa.types.is_integer(vocabulary.type):
        values = array if pa.types.is_integer(array.type) else pc.cast(array, pa.int64())
        return np.searchsorted(vocabulary.to_numpy(), values.to_numpy()).astype(np.int64)
    return pc.index_in(array, value_set=vocabulary).to_numpy().astype(np.int64)


@dataclass(frozen=True)
class ReadOptions:
    """How a log is read: its column mapping and the k-core filter (0: none)."""

    columns: Columns = Columns()
    min_events: int = 0


def write_event_log(folder: Path, name: str, files: Sequence[Path], options: ReadOptions,
                    describe: str) -> None:
    """Reads ``files`` into a cache entry in ``folder`` (see the module docstring).

    Raises:
        DataFormatError: a file that cannot be read, a missing column, an empty or
            ill-typed value, ids of two kinds; naming the file, row and column.
    """
    columns = options.columns
    users, items = _IdCollector("user"), _IdCollector("item")
    text_ids = {"user": False, "item": False}
    has = {"time": None, "rating": False, "action": False}
    events = 0
    for path in files:  # pass 1: check every value, collect the ids
        wanted = _wanted(columns, _format_of(path))
        file_events = 0
        for batch in _batches(path, columns):
            for collector in (users, items):
                role = collector.role
                collector.add(batch, _checked_ids(batch, role, wanted[role]))
                text_ids[role] |= _format_of(path) in ("csv", "text")
            timed = batch.time is not None
            if has["time"] is None:
                has["time"] = timed
            elif has["time"] != timed:
                raise DataFormatError(f"{path}: {'has' if timed else 'lacks'} the time column "
                                      "that the files before it "
                                      f"{'lack' if timed else 'have'}")
            if timed:
                _checked_time(batch, wanted["time"])
            for role, dtype in (("rating", np.float32), ("action", np.int64)):
                if getattr(batch, role) is not None:
                    has[role] = True
                    _checked_numbers(batch, role, wanted[role], dtype)
            file_events += len(batch.user)
        if not file_events:
            raise DataFormatError(f"{path}: no events")
        events += file_events
    user_ids, item_ids = users.vocabulary(text_ids["user"]), items.vocabulary(text_ids["item"])

    spools = {"user": _Spool(folder / "user.tmp", np.int64),
              "item": _Spool(folder / "item.tmp", np.int64),
              "time": _Spool(folder / "time.tmp", np.int64)}
    if has["rating"]:
        spools["rating"] = _Spool(folder / "rating.tmp", np.float32)
    if has["action"]:
        spools["action"] = _Spool(folder / "action.tmp", np.int64)
    for path in files:  # pass 2: each event's rows, in file order
        wanted = _wanted(columns, _format_of(path))
        for batch in _batches(path, columns):
            spools["user"].append(_codes(_plain(batch.user), user_ids))
            spools["item"].append(_codes(_plain(batch.item), item_ids))
            spools["time"].append(_checked_time(batch, wanted["time"]) if has["time"]
                                  else np.zeros(len(batch.user), np.int64))
            for role, dtype in (("rating", np.float32), ("action", np.int64)):
                if role in spools:
                    spools[role].append(_checked_numbers(batch, role, wanted[role], dtype))
    for spool in spools.values():
        spool.close()
    user_ids, item_ids = _numpy_ids(user_ids), _numpy_ids(item_ids)
    pa.default_memory_pool().release_unused()  # the batches' buffers, before grouping
    write_grouped(folder, name, spools, user_ids, item_ids,
                  options.min_events,
                  {"source": describe, "has_time": bool(has["time"]),
                   "columns": columns.text()})
    for spool in spools.values():
        spool.path.unlink()


def write_sequences(folder: Path, ds: SequenceDataset, min_events: int,
                    meta: Dict[str, object]) -> None:
    """An in-memory data set (a named set's parse) as a cache entry, through the same
    grouping and k-core filter as a log."""
    spools = {"user": _Spool(folder / "user.tmp", np.int64),
              "item": _Spool(folder / "item.tmp", np.int64),
              "time": _Spool(folder / "time.tmp", np.int64)}
    spools["user"].append(np.repeat(np.arange(ds.num_users, dtype=np.int64), ds.lengths))
    spools["item"].append(ds.item_ids)
    spools["time"].append(ds.timestamps)
    for role, values, dtype in (("rating", ds.ratings, np.float32),
                                ("action", ds.actions, np.int64)):
        if values is not None:
            spools[role] = _Spool(folder / f"{role}.tmp", dtype)
            spools[role].append(values)
    for spool in spools.values():
        spool.close()
    write_grouped(folder, ds.name, spools, np.asarray(ds.user_raw_ids),
                  np.asarray(ds.item_raw_ids), min_events, meta)
    for spool in spools.values():
        spool.path.unlink()


# -- grouping --------------------------------------------------------------------------------


def _counts(spool: "_Spool", keep: np.ndarray, size: int) -> np.ndarray:
    total = np.zeros(size, dtype=np.int64)
    for start, codes in spool.chunks():
        total += np.bincount(codes[keep[start:start + len(codes)]], minlength=size)
    return total


def _k_core(spools: Dict[str, "_Spool"], num_users: int, num_items: int,
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


def write_grouped(folder: Path, name: str, spools: Dict[str, "_Spool"], user_ids: np.ndarray,
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
    total = int(offsets[-1])
    np.save(folder / "offsets.npy", offsets)
    np.save(folder / "users.npy", user_ids[user_kept])
    np.save(folder / "items.npy", item_ids[item_kept])
    dtypes = {"item": np.int64, "time": np.int64, "rating": np.float32, "action": np.int64}
    files = {"item": "item_ids", "time": "timestamps", "rating": "ratings", "action": "actions"}
    out = {role: np.lib.format.open_memmap(folder / f"{files[role]}.npy", mode="w+",
                                           dtype=dtypes[role], shape=(total,))
           for role in files if role in spools}
    cursor = offsets[:-1].copy()
    readers = {role: spools[role].chunks() for role in out}
    for start, users in spools["user"].chunks():
        part = keep[start:start + len(users)]
        rows = user_row[users[part]]
        order = np.argsort(rows, kind="stable")
        rows = rows[order]
        firsts = np.flatnonzero(np.concatenate([[True], rows[1:] != rows[:-1]]))
        sizes = np.diff(np.append(firsts, len(rows)))
        dest = cursor[rows] + np.arange(len(rows)) - np.repeat(firsts, sizes)
        cursor[rows[firsts]] += sizes
        for role, reader in readers.items():
            values = next(reader)[1][part][order]
            out[role][dest] = item_row[values] if role == "item" else values
    _sort_by_time(offsets, out)
    for array in out.values():
        array.flush()
    del out
    seal(folder, {"name": name, "num_items": int(item_kept.sum()), **meta})


def _sort_by_time(offsets: np.ndarray, out: Dict[str, np.ndarray]) -> None:
    """Sorts each user's events by time, stably, a chunk of users at a time."""
    times = out["time"]
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
            row = np.repeat(np.arange(last - first), lengths)
            order = np.lexsort((times[a:b], row))
            for array in out.values():
                array[a:b] = array[a:b][order]
        first = last


def options_key(options: ReadOptions) -> str:
    """The reading options as text, for the cache key."""
    return json.dumps({"columns": options.columns.text(), "min_events": options.min_events})
