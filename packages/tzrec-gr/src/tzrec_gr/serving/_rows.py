"""Reading and checking the rows of a predictions input file (see :mod:`tzrec_gr.serving.files`
for the columns and the rules): the file formats, the errors, the :class:`Limits` a row must
fit, the record readers (Parquet, CSV, JSONL, read as needed) and the check of one row.
"""

from __future__ import annotations

import csv
import dataclasses
import decimal
import json
import math
import pathlib
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from tzrec_gr.serving.inputs import _id_array
from tzrec_gr.vocabulary import Vocabulary
from tzrec_ops.extras import require

#: input file suffix -> format
INPUT_FORMATS = {
    ".parquet": "parquet",
    ".pq": "parquet",
    ".csv": "csv",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
}
REQUIRED = ("user_id", "item_ids", "timestamps")
#: the range of the integers a row may hold (they travel as int64 tensors)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class PredictError(Exception):
    """A bad input or output file or option (the message names it)."""


class BadRowError(PredictError):
    """A bad row under ``on_error="fail"``; the message names the row and the problem."""

    def __init__(self, row: int, problem: str) -> None:
        super().__init__(f"row {row}: {problem}")
        self.row = row
        self.problem = problem


@dataclasses.dataclass(frozen=True)
class Limits:
    """What a row must fit.

    Attributes:
        kind (str): ``"retrieval"`` or ``"ranking"``.
        num_items (int): item ids are in ``[0, num_items)``.
        max_events (int): events the model takes per user (older ones are dropped).
        max_candidates (int): ranking: candidates per user, at most.
        contextual_width (int): ranking: ``C * Fc`` contextual floats per user (0: none).
        tasks (tuple[str, ...]): ranking: the output column of each task.
    """

    kind: str
    num_items: int
    max_events: int
    max_candidates: int = 0
    contextual_width: int = 0
    tasks: Tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("retrieval", "ranking"):
            raise ValueError(f"kind must be 'retrieval' or 'ranking', got {self.kind!r}")


def suffix_format(path: Union[str, pathlib.Path], formats: Dict[str, str], option: str) -> str:
    suffix = pathlib.Path(path).suffix.lower()
    if suffix not in formats:
        raise PredictError(f"{option} must end with one of {', '.join(formats)}, got {str(path)!r}")
    return formats[suffix]


def input_format(path: Union[str, pathlib.Path]) -> str:
    """``"parquet"``, ``"csv"`` or ``"jsonl"`` from the suffix; PredictError naming
    ``--input`` otherwise."""
    return suffix_format(path, INPUT_FORMATS, "--input")


