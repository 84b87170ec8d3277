"""Any interaction log as a data set: Parquet, CSV, TSV, JSONL, ``user item`` text or one user a
line, a file or a folder of files, streamed by pyarrow into a memory-mapped cache entry.

One event per row. The columns are found by name (:class:`Columns`, ``--columns``)::

    user     the user's id          integers or strings            required
    item     the item's id          integers or strings            required
    time     when                   integers (Unix seconds), or    optional: without it, the
                                    Parquet/JSON timestamps/dates  file order is the time order
    rating   an explicit rating     numbers                        optional
    action   an action bitmask      integers                       optional

Other columns are ignored. Formats go by suffix, each optionally gzip-compressed (``.gz``):
``.parquet``/``.pq``; ``.csv`` and ``.tsv`` (comma- and tab-separated, a header row names
the columns); ``.jsonl``/``.ndjson``/``.json`` (JSON lines: one object per line; an object
spread over lines, such as a pretty-printed ``schema.json``, is refused); and ``.txt``
text, ``user item [time]`` per line, separated by spaces or tabs. A text log's first line
is a header when every field of it is a column name (``user``, ``item``, ``time``, or a
name of the ``--columns`` mapping, defaults included): it is skipped, and its names find
the columns as in CSV, rating and action included. Without one the columns are ``user``,
``item`` and ``time`` by position. ``.seq``: one user a line, ``user item item ...``, no
timestamps and no column mapping (:mod:`tzrec_bench.data.user_lines`).

A folder is read file by file in the order of the files' paths, each file in row order: that
is the *file order*; which files a folder's log is made of, and which folders are refused
(files of two formats, the same log twice), is :mod:`tzrec_bench.data.log_files`. Events
are grouped by user and sorted by time; ties (and every event without a time column) keep
the file order. Ids in CSV, TSV and text are read as text: a column whose every value is a
canonical integer (``"42"``, not ``"042"``) holds integer ids, any other holds string ids.
An empty id (a null, or an empty field or string) is refused in every format.

Reading takes two passes over the files in record batches (no per-event Python loop, no
full in-memory copy): the first checks every value and collects the distinct users and
items (their sorted ids become rows ``0..U-1`` and ``0..I-1``), the second writes each
event's rows into temporary files; then the events are grouped by user with a counting sort
into the entry's memory-mapped arrays, chunk by chunk, and sorted by time within each user
(:mod:`tzrec_bench.data.grouping`, with the optional k-core filter ``min_events``). Errors
name the file, the row and the column. Rows are data rows counted from 1 in every format (a
header line and blank lines are not rows); where the file's line differs, it follows:
``"row 2 (line 3)"`` (:mod:`tzrec_bench.data.log_rows`).
"""

from __future__ import annotations

import dataclasses
import re
import zlib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Dict, FrozenSet, Iterator, List, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.dataset as pads

from tzrec_bench.data.grouping import Spool, write_grouped
from tzrec_bench.data.log_files import format_of
from tzrec_bench.data.log_rows import delimited_problem, json_problem, non_blank_lines, open_text
from tzrec_bench.data.text_format import DataFormatError
from tzrec_bench.data.user_lines import FORMAT as USER_LINES
from tzrec_bench.data.user_lines import OneLinePerUser, UserLines, read_user_lines

TEXT_COLUMNS = ("user", "item", "time")
ROLES = ("user", "item", "time", "rating", "action")
BATCH_ROWS = 1 << 20  # rows per record batch read
_INT64 = np.iinfo(np.int64)


