"""Reading and checking the rows of a predictions input file (see :mod:`tzrec_gr.serving.files`
for the columns and the rules): the file formats, the errors, the :class:`Limits` a row must
fit, the record readers (Parquet, CSV, TSV, JSONL, read as needed) and the check of one row.

The suffixes are training's (:mod:`tzrec_gr.file_formats`, one table for both readers): the
format goes by the suffix before an optional ``.gz``, ``.json`` is JSON lines like
``.jsonl``/``.ndjson``, and text is UTF-8 with an optional byte-order mark.
"""

from __future__ import annotations

import csv
import dataclasses
import decimal
import gzip
import json
import math
import pathlib
from typing import IO, Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from tzrec_gr.file_formats import FORMATS, LOG_ONLY
from tzrec_gr.models.registry import TASKS
from tzrec_gr.serving.inputs import _id_array
from tzrec_gr.vocabulary import Vocabulary
from tzrec_ops.extras import require

#: input file suffix (before an optional ``.gz``, except Parquet's) -> format: those of
#: event logs but their ``user item`` text
INPUT_FORMATS = {suffix: fmt for suffix, fmt in FORMATS.items() if fmt not in LOG_ONLY}
#: the delimiter of each delimited format
DELIMITERS = {"csv": ",", "tsv": "\t"}
#: ``--unknown-items``: leave an item the model does not know out of the history, or skip
#: the user's row
UNKNOWN_ITEMS = ("drop", "skip-user")
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


class NothingAnsweredError(PredictError):
    """Not one row could be predicted (every row skipped, or none read): no output is
    written; the message gives the counts."""


@dataclasses.dataclass(frozen=True)
class PredictKind:
    """What predictions from files read and write for one kind of model (a :class:`Limits`'
    ``kind``, a server's ``kind``); each server module registers its own
    (:func:`register_predict_kind`), so nothing here asks which kind it predicts for.

    Attributes:
        columns (tuple[str, ...]): the input columns a row needs besides ``user_id``,
            ``item_ids`` and ``timestamps``, of ``actions``, ``candidates`` and
            ``contextual`` (the last only where the model takes contextual features,
            ``Limits.contextual_width``).
        takes_k (bool): the predictions are each user's top ``k`` items (``--k`` is checked
            against the catalogue).
        outputs: ``limits -> [(column, type), ...]``, the output file's columns.
        predict: ``(predictor, rows, limits, k, exclude_seen, items) -> records``: the
            output records of a batch of checked rows.
    """

    columns: Tuple[str, ...]
    takes_k: bool
    outputs: Callable[["Limits"], List[Tuple[str, str]]]
    predict: Callable[..., List[Dict[str, Any]]]


_KINDS: Dict[str, PredictKind] = {}  # a kind -> its predictions, as the servers register them


def register_predict_kind(kind: str, predict: PredictKind) -> None:
    """What predictions from files do for ``kind`` (the server module of that kind calls it)."""
    if _KINDS.get(kind, predict) != predict:
        raise ValueError(f"predictions of kind {kind!r} are registered already")
    _KINDS[kind] = predict


def predict_kind(kind: str) -> PredictKind:
    """The registered :class:`PredictKind` of ``kind``.

    Raises:
        ValueError: no server registered that kind.
    """
    if kind not in _KINDS:
        order = sorted(_KINDS, key=lambda k: (TASKS.index(k) if k in TASKS else len(TASKS)))
        raise ValueError(
            f"kind must be {' or '.join(repr(k) for k in order)}, got {kind!r}"
        )
    return _KINDS[kind]


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
        predict_kind(self.kind)  # a ValueError for a kind no server registered

    @property
    def predicts(self) -> PredictKind:
        """What predictions from files read and write for this kind."""
        return predict_kind(self.kind)

    @property
    def extra_columns(self) -> Tuple[str, ...]:
        """The input columns a row needs besides ``user_id``, ``item_ids`` and
        ``timestamps`` (its kind's :attr:`PredictKind.columns`, ``contextual`` only where
        the model takes contextual features)."""
        return tuple(c for c in self.predicts.columns
                     if c != "contextual" or self.contextual_width)