def _count_lines(path: pathlib.Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def read_records(
    path: Union[str, pathlib.Path],
) -> Tuple[Optional[int], Iterator[Tuple[int, Union[Dict[str, Any], str]]]]:
    """The rows of an input file, read as they are needed.

    Returns:
        (rows, records): the number of rows when known cheaply (None otherwise), and
        ``(row number, record)`` pairs, row numbers from 1; a record is a dict of the
        row's columns (lists still as read: lists, or strings in CSV), or a string
        saying why the row could not be read (a line that is not JSON).

    Raises:
        PredictError: a missing file, an unknown suffix or a file without the required
            columns (named).
    """
    fmt = input_format(path)
    path = pathlib.Path(path)
    if not path.is_file():
        raise PredictError(f"--input: no file at {path}")
    if fmt == "parquet":
        pq = require("pyarrow.parquet", "pyarrow", "reading Parquet (--input *.parquet)")
        try:
            reader = pq.ParquetFile(path)
        except Exception as exc:  # pyarrow raises ArrowInvalid, OSError...
            raise PredictError(f"--input {path}: not a readable Parquet file ({exc})") from exc
        _check_columns(path, reader.schema_arrow.names)
        return reader.metadata.num_rows, _parquet_records(reader)
    with open(path, newline="" if fmt == "csv" else None) as f:
        header = f.readline()
    if fmt == "csv":
        _check_columns(path, next(csv.reader([header]), []))
        return max(_count_lines(path) - 1, 0), _csv_records(path)
    return _count_lines(path), _jsonl_records(path)


def _check_columns(path: pathlib.Path, names: Sequence[str]) -> None:
    missing = [c for c in REQUIRED if c not in names]
    if missing:
        raise PredictError(
            f"--input {path} has no column {', '.join(missing)} (columns: "
            f"{', '.join(names) or 'none'}); it needs {', '.join(REQUIRED)}, and actions and "
            "candidates for a ranking model"
        )


def _parquet_records(reader: Any) -> Iterator[Tuple[int, Union[Dict[str, Any], str]]]:
    row = 0
    for batch in reader.iter_batches(batch_size=4096):
        for record in batch.to_pylist():
            row += 1
            yield row, record


def _csv_records(path: pathlib.Path) -> Iterator[Tuple[int, Union[Dict[str, Any], str]]]:
    with open(path, newline="") as f:
        for row, record in enumerate(csv.DictReader(f), start=1):
            yield row, {k: v for k, v in record.items() if k is not None}


def _jsonl_records(path: pathlib.Path) -> Iterator[Tuple[int, Union[Dict[str, Any], str]]]:
    row = 0
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            row += 1
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                yield row, f"not a JSON object ({exc.msg} at column {exc.colno})"
                continue
            if not isinstance(record, dict):
                yield row, f"not a JSON object (a {type(record).__name__})"
            else:
                yield row, record


# -- rows -----------------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    number: int
    user_id: Any
    item_ids: List[int]
    timestamps: List[int]
    actions: Optional[List[int]]
    candidates: Optional[List[int]]
    contextual: Optional[List[float]]
    older: List[int]  # item ids of the events dropped for the model's bound


def _int(name: str, i: int, value: Any) -> int:
    """One integer of a list: an int (a Parquet decimal with no fraction too) in int64."""
    if isinstance(value, decimal.Decimal) and value.is_finite() and value == value.to_integral():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}[{i}] must be an integer, got {value!r}")
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"{name}[{i}] is {value}, outside the 64-bit integer range")
    return value


def _parts(value: str) -> List[str]:
    """The items of a CSV list field: ``"3 17 42"`` (brackets and commas tolerated)."""
    return value.strip().strip("[]").replace(",", " ").split()


def _ints(name: str, value: Any) -> List[int]:
    """A list of int64 integers from a list, or from a string of space-separated ints (CSV)."""
    if isinstance(value, str):
        try:
            parsed = [int(p) for p in _parts(value)]
        except ValueError:
            raise ValueError(
                f"{name} must be integers separated by spaces, got {value!r}"
            ) from None
        return [_int(name, i, v) for i, v in enumerate(parsed)]
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list of integers, got {type(value).__name__}")
    return [_int(name, i, v) for i, v in enumerate(value)]


def _raw_id(name: str, i: int, value: Any, items: Vocabulary) -> Any:
    """One raw id of a JSONL/Parquet list as ``items`` looks it up: a string in an integer
    vocabulary is read as its integer (``"12"`` is 12), an integer in a string vocabulary as
    its text."""
    if isinstance(value, decimal.Decimal) and value.is_finite() and value == value.to_integral():
        value = int(value)
    if isinstance(value, str):
        return items.parse(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}[{i}] must be a raw id (an integer or a string), got {value!r}")
    return value if items.kind == "int" else str(value)


def _rows_of_raw(name: str, value: Any, items: Vocabulary) -> List[int]:
    """The model rows of a list of raw item ids (a list, or a CSV field of ids separated by
    spaces); ValueError naming the first unknown id and its position."""
    if isinstance(value, str):
        raw = [items.parse(p) for p in _parts(value)]
    elif isinstance(value, (list, tuple)):
        raw = [_raw_id(name, i, v, items) for i, v in enumerate(value)]
    else:
        raise ValueError(f"{name} must be a list of raw item ids, got {type(value).__name__}")
    rows = items.rows(_id_array(raw))
    unknown = (rows < 0).nonzero()[0]
    if unknown.size:
        i = int(unknown[0])
        raise ValueError(
            f"unknown item id {raw[i]!r} in {name} (position {i}): not one of the model's "
            f"{len(items)} raw item ids"
        )
    return rows.tolist()


