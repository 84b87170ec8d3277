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
``item_ids``    yes      the user's history, oldest first: item ids (see *Ids* below)
``timestamps``  yes      one integer time per event, non-decreasing
``actions``     ranking  one integer action bitmask per event
``candidates``  ranking  the item ids to score (at most the model's ``max_targets``)
``contextual``  some     ranking models with a contextual prefix: ``C * Fc`` floats
=============== ======== ====================================================================

Lists are lists in Parquet and JSONL, and space-separated strings in CSV (``"3 17 42"``;
brackets and commas are tolerated, so a raw id in a CSV list cannot hold a space or a
comma: use JSONL or Parquet for such ids). A history longer than the model takes keeps its
newest events (as training does); with ``exclude_seen`` the dropped events' items stay
excluded.

Ids (``--ids``, :func:`item_vocabulary`): a checkpoint or package that carries the training
data's :class:`~tzrec_gr.vocabulary.IdVocabularies` takes and returns *raw* item ids, the
ids of the event log it was trained on (integers of any range, or strings; a CSV field is
read with the vocabulary's ``parse``; in JSONL and Parquet ``"12"`` and ``12`` are the same
id), mapped to the model's rows on the host; an id the vocabulary does not hold is a bad
row. Raw integer ids are never read as the model's rows, even when they fall inside
``0..N-1``. The model's own ids ``[0, num_items)`` are read and written only with
``--ids model`` (``items=None``), and by a file that carries no vocabulary (the commands
print a note).

Seen items (retrieval): kept by default, as tzrec-bench's trainer ranks them
(``TrainConfig.exclude_seen`` is False); ``--exclude-seen`` leaves the user's own items
out.

Output (``--output`` ``.parquet``/``.pq`` or ``.csv``; one row per valid input row, in input
order): retrieval: ``user_id``, ``item_ids`` (the top ``k``, best first, in the input's
kind of ids; fewer when the user has seen nearly the whole catalogue) and ``scores``;
ranking: ``user_id``, ``candidates`` and one column of probabilities per task (in the
candidates' order). The file is written under a temporary name and renamed at the end, so
a failed run leaves no partial output.

Bad rows are found on the host before any batch runs: a missing column value, a value of
the wrong type, an integer outside the 64-bit range (any integer column, any format:
a Parquet ``uint64`` or decimal column too), an empty history, item_ids and timestamps (or
actions) of different lengths, unsorted timestamps, an unknown item id, and for ranking a
missing, empty or too long candidate list or contextual features of the wrong width. Each
is reported by its row number (the first data row is row 1; a CSV header does not count)
and either skipped and counted (``on_error="skip"``) or raised as a :class:`BadRowError`
(``on_error="fail"``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import sys
import time
from typing import (
    Any,
    Callable,
    Dict,
    List,
    Optional,
    Protocol,
    Sequence,
    Tuple,
    Union,
)

import torch

from tzrec_gr.serving._output import Writer
from tzrec_gr.serving._rows import (
    INPUT_FORMATS,
    BadRowError,
    Limits,
    PredictError,
    Row,
    check_row,
    input_format,
    read_records,
    suffix_format,
)
from tzrec_gr.serving.inputs import Histories
from tzrec_gr.serving.topk import TopK
from tzrec_gr.vocabulary import IdVocabularies, Vocabulary
from tzrec_ops.devices import DeviceError, resolve_device
from tzrec_ops.extras import require

__all__ = [
    "BadRow",
    "BadRowError",
    "IDS",
    "INPUT_FORMATS",
    "Limits",
    "OUTPUT_FORMATS",
    "PredictError",
    "PredictSummary",
    "Predictor",
    "add_predict_arguments",
    "check_output_path",
    "input_format",
    "item_vocabulary",
    "output_format",
    "pick_device",
    "predict_file",
    "read_records",
    "seen_rule",
    "session_limits",
]

#: output file suffix -> format
OUTPUT_FORMATS = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv"}
ON_ERROR = ("skip", "fail")
#: ``--ids``: the users' raw ids (through the model's vocabulary) or the model's own rows
IDS = ("raw", "model")
_SHOWN = 20  # skipped rows printed one by one; the rest are counted


class Predictor(Protocol):
    """What :func:`predict_file` calls (a :class:`~tzrec_gr.serving.ServingSession` is one)."""

    def recommend(self, users: Histories, k: int = 10, *, exclude_seen: bool = True) -> TopK:
        """Top-``k`` items per user (retrieval)."""

    def score(self, users: Histories, candidates: Sequence[Sequence[int]]) -> torch.Tensor:
        """[L_t, K] per-task probabilities of the candidates, in input order (ranking)."""


def session_limits(session: Any, tasks: Optional[Sequence[str]] = None) -> Limits:
    """The :class:`Limits` of a :class:`~tzrec_gr.serving.ServingSession`'s model.

    Args:
        session: the session.
        tasks: ranking: a name per task for the output columns. Default: ``task_0``,
            ``task_1``, ...
    """
    model, server = session.model, session.server
    if server.kind == "retrieval":
        return Limits(server.kind, model.num_items, server.max_events)
    width = server.contextual_width
    names = (
        tuple(tasks) if tasks is not None else tuple(f"task_{i}" for i in range(model.num_tasks))
    )
    if len(names) != model.num_tasks:
        raise ValueError(f"tasks has {len(names)} names but the model has {model.num_tasks} tasks")
    return Limits(server.kind, model.num_items, server.max_events, model.max_targets, width, names)


def item_vocabulary(
    ids: Optional[str], vocabularies: Optional[IdVocabularies], what: str
) -> Tuple[Optional[Vocabulary], str]:
    """``--ids``: the vocabulary :func:`predict_file` maps item ids with (None: the model's
    ids), and a line saying which ids the run reads and writes.

    Args:
        ids (str | None): ``"raw"``, ``"model"``, or None: raw when ``vocabularies`` is
            given, else the model's ids (the line then is a note saying why).
        vocabularies (IdVocabularies | None): the checkpoint's or package's.
        what (str): the checkpoint or package, for the messages.

    Raises:
        PredictError: ``ids="raw"`` for a file without a vocabulary, or an unknown ``ids``.
    """
    if ids not in (None, *IDS):
        raise PredictError(f"--ids must be 'raw' or 'model', got {ids!r}")
    if ids == "model":
        return None, "item ids: the model's rows 0..N-1 (--ids model)"
    if vocabularies is None:
        if ids == "raw":
            raise PredictError(
                f"--ids raw: {what} holds no id vocabulary (a checkpoint without one, or a "
                "plain state dict), so it knows only the model's item ids; pass --ids "
                "model to read and write those, or train it again"
            )
        return None, (
            f"note: {what} holds no id vocabulary (a checkpoint without one, or a plain "
            "state dict): item ids are the model's rows 0..N-1 (tzrec-bench numbers items "
            "in the order of their raw ids)"
        )
    items = vocabularies.items
    source = f" of {vocabularies.source}" if vocabularies.source else ""
    return items, f"item ids: raw ({len(items)} {items.kind} ids{source}; --ids model for rows)"


def seen_rule(exclude_seen: bool) -> str:
    """The header's words for ``--exclude-seen``."""
    if exclude_seen:
        return "seen items excluded (--exclude-seen)"
    return "seen items kept, as the trainer's metrics rank them (--exclude-seen to leave out)"


# -- files ----------------------------------------------------------------------------------


def output_format(path: Union[str, pathlib.Path]) -> str:
    """``"parquet"`` or ``"csv"`` from the suffix; PredictError naming ``--output``
    otherwise."""
    return suffix_format(path, OUTPUT_FORMATS, "--output")


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


# -- predictions ----------------------------------------------------------------------------


def _recommend(
    predictor: Predictor,
    rows: List[Row],
    limits: Limits,
    k: int,
    exclude_seen: bool,
    items: Optional[Vocabulary],
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
        top = [i for i, _ in kept]
        out.append(
            {
                "user_id": r.user_id,
                "item_ids": top if items is None else items.raw(top),
                "scores": [s for _, s in kept],
            }
        )
    return out


def _score(
    predictor: Predictor, rows: List[Row], limits: Limits, items: Optional[Vocabulary]
) -> List[Dict[str, Any]]:
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
                "candidates": r.candidates if items is None else items.raw(r.candidates),
                **{task: block[t] for t, task in enumerate(limits.tasks)},
            }
        )
    return out


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
    exclude_seen: bool = False,
    items: Optional[Vocabulary] = None,
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
            Default: False (the trainer's rule: seen items are ranked like any other).
        items (Vocabulary | None): the model's raw item ids (:func:`item_vocabulary`):
            ``item_ids`` and ``candidates`` are read and written as raw ids, an unknown one
            is a bad row. None: they are the model's ids ``[0, num_items)``. Default: None.
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
    if items is not None and len(items) != limits.num_items:
        raise PredictError(
            f"the item vocabulary has {len(items)} ids but the model {limits.num_items} items"
        )
    if retrieval:
        columns = [("user_id", "id"), ("item_ids", "items"), ("scores", "floats")]
    else:
        columns = [("user_id", "id"), ("candidates", "items")]
        columns += [(task, "floats") for task in limits.tasks]
    summary = PredictSummary()
    start = time.perf_counter()
    writer = Writer(output, fmt, columns, "int" if items is None else items.kind)
    bar = _progress(total, progress)
    batch: List[Row] = []

    def flush() -> None:
        if not batch:
            return
        if retrieval:
            out = _recommend(predictor, batch, limits, k, exclude_seen, items)
        else:
            out = _score(predictor, batch, limits, items)
        writer.write(out)
        summary.written += len(out)
        batch.clear()

    try:
        for number, record in records:
            summary.rows += 1
            row = record if isinstance(record, str) else check_row(number, record, limits, items)
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
    """``--device`` through :func:`tzrec_ops.devices.resolve_device`: ``auto`` (the GPU when
    CUDA is available, else the CPU) or a torch device name.

    Raises:
        PredictError: an unknown device, or CUDA asked for where it is not available.
    """
    try:
        return resolve_device(name)
    except DeviceError as exc:
        raise PredictError(f"--device {exc}") from None


def add_predict_arguments(parser: argparse.ArgumentParser) -> None:
    """The options both ``predict`` commands share: ``--input``, ``--output``, ``--k``,
    ``--exclude-seen/--no-exclude-seen`` (default: seen items kept), ``--ids``,
    ``--batch-size``, ``--device``, ``--on-error``, ``--no-progress``."""
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
        default=False,
        help="retrieval: never recommend an item of the user's history (default: they are "
        "ranked like any other item, as the trainer's metrics rank them)",
    )
    parser.add_argument(
        "--ids",
        choices=IDS,
        default=None,
        help="item ids of item_ids, candidates and the output: raw (the ids of the event "
        "log the model was trained on, through the vocabulary its file carries: the "
        "default) or model (the model's rows 0..N-1); a file without a vocabulary reads "
        "model ids, with a note (--ids raw: an error)",
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