def suffix_format(path: Union[str, pathlib.Path], formats: Dict[str, str], option: str) -> str:
    suffix = pathlib.Path(path).suffix.lower()
    if suffix not in formats:
        raise PredictError(f"{option} must end with one of {', '.join(formats)}, got {str(path)!r}")
    return formats[suffix]


def input_format(path: Union[str, pathlib.Path]) -> str:
    """``"parquet"``, ``"csv"``, ``"tsv"`` or ``"json"`` from the suffix (a text format may
    be gzip-compressed: ``users.csv.gz``); PredictError naming ``--input`` otherwise."""
    path = pathlib.Path(path)
    if path.suffix.lower() != ".gz":
        return suffix_format(path, INPUT_FORMATS, "--input")
    fmt = suffix_format(path.with_suffix(""), INPUT_FORMATS, "--input (before .gz)")
    if fmt == "parquet":
        raise PredictError(f"--input {path}: Parquet compresses its own columns; give the "
                           "file without .gz")
    return fmt


def _open_text(path: pathlib.Path) -> IO[str]:
    """A text input file, gunzipped when it ends in ``.gz``, without its byte-order mark."""
    if path.suffix.lower() == ".gz":
        return gzip.open(path, "rt", encoding="utf-8-sig", newline="")
    return open(path, encoding="utf-8-sig", newline="")


def _count_lines(path: pathlib.Path) -> int:
    with _open_text(path) as f:
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
    try:
        with _open_text(path) as f:
            header = f.readline()
    except (OSError, EOFError, UnicodeDecodeError) as exc:  # not gzip, truncated, not UTF-8
        raise PredictError(f"--input {path}: cannot be read as {fmt} ({exc})") from exc
    if fmt in DELIMITERS:
        _check_columns(path, next(csv.reader([header], delimiter=DELIMITERS[fmt]), []))
        return max(_count_lines(path) - 1, 0), _csv_records(path, DELIMITERS[fmt])
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


def _csv_records(
    path: pathlib.Path, delimiter: str
) -> Iterator[Tuple[int, Union[Dict[str, Any], str]]]:
    with _open_text(path) as f:
        for row, record in enumerate(csv.DictReader(f, delimiter=delimiter), start=1):
            yield row, {k: v for k, v in record.items() if k is not None}


def _jsonl_records(path: pathlib.Path) -> Iterator[Tuple[int, Union[Dict[str, Any], str]]]:
    row = 0
    with _open_text(path) as f:
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
    dropped: int = 0  # events left out for an item the model does not know


def _int(name: str, i: int, value: Any) -> int:
    """One integer of a list: an int (a Parquet decimal with no fraction too) in int64."""
    if isinstance(value, decimal.Decimal) and value.is_finite() and value == value.to_integral():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}[{i}] must be an integer, got {value!r}")
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"{name}[{i}] is {value}, outside the 64-bit integer range")
    return value


def _cell(value: Any) -> Any:
    """A CSV/TSV list field as a list when it holds a JSON list (``["a b", "c,d"]``: what
    predictions CSVs write, and the one way to give ids with spaces or commas), else as
    given."""
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            return value
        if isinstance(parsed, list):
            return parsed
    return value


def _parts(value: str) -> List[str]:
    """The items of a CSV list field: ``"3 17 42"`` (brackets and commas tolerated)."""
    return value.strip().strip("[]").replace(",", " ").split()


def _ints(name: str, value: Any) -> List[int]:
    """A list of int64 integers from a list, or from a string of space-separated ints (CSV)."""
    value = _cell(value)
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