def _floats(name: str, value: Any) -> List[float]:
    if isinstance(value, str):
        parts = value.strip().strip("[]").replace(",", " ").split()
    elif isinstance(value, (list, tuple)):
        parts = list(value)
    else:
        raise ValueError(f"{name} must be a list of numbers, got {type(value).__name__}")
    try:
        out = [float(p) for p in parts]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be numbers, got {value!r}") from None
    if not all(math.isfinite(v) for v in out):
        raise ValueError(f"{name} holds a NaN or inf")
    return out


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, str) and not value.strip())


def _unknown(name: str, ids: List[int], num_items: int) -> Optional[str]:
    for i, v in enumerate(ids):
        if not 0 <= v < num_items:
            return (
                f"unknown item id {v} in {name} (position {i}); the model's items are "
                f"0..{num_items - 1}"
            )
    return None


def check_row(
    number: int, record: Dict[str, Any], limits: Limits, items: Optional[Vocabulary] = None
) -> Union[Row, str]:
    """The row, checked against ``limits``, or the problem with it.

    Args:
        items: the raw item ids of the model: ``item_ids`` and ``candidates`` are raw ids,
            mapped to the model's rows (an unknown one is the row's problem). None: they are
            the model's ids ``[0, num_items)``.
    """
    ranking = limits.kind == "ranking"
    required = [*REQUIRED, *(("actions", "candidates") if ranking else ())]
    if ranking and limits.contextual_width:
        required.append("contextual")
    for name in required:
        if name not in record or (name != "user_id" and _missing(record[name])):
            return f"{name} is missing"
    user = record["user_id"]
    if _missing(user):
        return "user_id is missing"
    if isinstance(user, int) and not isinstance(user, bool) and not INT64_MIN <= user <= INT64_MAX:
        return f"user_id is {user}, outside the 64-bit integer range"
    vocabulary = items

    def ids(name: str) -> List[int]:  # the model's rows of an item column
        if vocabulary is None:
            return _ints(name, record[name])
        return _rows_of_raw(name, record[name], vocabulary)

    try:
        history = ids("item_ids")
        times = _ints("timestamps", record["timestamps"])
        actions = _ints("actions", record["actions"]) if ranking else None
        candidates = ids("candidates") if ranking else None
        contextual = (
            _floats("contextual", record["contextual"])
            if ranking and limits.contextual_width
            else None
        )
    except ValueError as exc:
        return str(exc)
    if not history:
        return "empty history: item_ids has no events"
    if len(times) != len(history):
        return f"item_ids has {len(history)} events but timestamps has {len(times)}"
    if actions is not None and len(actions) != len(history):
        return f"item_ids has {len(history)} events but actions has {len(actions)}"
    for p in range(1, len(times)):
        if times[p] < times[p - 1]:
            return (
                f"timestamps are not sorted: position {p} ({times[p]}) is older than "
                f"position {p - 1} ({times[p - 1]})"
            )
    problem = _unknown("item_ids", history, limits.num_items)
    if problem:
        return problem
    if candidates is not None:
        if not candidates:
            return "candidates is empty: a ranking model scores at least one"
        if len(candidates) > limits.max_candidates:
            return (
                f"{len(candidates)} candidates, more than the model's max_targets "
                f"({limits.max_candidates}); split them over several rows"
            )
        problem = _unknown("candidates", candidates, limits.num_items)
        if problem:
            return problem
    if contextual is not None and len(contextual) != limits.contextual_width:
        return (
            f"contextual has {len(contextual)} values; the model takes "
            f"{limits.contextual_width} (C * Fc)"
        )
    if actions is not None and any(a < 0 for a in actions):
        return "actions must be >= 0 (bitmasks)"
    keep = limits.max_events
    older = history[:-keep] if len(history) > keep else []
    return Row(
        number=number,
        user_id=record["user_id"],
        item_ids=history[-keep:],
        timestamps=times[-keep:],
        actions=None if actions is None else actions[-keep:],
        candidates=candidates,
        contextual=contextual,
        older=older,
    )
