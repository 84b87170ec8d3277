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
into the entry's memory-mapped arrays, chunk by chunk, and sorted by time within each user
(:mod:`tzrec_bench.data.grouping`, with the optional k-core filter ``min_events``). Errors
name the file, the row (the first data row is 1) and the column.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.dataset as pads

from tzrec_bench.data.grouping import Spool, write_grouped
from tzrec_bench.data.text_format import DataFormatError

#: file suffix (before an optional .gz) -> format
FORMATS = {
    ".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".jsonl": "json",
    ".ndjson": "json", ".json": "json", ".txt": "text",
}
TEXT_COLUMNS = ("user", "item", "time")
BATCH_ROWS = 1 << 20  # rows per record batch read
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
        self._merge_at = 4 * BATCH_ROWS

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
        if self.size > self._merge_at and len(self.parts) > 1:  # keep the lists short
            self.parts = [pc.unique(pa.concat_arrays(self.parts))]
            self.size = len(self.parts[0])
            # merge again once as many ids again have piled up: each id is merged a
            # bounded number of times on average, however many batches repeat it
            self._merge_at = max(self._merge_at, 3 * self.size)

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

    spools = {"user": Spool(folder / "user.tmp", np.int64),
              "item": Spool(folder / "item.tmp", np.int64),
              "time": Spool(folder / "time.tmp", np.int64)}
    if has["rating"]:
        spools["rating"] = Spool(folder / "rating.tmp", np.float32)
    if has["action"]:
        spools["action"] = Spool(folder / "action.tmp", np.int64)
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