def _item_rows(
    name: str, value: Any, items: Optional[Vocabulary], num_items: int
) -> Tuple[List[int], List[str]]:
    """The model rows of a list of item ids (a list, or a CSV field), ``-1`` where an id is
    unknown to the model, and a problem per unknown id (naming it and its position).

    ``items``: the model's raw ids (None: the ids are the model's rows ``[0, num_items)``).
    """
    if items is None:
        rows = _ints(name, value)
        problems = [
            f"unknown item id {v} in {name} (position {i}); the model's items are "
            f"0..{num_items - 1}"
            for i, v in enumerate(rows) if not 0 <= v < num_items
        ]
        return [v if 0 <= v < num_items else -1 for v in rows], problems
    value = _cell(value)
    if isinstance(value, str):
        raw = [items.parse(p) for p in _parts(value)]
    elif isinstance(value, (list, tuple)):
        raw = [_raw_id(name, i, v, items) for i, v in enumerate(value)]
    else:
        raise ValueError(f"{name} must be a list of raw item ids, got {type(value).__name__}")
    rows = items.rows(_id_array(raw)).tolist()
    problems = [
        f"unknown item id {raw[i]!r} in {name} (position {i}): not one of the model's "
        f"{len(items)} raw item ids"
        for i, r in enumerate(rows) if r < 0
    ]
    return rows, problems


def _floats(name: str, value: Any) -> List[float]:
    value = _cell(value)
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


def check_row(
    number: int,
    record: Dict[str, Any],
    limits: Limits,
    items: Optional[Vocabulary] = None,
    unknown_items: str = "drop",
) -> Union[Row, str]:
    """The row, checked against ``limits``, or the problem with it.

    Args:
        items: the raw item ids of the model: ``item_ids`` and ``candidates`` are raw ids,
            mapped to the model's rows. None: they are the model's ids ``[0, num_items)``.
        unknown_items: an item of ``item_ids`` the model does not know: ``"drop"`` leaves
            its event out of the history (counted in :attr:`Row.dropped`; a history of
            nothing else is the row's problem), ``"skip-user"`` makes it the row's problem.
            An unknown candidate is always the row's problem: it cannot be scored.
    """
    reads = limits.extra_columns
    required = [*REQUIRED, *reads]
    for name in required:
        if name not in record or (name != "user_id" and _missing(record[name])):
            return f"{name} is missing"
    user = record["user_id"]
    if _missing(user):
        return "user_id is missing"
    if isinstance(user, int) and not isinstance(user, bool) and not INT64_MIN <= user <= INT64_MAX:
        return f"user_id is {user}, outside the 64-bit integer range"
    try:
        history, unknown = _item_rows("item_ids", record["item_ids"], items, limits.num_items)
        times = _ints("timestamps", record["timestamps"])
        actions = _ints("actions", record["actions"]) if "actions" in reads else None
        candidates, bad_candidates = (
            _item_rows("candidates", record["candidates"], items, limits.num_items)
            if "candidates" in reads else (None, [])
        )
        contextual = (
            _floats("contextual", record["contextual"]) if "contextual" in reads else None
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
    if unknown:
        if unknown_items != "drop":
            return f"{unknown[0]} (--unknown-items drop leaves it out)"
        known = [p for p, item in enumerate(history) if item >= 0]
        if not known:
            return (f"no item of item_ids is known to the model ({len(history)} events, "
                    f"the first: {unknown[0]})")
        history, times = [history[p] for p in known], [times[p] for p in known]
        actions = None if actions is None else [actions[p] for p in known]
    if candidates is not None:
        if not candidates:
            return "candidates is empty: a ranking model scores at least one"
        if len(candidates) > limits.max_candidates:
            return (
                f"{len(candidates)} candidates, more than the model's max_targets "
                f"({limits.max_candidates}); split them over several rows"
            )
        if bad_candidates:
            return bad_candidates[0]
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
        dropped=len(unknown),
    )
