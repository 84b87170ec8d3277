"""Batch predictions from files: users' histories in, top-K items or candidate scores out.

Legend: B = users per batch, K = items returned (retrieval) or tasks (ranking).

The one implementation behind ``tzrec-bench predict`` (from a training checkpoint) and
``python -m tzrec_acc predict`` (from a checkpoint or an exported package): both build a
*predictor* (a :class:`~tzrec_gr.serving.ServingSession`, or anything with its
``recommend`` / ``score``) and its :class:`Limits`, then call :func:`predict_file`; their
options come from :func:`add_predict_arguments`.

Why it lives here: tzrec-gr is the one package both commands import (tzrec-bench depends on
it; tzrec-acc serves tzrec-gr models only with its ``[gr]`` extra), it holds the serving API
the predictions come from, and nothing here adds a hard dependency to it: Parquet needs
pyarrow, imported only for a Parquet file (:func:`tzrec_ops.extras.require`; tzrec-bench
installs it), the progress bar tqdm when installed (none without it); CSV and JSONL are read
and written with the standard library.

Input (one row per user; ``--input`` ``.parquet``/``.pq``, ``.csv`` or ``.jsonl``/``.ndjson``):

=============== ======== ====================================================================
column          required what
=============== ======== ====================================================================
``user_id``     yes      any id, copied to the output
``item_ids``    yes      the user's history, oldest first: the model's item ids
                         ``[0, num_items)`` (tzrec-bench numbers a data set's items 0, 1, ...
                         in the order of their raw ids)
``timestamps``  yes      one integer time per event, non-decreasing
``actions``     ranking  one integer action bitmask per event
``candidates``  ranking  the item ids to score (at most the model's ``max_targets``)
``contextual``  some     ranking models with a contextual prefix: ``C * Fc`` floats
=============== ======== ====================================================================

Lists are lists in Parquet and JSONL, and space-separated strings in CSV (``"3 17 42"``;
brackets and commas are tolerated). A history longer than the model takes keeps its newest
events (as training does); with ``exclude_seen`` the dropped events' items stay excluded.

Output (``--output`` ``.parquet``/``.pq`` or ``.csv``; one row per valid input row, in input
order): retrieval: ``user_id``, ``item_ids`` (the top ``k``, best first; fewer when the user
has seen nearly the whole catalogue) and ``scores``; ranking: ``user_id``, ``candidates`` and
one column of probabilities per task (in the candidates' order). The file is written under a
temporary name and renamed at the end, so a failed run leaves no partial output.

Bad rows are found on the host before any batch runs: a missing column value, a value of
the wrong type, an empty history, item_ids and timestamps (or actions) of different lengths,
unsorted timestamps, an unknown item id, and for ranking a missing, empty or too long
candidate list or contextual features of the wrong width. Each is reported by its row number
(the first data row is row 1; a CSV header does not count) and either skipped and counted
(``on_error="skip"``) or raised as a :class:`BadRowError` (``on_error="fail"``).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import pathlib
import sys
import time
from typing import (
    Any,
    Callable,
    Dict,
    Iterator,
    List,
    Optional,
    Protocol,
    Sequence,
    TextIO,
    Tuple,
    Union,
)

import torch

from tzrec_gr.serving.inputs import Histories
from tzrec_gr.serving.topk import TopK
from tzrec_ops.extras import require

__all__ = [
    "BadRow",
    "BadRowError",
    "INPUT_FORMATS",
    "Limits",
    "OUTPUT_FORMATS",
    "PredictError",
    "PredictSummary",
    "Predictor",
    "add_predict_arguments",
    "check_output_path",
    "input_format",
    "output_format",
    "pick_device",
    "predict_file",
    "read_records",
    "session_limits",
]

#: input file suffix -> format
INPUT_FORMATS = {
    ".parquet": "parquet",
    ".pq": "parquet",
    ".csv": "csv",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
}
#: output file suffix -> format
OUTPUT_FORMATS = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv"}
ON_ERROR = ("skip", "fail")
REQUIRED = ("user_id", "item_ids", "timestamps")
_SHOWN = 20  # skipped rows printed one by one; the rest are counted


class PredictError(Exception):
    """A bad input or output file or option (the message names it)."""


class BadRowError(PredictError):
    """A bad row under ``on_error="fail"``; the message names the row and the problem."""

    def __init__(self, row: int, problem: str) -> None:
        super().__init__(f"row {row}: {problem}")
        self.row = row
        self.problem = problem


class Predictor(Protocol):
    """What :func:`predict_file` calls (a :class:`~tzrec_gr.serving.ServingSession` is one)."""

    def recommend(self, users: Histories, k: int = 10, *, exclude_seen: bool = True) -> TopK:
        """Top-``k`` items per user (retrieval)."""

    def score(self, users: Histories, candidates: Sequence[Sequence[int]]) -> torch.Tensor:
        """[L_t, K] per-task probabilities of the candidates, in input order (ranking)."""


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


def session_limits(session: Any, tasks: Optional[Sequence[str]] = None) -> Limits:
    """The :class:`Limits` of a :class:`~tzrec_gr.serving.ServingSession`'s model.

    Args:
        session: the session.
        tasks: ranking: a name per task for the output columns. Default: ``task_0``,
            ``task_1``, ...
    """
    model = session.model
    if session.kind == "retrieval":
        return Limits("retrieval", model.num_items, model.max_seq_len)
    width = 0
    if model.contextual_seq_len > 0:
        pre = model.transducer.input_preprocessor
        width = pre.contextual_seq_len() * pre.contextual_feature_dim
    names = (
        tuple(tasks) if tasks is not None else tuple(f"task_{i}" for i in range(model.num_tasks))
    )
    if len(names) != model.num_tasks:
        raise ValueError(f"tasks has {len(names)} names but the model has {model.num_tasks} tasks")
    return Limits("ranking", model.num_items, model.max_uih_len, model.max_targets, width, names)


# -- files ----------------------------------------------------------------------------------


def _format(path: Union[str, pathlib.Path], formats: Dict[str, str], option: str) -> str:
    suffix = pathlib.Path(path).suffix.lower()
    if suffix not in formats:
        raise PredictError(f"{option} must end with one of {', '.join(formats)}, got {str(path)!r}")
    return formats[suffix]


def input_format(path: Union[str, pathlib.Path]) -> str:
    """``"parquet"``, ``"csv"`` or ``"jsonl"`` from the suffix; PredictError naming
    ``--input`` otherwise."""
    return _format(path, INPUT_FORMATS, "--input")


def output_format(path: Union[str, pathlib.Path]) -> str:
    """``"parquet"`` or ``"csv"`` from the suffix; PredictError naming ``--output``
    otherwise."""
    return _format(path, OUTPUT_FORMATS, "--output")


def check_output_path(path: Union[str, pathlib.Path]) -> str:
    """The output format, after checking that the file can be written (its folder exists
    and is writable, it is not a folder). No file is created.

    Raises:
        PredictError: naming ``--output`` and what is wrong.
    """
    fmt = output_format(path)
    path = pathlib.Path(path)
    folder = path.parent
    if path.is_dir():
        raise PredictError(f"--output {path} is a folder; give a file name")
    if not folder.is_dir():
        raise PredictError(f"--output {path}: its folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PredictError(f"--output {path}: its folder {folder} is not writable")
    if fmt == "parquet":
        require("pyarrow.parquet", "pyarrow", "writing Parquet (--output *.parquet)")
    return fmt


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
class _Row:
    number: int
    user_id: Any
    item_ids: List[int]
    timestamps: List[int]
    actions: Optional[List[int]]
    candidates: Optional[List[int]]
    contextual: Optional[List[float]]
    older: List[int]  # item ids of the events dropped for the model's bound


def _ints(name: str, value: Any) -> List[int]:
    """A list of ints from a list, or from a string of space-separated ints (CSV)."""
    if isinstance(value, str):
        parts = value.strip().strip("[]").replace(",", " ").split()
        try:
            return [int(p) for p in parts]
        except ValueError:
            raise ValueError(
                f"{name} must be integers separated by spaces, got {value!r}"
            ) from None
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list of integers, got {type(value).__name__}")
    for i, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{name}[{i}] must be an integer, got {v!r}")
    return list(value)


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


def _check_row(number: int, record: Dict[str, Any], limits: Limits) -> Union[_Row, str]:
    """The row, checked against ``limits``, or the problem with it."""
    ranking = limits.kind == "ranking"
    required = [*REQUIRED, *(("actions", "candidates") if ranking else ())]
    if ranking and limits.contextual_width:
        required.append("contextual")
    for name in required:
        if name not in record or (name != "user_id" and _missing(record[name])):
            return f"{name} is missing"
    if _missing(record["user_id"]):
        return "user_id is missing"
    try:
        items = _ints("item_ids", record["item_ids"])
        times = _ints("timestamps", record["timestamps"])
        actions = _ints("actions", record["actions"]) if ranking else None
        candidates = _ints("candidates", record["candidates"]) if ranking else None
        contextual = (
            _floats("contextual", record["contextual"])
            if ranking and limits.contextual_width
            else None
        )
    except ValueError as exc:
        return str(exc)
    if not items:
        return "empty history: item_ids has no events"
    if len(times) != len(items):
        return f"item_ids has {len(items)} events but timestamps has {len(times)}"
    if actions is not None and len(actions) != len(items):
        return f"item_ids has {len(items)} events but actions has {len(actions)}"
    for p in range(1, len(times)):
        if times[p] < times[p - 1]:
            return (
                f"timestamps are not sorted: position {p} ({times[p]}) is older than "
                f"position {p - 1} ({times[p - 1]})"
            )
    problem = _unknown("item_ids", items, limits.num_items)
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
    older = items[:-keep] if len(items) > keep else []
    return _Row(
        number=number,
        user_id=record["user_id"],
        item_ids=items[-keep:],
        timestamps=times[-keep:],
        actions=None if actions is None else actions[-keep:],
        candidates=candidates,
        contextual=contextual,
        older=older,
    )


# -- predictions ----------------------------------------------------------------------------


def _recommend(
    predictor: Predictor, rows: List[_Row], limits: Limits, k: int, exclude_seen: bool
) -> List[Dict[str, Any]]:
    histories = Histories.from_lists([r.item_ids for r in rows], [r.timestamps for r in rows])
    # the items of events dropped for the bound are seen too: ask for enough more to
    # remove them after (exact: the order of the rest does not change)
    extra = [set(r.older) - set(r.item_ids) if exclude_seen else set() for r in rows]
    wanted = min(limits.num_items, k + max(len(e) for e in extra))
    top = predictor.recommend(histories, wanted, exclude_seen=exclude_seen)
    ids, scores = top.ids.tolist(), top.scores.float().tolist()
    out = []
    for r, seen, row_ids, row_scores in zip(rows, extra, ids, scores):
        kept = [(i, s) for i, s in zip(row_ids, row_scores) if i >= 0 and i not in seen][:k]
        out.append(
            {
                "user_id": r.user_id,
                "item_ids": [i for i, _ in kept],
                "scores": [s for _, s in kept],
            }
        )
    return out


def _score(predictor: Predictor, rows: List[_Row], limits: Limits) -> List[Dict[str, Any]]:
    histories = Histories.from_lists(
        [r.item_ids for r in rows],
        [r.timestamps for r in rows],
        actions=[r.actions for r in rows],  # type: ignore[misc]
        contextual=[r.contextual for r in rows] if limits.contextual_width else None,
    )
    probs = predictor.score(histories, [r.candidates for r in rows])  # type: ignore[misc]
    probs = probs.detach().float().cpu()
    out, start = [], 0
    for r in rows:
        n = len(r.candidates)  # type: ignore[arg-type]
        block = probs[start : start + n].t().tolist()
        start += n
        out.append(
            {
                "user_id": r.user_id,
                "candidates": r.candidates,
                **{task: block[t] for t, task in enumerate(limits.tasks)},
            }
        )
    return out


class _Writer:
    """Rows to a CSV or Parquet file, under a temporary name until :meth:`commit`."""

    def __init__(self, path: pathlib.Path, fmt: str, columns: Sequence[Tuple[str, str]]) -> None:
        self.path = path
        self.tmp = path.with_name(f".{path.name}.partial")
        self.fmt = fmt
        self.columns = list(columns)  # (name, "id" | "ints" | "floats")
        self._csv: Optional[Any] = None
        self._file: Optional[TextIO] = None
        self._parquet: Optional[Any] = None
        self._id_type: Optional[str] = None
        if fmt == "csv":
            self._file = open(self.tmp, "w", newline="")
            self._csv = csv.writer(self._file)
            self._csv.writerow([name for name, _ in self.columns])

    def write(self, rows: List[Dict[str, Any]]) -> None:
        if not rows:
            return
        if self._csv is not None:
            for r in rows:
                self._csv.writerow([_cell(r[name], kind) for name, kind in self.columns])
            return
        pa = require("pyarrow", "pyarrow", "writing Parquet (--output *.parquet)")
        pq = require("pyarrow.parquet", "pyarrow", "writing Parquet (--output *.parquet)")
        if self._id_type is None:
            ints = all(
                isinstance(r["user_id"], int) and not isinstance(r["user_id"], bool) for r in rows
            )
            self._id_type = "int" if ints else "str"
        types = {
            "ints": pa.list_(pa.int64()),
            "floats": pa.list_(pa.float32()),
            "id": pa.int64() if self._id_type == "int" else pa.string(),
        }
        schema = pa.schema([(name, types[kind]) for name, kind in self.columns])
        data = {}
        for name, kind in self.columns:
            values = [r[name] for r in rows]
            if kind == "id" and self._id_type == "str":
                values = [str(v) for v in values]
            data[name] = values
        try:
            table = pa.Table.from_pydict(data, schema=schema)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as exc:
            raise PredictError(
                f"--output {self.path}: user_id must keep one type across the file ({exc})"
            ) from exc
        if self._parquet is None:
            self._parquet = pq.ParquetWriter(str(self.tmp), schema)
        self._parquet.write_table(table)

    def commit(self) -> None:
        self._close()
        if self.fmt == "parquet" and not self.tmp.exists():  # no row: an empty table
            pa = require("pyarrow", "pyarrow", "writing Parquet")
            pq = require("pyarrow.parquet", "pyarrow", "writing Parquet")
            types = {
                "ints": pa.list_(pa.int64()),
                "floats": pa.list_(pa.float32()),
                "id": pa.string(),
            }
            schema = pa.schema([(name, types[kind]) for name, kind in self.columns])
            pq.write_table(schema.empty_table(), str(self.tmp))
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        self._close()
        self.tmp.unlink(missing_ok=True)

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._parquet is not None:
            self._parquet.close()
            self._parquet = None


def _cell(value: Any, kind: str) -> str:
    if kind == "ints":
        return " ".join(str(v) for v in value)
    if kind == "floats":
        return " ".join(repr(float(v)) for v in value)
    return str(value)


@dataclasses.dataclass
class PredictSummary:
    """What :func:`predict_file` did.

    Attributes:
        rows (int): input rows read.
        written (int): output rows (users predicted).
        skipped (list[BadRow]): the bad rows skipped, in file order.
        truncated (int): histories cut to the model's bound (newest events kept).
        seconds (float): wall time from the first row read to the output renamed.
    """

    rows: int = 0
    written: int = 0
    skipped: List[BadRow] = dataclasses.field(default_factory=list)
    truncated: int = 0
    seconds: float = 0.0

    @property
    def users_per_second(self) -> float:
        return self.written / self.seconds if self.seconds > 0 else float("inf")

    def __str__(self) -> str:
        line = (
            f"{self.written} users in {self.seconds:.2f} s ({self.users_per_second:,.1f} "
            f"users/s); {self.rows} rows read, {len(self.skipped)} skipped"
        )
        if self.truncated:
            line += f", {self.truncated} histories cut to the model's newest events"
        return line


@dataclasses.dataclass(frozen=True)
class BadRow:
    """A row that was skipped: its number (from 1) and the problem."""

    row: int
    problem: str

    def __str__(self) -> str:
        return f"row {self.row}: {self.problem}"


def _progress(total: Optional[int], enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # the bar is optional; the summary line is printed all the same
        return None
    return tqdm(total=total, unit="user", desc="predict", file=sys.stderr, leave=False)


def predict_file(
    predictor: Predictor,
    limits: Limits,
    input_path: Union[str, pathlib.Path],
    output_path: Union[str, pathlib.Path],
    *,
    k: int = 10,
    exclude_seen: bool = True,
    batch_size: int = 64,
    on_error: str = "skip",
    progress: bool = True,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
) -> PredictSummary:
    """Predict for every row of ``input_path`` and write ``output_path``.

    Args:
        predictor: a :class:`~tzrec_gr.serving.ServingSession` (or the same interface).
        limits (Limits): what rows must fit, and the kind of prediction.
        input_path: ``.parquet``/``.pq``, ``.csv`` or ``.jsonl``/``.ndjson`` (columns in the
            module docstring).
        output_path: ``.parquet``/``.pq`` or ``.csv``; its folder must exist.
        k (int): retrieval: items per user, in ``[1, num_items]``. Default: 10.
        exclude_seen (bool): retrieval: never return an item of the user's history.
            Default: True.
        batch_size (int): users per call of the predictor. Default: 64.
        on_error (str): ``"skip"`` (report bad rows by number, count them, go on) or
            ``"fail"`` (raise at the first). Default: ``"skip"``.
        progress (bool): a progress bar on stderr (when tqdm is installed). Default: True.
        log: where the skipped rows are reported. Default: stderr.

    Returns:
        PredictSummary: rows read, written and skipped, and the time taken.

    Raises:
        PredictError: a bad option or file (named), before any row is predicted.
        BadRowError: ``on_error="fail"`` and a bad row (named by its number); no output
            file is left behind.
    """
    if on_error not in ON_ERROR:
        raise PredictError(f"--on-error must be 'skip' or 'fail', got {on_error!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise PredictError(f"--batch-size must be an int >= 1, got {batch_size!r}")
    retrieval = limits.kind == "retrieval"
    if retrieval and (
        isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= limits.num_items
    ):
        raise PredictError(f"--k must be in [1, {limits.num_items}] (the catalogue), got {k!r}")
    output = pathlib.Path(output_path)
    fmt = check_output_path(output)
    total, records = read_records(input_path)
    if retrieval:
        columns = [("user_id", "id"), ("item_ids", "ints"), ("scores", "floats")]
    else:
        columns = [("user_id", "id"), ("candidates", "ints")]
        columns += [(task, "floats") for task in limits.tasks]
    summary = PredictSummary()
    start = time.perf_counter()
    writer = _Writer(output, fmt, columns)
    bar = _progress(total, progress)
    batch: List[_Row] = []

    def flush() -> None:
        if not batch:
            return
        if retrieval:
            out = _recommend(predictor, batch, limits, k, exclude_seen)
        else:
            out = _score(predictor, batch, limits)
        writer.write(out)
        summary.written += len(out)
        batch.clear()

    try:
        for number, record in records:
            summary.rows += 1
            row = record if isinstance(record, str) else _check_row(number, record, limits)
            if isinstance(row, str):
                if on_error == "fail":
                    raise BadRowError(number, row)
                summary.skipped.append(BadRow(number, row))
                if len(summary.skipped) <= _SHOWN:
                    log(f"skipped row {number}: {row}")
            else:
                summary.truncated += bool(row.older)
                batch.append(row)
                if len(batch) == batch_size:
                    flush()
            if bar is not None:
                bar.update(1)
        flush()
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    finally:
        if bar is not None:
            bar.close()
    summary.seconds = time.perf_counter() - start
    if len(summary.skipped) > _SHOWN:
        log(f"... and {len(summary.skipped) - _SHOWN} more rows skipped")
    return summary


# -- command-line options -------------------------------------------------------------------


def pick_device(name: str) -> torch.device:
    """``--device``: ``auto`` (the GPU when CUDA is available, else the CPU) or a torch
    device name.

    Raises:
        PredictError: an unknown device, or CUDA asked for where it is not available.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as exc:
        raise PredictError(f"--device {name!r} is not a device ({exc})") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise PredictError(f"--device {name}: CUDA is not available on this machine")
    return device


