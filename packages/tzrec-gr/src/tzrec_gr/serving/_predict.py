"""The engine of :mod:`tzrec_gr.serving.files` (its docstring has the rules): the output
file check, the predictions of a batch of checked rows, and :func:`predict_records`, which
checks, batches and writes a stream of input records.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import sys
import time
from typing import (
    Any,
    Callable,
    Dict,
    Iterable,
    Iterator,
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
    UNKNOWN_ITEMS,
    BadRowError,
    Limits,
    NothingAnsweredError,
    PredictError,
    PredictKind,
    Row,
    check_row,
    read_records,
    suffix_format,
)
from tzrec_gr.serving.inputs import Histories
from tzrec_gr.serving.topk import TopK
from tzrec_gr.vocabulary import Vocabulary
from tzrec_ops.extras import require

OUTPUT_FORMATS = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv"}
ON_ERROR = ("skip", "fail")
_SHOWN = 20  # skipped rows printed one by one; the rest are counted


class Predictor(Protocol):
    """What :func:`predict_file` calls (a :class:`~tzrec_gr.serving.ServingSession` is one)."""

    def recommend(self, users: Histories, k: int = 10, *, exclude_seen: bool = True) -> TopK:
        """Top-``k`` items per user (retrieval)."""

    def score(self, users: Histories, candidates: Sequence[Sequence[int]]) -> torch.Tensor:
        """[L_t, K] per-task probabilities of the candidates, in input order (ranking)."""


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


#: the predictions of a model that recommends: each user's top ``k`` items and their scores
#: (:class:`~tzrec_gr.serving.RetrievalServer` registers it for its kind)
TOP_K = PredictKind(
    columns=(),
    takes_k=True,
    outputs=lambda limits: [("user_id", "id"), ("item_ids", "items"), ("scores", "floats")],
    predict=_recommend,
)
#: the predictions of a model that scores candidates: a probability per task of each
#: candidate (:class:`~tzrec_gr.serving.RankingServer` registers it for its kind)
SCORES = PredictKind(
    columns=("actions", "candidates", "contextual"),
    takes_k=False,
    outputs=lambda limits: [("user_id", "id"), ("candidates", "items"),
                            *((task, "floats") for task in limits.tasks)],
    predict=lambda predictor, rows, limits, k, exclude_seen, items: _score(
        predictor, rows, limits, items
    ),
)


@dataclasses.dataclass
class PredictSummary:
    """What :func:`predict_records` did.

    Attributes:
        rows (int): input rows read.
        written (int): output rows (users answered).
        skipped (list[BadRow]): the bad rows skipped, in file order.
        truncated (int): histories cut to the model's bound (newest events kept).
        dropped (int): events left out for an item the model does not know
            (``unknown_items="drop"``).
        dropped_users (int): the answered users those events were dropped from.
        seconds (float): wall time from the first row read to the output renamed.
    """

    rows: int = 0
    written: int = 0
    skipped: List[BadRow] = dataclasses.field(default_factory=list)
    truncated: int = 0
    dropped: int = 0
    dropped_users: int = 0
    seconds: float = 0.0

    @property
    def users_per_second(self) -> float:
        return self.written / self.seconds if self.seconds > 0 else float("inf")

    def counts(self) -> str:
        """``N rows read: A answered, S skipped`` and the dropped items, if any."""
        line = f"{self.rows} rows read: {self.written} answered, {len(self.skipped)} skipped"
        if self.dropped:
            line += (f"; {self.dropped} unknown items dropped from {self.dropped_users} "
                     "histories (--unknown-items skip-user to skip those users)")
        return line

    def __str__(self) -> str:
        line = (
            f"{self.written} users in {self.seconds:.2f} s ({self.users_per_second:,.1f} "
            f"users/s); {self.counts()}"
        )
        if self.truncated:
            line += f"; {self.truncated} histories cut to the model's newest events"
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


Records = Iterator[Tuple[int, Union[Dict[str, Any], str]]]


def predict_file(
    predictor: Predictor,
    limits: Limits,
    input_path: Union[str, pathlib.Path],
    output_path: Union[str, pathlib.Path],
    **options: Any,
) -> PredictSummary:
    """Predict for every row of ``input_path`` (``.parquet``/``.pq``, ``.csv``, ``.tsv``,
    ``.jsonl``/``.ndjson``/``.json``, the text ones optionally ``.gz``; columns in the module
    docstring) and write ``output_path``: :func:`predict_records` over its rows, with the
    same options.

    Raises:
        PredictError: a bad option or file (named), before any row is predicted; a file
            that cannot be read further on.
        BadRowError, NothingAnsweredError: as :func:`predict_records`.
    """
    check_options(limits, options.get("k", 10), options.get("batch_size", 64),
                  options.get("on_error", "skip"), options.get("unknown_items", "drop"))
    check_output_path(output_path)
    total, records = read_records(input_path)
    return predict_records(predictor, limits, _readable(records, input_path), output_path,
                           total=total, **options)


def _readable(records: Records, path: Union[str, pathlib.Path]) -> Records:
    """``records``, with a file that stops being readable part-way (a truncated ``.gz``,
    bytes that are not UTF-8) as a :class:`PredictError` naming it."""
    try:
        yield from records
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise PredictError(f"--input {path}: cannot be read ({type(exc).__name__}: {exc})"
                           ) from exc


def check_options(limits: Limits, k: Any, batch_size: Any, on_error: str,
                  unknown_items: str) -> None:
    """PredictError naming the first option :func:`predict_records` cannot take."""
    if on_error not in ON_ERROR:
        raise PredictError(f"--on-error must be 'skip' or 'fail', got {on_error!r}")
    if unknown_items not in UNKNOWN_ITEMS:
        raise PredictError(f"--unknown-items must be one of {', '.join(UNKNOWN_ITEMS)}, got "
                           f"{unknown_items!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise PredictError(f"--batch-size must be an int >= 1, got {batch_size!r}")
    if limits.predicts.takes_k and (
        isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= limits.num_items
    ):
        raise PredictError(f"--k must be in [1, {limits.num_items}] (the catalogue), got {k!r}")


def predict_records(
    predictor: Predictor,
    limits: Limits,
    records: Iterable[Tuple[int, Union[Dict[str, Any], str]]],
    output_path: Union[str, pathlib.Path],
    *,
    total: Optional[int] = None,
    k: int = 10,
    exclude_seen: bool = True,
    items: Optional[Vocabulary] = None,
    batch_size: int = 64,
    on_error: str = "skip",
    unknown_items: str = "drop",
    progress: bool = True,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
) -> PredictSummary:
    """Predict for every record and write ``output_path``.

    Args:
        predictor: a :class:`~tzrec_gr.serving.ServingSession` (or the same interface).
        limits (Limits): what rows must fit, and the kind of prediction.
        records: ``(row number, record)`` pairs (:func:`read_records`): a record is a dict
            of the input columns, or a string saying why its row could not be read.
        output_path: ``.parquet``/``.pq`` or ``.csv``; its folder must exist.
        total (int | None): the number of records, for the progress bar. Default: None.
        k (int): retrieval: items per user, in ``[1, num_items]``. Default: 10.
        exclude_seen (bool): retrieval: never return an item of the user's history.
            Default: True (as ``ServingSession.recommend``).
        items (Vocabulary | None): the model's raw item ids (:func:`item_vocabulary`):
            ``item_ids`` and ``candidates`` are read and written as raw ids. None: they are
            the model's ids ``[0, num_items)``. Default: None.
        batch_size (int): users per call of the predictor. Default: 64.
        on_error (str): ``"skip"`` (report bad rows by number, count them, go on) or
            ``"fail"`` (raise at the first). Default: ``"skip"``.
        unknown_items (str): an item of a history the model does not know: ``"drop"`` (its
            event is left out, counted) or ``"skip-user"`` (a bad row). Default: ``"drop"``.
        progress (bool): a progress bar on stderr (when tqdm is installed). Default: True.
        log: where the skipped rows are reported. Default: stderr.

    Returns:
        PredictSummary: rows read, answered, skipped, the events dropped, the time taken.

    Raises:
        PredictError: a bad option (named), before any row is predicted.
        BadRowError: ``on_error="fail"`` and a bad row (named by its number).
        NothingAnsweredError: no row could be answered (the counts in the message).
        No output file is left behind when any of these is raised.
    """
    check_options(limits, k, batch_size, on_error, unknown_items)
    output = pathlib.Path(output_path)
    fmt = check_output_path(output)
    if items is not None and len(items) != limits.num_items:
        raise PredictError(
            f"the item vocabulary has {len(items)} ids but the model {limits.num_items} items"
        )
    predicts = limits.predicts
    columns = predicts.outputs(limits)
    summary = PredictSummary()
    start = time.perf_counter()
    writer = Writer(output, fmt, columns, "int" if items is None else items.kind)
    bar = _progress(total, progress)
    batch: List[Row] = []

    def flush() -> None:
        if not batch:
            return
        out = predicts.predict(predictor, batch, limits, k, exclude_seen, items)
        writer.write(out)
        summary.written += len(out)
        batch.clear()

    try:
        for number, record in records:
            summary.rows += 1
            row = (record if isinstance(record, str)
                   else check_row(number, record, limits, items, unknown_items))
            if isinstance(row, str):
                if on_error == "fail":
                    raise BadRowError(number, row)
                summary.skipped.append(BadRow(number, row))
                if len(summary.skipped) <= _SHOWN:
                    log(f"skipped row {number}: {row}")
            else:
                summary.truncated += bool(row.older)
                summary.dropped += row.dropped
                summary.dropped_users += bool(row.dropped)
                batch.append(row)
                if len(batch) == batch_size:
                    flush()
            if bar is not None:
                bar.update(1)
        flush()
        if not summary.written:
            raise NothingAnsweredError(f"no row could be answered ({summary.counts()}); "
                                       "nothing written")
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