@dataclass(frozen=True)
class Columns:
    """Which column of the log holds what; ``None`` for a column the log does not have.

    Defaults: ``user_id``, ``item_id``, ``timestamp`` (optional: used when present), no
    rating, no action. Text files (``.txt``) without a header line use ``user``, ``item``,
    ``time`` by position; with one, ``user``/``item``/``time`` also name those columns.
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


# -- reading record batches ------------------------------------------------------------------


@dataclass(frozen=True)
class _Layout:
    """How one file is read: its format, each role's column name, which roles may be
    missing, and for CSV, TSV and text the delimiter, whether a header line comes first and
    (text without one) the column names."""

    fmt: str
    wanted: Dict[str, str]
    optional: FrozenSet[str] = frozenset()
    delimiter: str = ","
    header: bool = True
    names: Optional[List[str]] = None


@dataclass
class _Batch:
    """One record batch's events, standardised, with its first row's number in its file."""

    path: Path
    layout: _Layout
    first_row: int
    user: pa.Array
    item: pa.Array
    time: Optional[pa.Array]
    rating: Optional[pa.Array]
    action: Optional[pa.Array]
    user_lines: Optional[UserLines] = None  # a one-user-a-line log's block


def _first_line(path: Path) -> str:
    try:
        with open_text(path) as f:
            return f.readline()
    except (OSError, EOFError, zlib.error) as exc:
        raise DataFormatError(f"{path}: cannot be read ({type(exc).__name__}: {exc})") from exc


def _is_text_header(fields: List[str], columns: Columns) -> bool:
    """Whether a text log's first line names its columns: every field is a column name
    (``user``, ``item``, ``time``, or a name of the ``--columns`` mapping)."""
    names = {getattr(columns, role) for role in ROLES} | set(TEXT_COLUMNS)
    return len(fields) >= 2 and all(field in names for field in fields)


def _text_layout(path: Path, columns: Columns) -> _Layout:
    line = _first_line(path)
    delimiter = "\t" if "\t" in line else " "
    fields = line.split()
    optional = frozenset({"time"} if columns.time == Columns.time else ())
    if _is_text_header(fields, columns):
        wanted = {}
        for role in ROLES:
            plain = role if role in TEXT_COLUMNS else None
            found = [name for name in (getattr(columns, role), plain) if name in fields]
            if found or getattr(columns, role):
                wanted[role] = found[0] if found else getattr(columns, role)
        return _Layout("text", wanted, optional, delimiter)
    if len(fields) not in (2, 3):
        raise DataFormatError(
            f"{path}: line 1: {len(fields)} field{'s' * (len(fields) != 1)}; expected 'user "
            "item' or 'user item time' per line, separated by spaces or tabs (a first line "
            "of column names is a header; one user a line, 'user item item ...', is read "
            "from a file ending in .seq)"
        )
    mapped = [role for role in ("rating", "action") if getattr(columns, role)]
    if mapped:
        raise DataFormatError(
            f"{path}: --columns maps {', '.join(mapped)}, but a text log without a header "
            "line has only 'user item [time]'; start it with a line naming its columns"
        )
    return _Layout("text", dict(zip(TEXT_COLUMNS, TEXT_COLUMNS)), frozenset({"time"}),
                   delimiter, False, list(TEXT_COLUMNS[:len(fields)]))


def _layout(path: Path, columns: Columns, fmt: Optional[str] = None) -> _Layout:
    fmt = fmt or format_of(path)
    if fmt == "text":
        return _text_layout(path, columns)
    if fmt == USER_LINES:
        if columns != Columns():
            raise DataFormatError(f"{path}: --columns maps {columns.text()}, but a one-user-a-"
                                  "line log (.seq) has no columns to map: 'user item item ...'")
        return _Layout(fmt, {"user": "user", "item": "item"}, frozenset({"time"}), " ", False)
    wanted = {role: getattr(columns, role) for role in ROLES if getattr(columns, role)}
    optional = frozenset({"time"} if columns.time == Columns.time else ())
    return _Layout(fmt, wanted, optional, "\t" if fmt == "tsv" else ",")


def _dataset(path: Path, layout: _Layout) -> pads.Dataset:
    """A pyarrow dataset over one file."""
    if layout.fmt in ("parquet", "json"):
        return pads.dataset(path, format=layout.fmt)
    types = {"user": pa.string(), "item": pa.string(), "time": pa.int64(),
             "rating": pa.float64(), "action": pa.int64()}
    typed = {name: types[role] for role, name in layout.wanted.items()
             if layout.names is None or name in layout.names}
    read = pacsv.ReadOptions(column_names=layout.names)
    if layout.fmt == "text" and layout.header:
        read = pacsv.ReadOptions(column_names=_first_line(path).split(), skip_rows=1)
    return pads.dataset(path, format=pads.CsvFileFormat(
        read_options=read, parse_options=pacsv.ParseOptions(delimiter=layout.delimiter),
        convert_options=pacsv.ConvertOptions(column_types=typed, strings_can_be_null=False),
    ))


def _read_error(path: Path, layout: _Layout, exc: Exception) -> DataFormatError:
    """The error of a failed read, naming the first bad row found by scanning the file
    again (:mod:`tzrec_bench.data.log_rows`), else pyarrow's message without its row
    numbers (which count from 0 in JSON, and count the header in CSV)."""
    problem = None
    try:
        if layout.fmt == "json":
            problem = json_problem(path, layout.wanted)
        elif layout.fmt != "parquet":
            problem = delimited_problem(path, layout.delimiter, layout.header, layout.names,
                                        layout.wanted)
    except (OSError, EOFError, zlib.error):
        problem = None  # unreadable: pyarrow's message says why
    if problem:
        return DataFormatError(f"{path}: {problem}")
    text = str(exc).split(": ", 1)[-1] if "Could not open" in str(exc) else str(exc)
    text = re.sub(r"^.*?(In CSV column|CSV parse error|JSON parse error)", r"\1", text)
    text = re.sub(r"Row #\d+: | in row \d+", "", text)
    return DataFormatError(f"{path}: {text}")


def _user_line_batches(path: Path, layout: _Layout) -> Iterator[_Batch]:
    row = 1
    for block in read_user_lines(path):
        yield _Batch(path, layout, row, block.event_users, block.items, None, None, None, block)
        row += len(block.items)


def _batches(path: Path, columns: Columns, fmt: Optional[str] = None) -> Iterator[_Batch]:
    """The file's events in record batches, columns checked to exist; ``fmt``: the format,
    whatever the suffix (None: by the suffix)."""
    layout = _layout(path, columns, fmt)
    if layout.fmt == USER_LINES:
        yield from _user_line_batches(path, layout)
        return
    try:
        # pyarrow reads the first block to build the dataset
        dataset = _dataset(path, layout)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OSError) as exc:
        raise _read_error(path, layout, exc) from exc
    names = dataset.schema.names
    missing = [f"{role} ({name!r})" for role, name in layout.wanted.items()
               if name not in names and role not in layout.optional]
    if missing:
        problem = json_problem(path, layout.wanted) if layout.fmt == "json" else None
        if problem:  # not a JSON-lines log at all: say so rather than name a column
            raise DataFormatError(f"{path}: {problem}")
        raise DataFormatError(
            f"{path}: no column for {', '.join(missing)}; its columns are "
            f"{', '.join(names)} (map them with --columns user=...,item=...,time=...)"
        )
    present = {role: name for role, name in layout.wanted.items() if name in names}
    layout = dataclasses.replace(layout, wanted=present)
    # little read-ahead: the batches are consumed one at a time, and memory stays flat
    scanner = dataset.scanner(columns=list(present.values()), batch_size=BATCH_ROWS,
                              batch_readahead=1, fragment_readahead=1)
    row = 1
    try:
        for batch in scanner.to_batches():
            if not batch.num_rows:
                continue
            get = {role: batch.column(name) for role, name in present.items()}
            yield _Batch(path, layout, row, get["user"], get["item"], get.get("time"),
                         get.get("rating"), get.get("action"))
            row += batch.num_rows
    except (pa.ArrowInvalid, pa.ArrowTypeError, OSError, EOFError) as exc:
        raise _read_error(path, layout, exc) from exc


def _check_one_object_per_line(path: Path, rows: int, columns: Columns) -> None:
    """pyarrow reads an object spread over lines (a pretty-printed ``schema.json``) as one
    row: a JSON-lines log has as many rows as lines."""
    lines = non_blank_lines(path)
    if rows != lines:
        problem = json_problem(path, _layout(path, columns).wanted)
        raise DataFormatError(f"{path}: {problem}" if problem else
                              f"{path}: {rows} objects on {lines} lines; expected one object "
                              "per line")


# -- checking values -------------------------------------------------------------------------


def _where(batch: _Batch, index: int, role: str, name: str) -> str:
    return f"{batch.path}: row {batch.first_row + index}, column {name!r}"


def _type_error(batch: _Batch, name: str, found: pa.DataType,
                expected: str) -> DataFormatError:
    """A column of the wrong type; in JSON, where pyarrow widened a column (an integer
    beyond int64 makes it double), naming the row that did it."""
    if batch.layout.fmt == "json":
        problem = json_problem(batch.path, batch.layout.wanted)
        if problem:
            return DataFormatError(f"{batch.path}: {problem}")
    return DataFormatError(f"{batch.path}: column {name!r} holds {found} values; "
                           f"expected {expected}")


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
    kind = _id_kind(array)
    if null is None and kind == "str":  # an empty CSV or text field is an empty string
        empty = np.flatnonzero(pc.equal(_plain(array), "").to_numpy(zero_copy_only=False))
        null = int(empty[0]) if len(empty) else None
    if null is not None:
        raise DataFormatError(f"{_where(batch, null, role, name)}: empty; every event needs "
                              f"{'an' if role == 'item' else 'a'} {role} id")
    if kind is None:
        raise _type_error(batch, name, array.type, f"{role} ids that are integers or strings")
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
    raise _type_error(batch, name, array.type, "times as integer Unix seconds, timestamps or dates")


def _checked_numbers(batch: _Batch, role: str, name: str, dtype: type) -> np.ndarray:
    array = getattr(batch, role)
    null = _first_null(array)
    if null is not None:
        raise DataFormatError(f"{_where(batch, null, role, name)}: empty")
    integer = pa.types.is_integer(array.type)
    if not (integer or (dtype is np.float32 and pa.types.is_floating(array.type))):
        raise _type_error(batch, name, array.type, "integers" if dtype is np.int64 else "numbers")
    values = array.to_numpy()
    if values.dtype == np.uint64 and len(values) and values.max() > _INT64.max:
        bad = int(np.flatnonzero(values > _INT64.max)[0])
        raise DataFormatError(f"{_where(batch, bad, role, name)}: {values[bad]} does not fit "
                              "in int64")
    return values.astype(dtype)


def _canonical_ints(strings: pa.Array) -> bool:
    """Whether every string is an integer written the one way ``str(int)`` writes it, and
    fits in int64 (a larger one makes every id of its role a string)."""
    matched = pc.match_substring_regex(strings, r"^(0|-?[1-9][0-9]{0,18})$")
    if not pc.all(matched).as_py():
        return False
    try:
        integers = pc.cast(strings, pa.int64())
    except pa.ArrowInvalid:  # 19 digits beyond int64
        return False
    return bool(pc.all(pc.equal(pc.cast(integers, pa.string()), strings)).as_py())


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
    """How a log is read: its column mapping, the k-core filter (0: none) and the format of
    every file, whatever its suffix (None: each file's by its suffix; a named set whose
    files' suffix is not their format, such as S3-Rec's one-user-a-line ``.txt``)."""

    columns: Columns = Columns()
    min_events: int = 0
    file_format: Optional[str] = None


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
    one_line_per_user = OneLinePerUser()
    events = 0
    for path in files:  # pass 1: check every value, collect the ids
        file_events = 0
        for batch in _batches(path, columns, options.file_format):
            if batch.user_lines is not None:
                one_line_per_user.add(batch.user_lines)
            wanted = batch.layout.wanted
            for collector in (users, items):
                role = collector.role
                collector.add(batch, _checked_ids(batch, role, wanted[role]))
                text_ids[role] |= batch.layout.fmt in ("csv", "tsv", "text", USER_LINES)
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
        if (options.file_format or format_of(path)) == "json":
            _check_one_object_per_line(path, file_events, columns)
        events += file_events
    one_line_per_user.check()
    user_ids, item_ids = users.vocabulary(text_ids["user"]), items.vocabulary(text_ids["item"])

    spools = {"user": Spool(folder / "user.tmp", np.int64),
              "item": Spool(folder / "item.tmp", np.int64),
              "time": Spool(folder / "time.tmp", np.int64)}
    if has["rating"]:
        spools["rating"] = Spool(folder / "rating.tmp", np.float32)
    if has["action"]:
        spools["action"] = Spool(folder / "action.tmp", np.int64)
    for path in files:  # pass 2: each event's rows, in file order
        for batch in _batches(path, columns, options.file_format):
            wanted = batch.layout.wanted
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