def add_predict_arguments(parser: argparse.ArgumentParser) -> None:
    """The options both ``predict`` commands share: ``--input``, ``--output``, ``--k``,
    ``--exclude-seen/--no-exclude-seen``, ``--batch-size``, ``--device``, ``--on-error``,
    ``--no-progress``."""
    parser.add_argument(
        "--input",
        required=True,
        metavar="FILE",
        help="users' histories: .parquet, .csv or .jsonl with columns "
        "user_id, item_ids, timestamps (lists; space-separated in CSV), and "
        "for ranking actions and candidates (and contextual when the model "
        "has contextual features)",
    )
    parser.add_argument(
        "--output",
        required=True,
        metavar="FILE",
        help="predictions, one row per user: .parquet or .csv (its folder must exist)",
    )
    parser.add_argument("--k", type=int, default=10, help="retrieval: items recommended per user")
    parser.add_argument(
        "--exclude-seen",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="retrieval: never recommend an item of the user's history",
    )
    parser.add_argument(
        "--batch-size", type=int, default=64, metavar="B", help="users per model call"
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="where the model runs: cpu, cuda, cuda:1... or auto (the GPU when CUDA is available)",
    )
    parser.add_argument(
        "--on-error",
        choices=ON_ERROR,
        default="skip",
        help="a bad row (unknown item id, unsorted timestamps, empty "
        "history...): skip it, report its row number and count it; or fail "
        "naming it (exit 1, no output written)",
    )
    parser.add_argument(
        "--no-progress", dest="progress", action="store_false", help="no progress bar"
    )
