"""Batch predictions from files: users' histories in, top-K items or candidate scores out.

Legend: B = users per batch, K = items returned (retrieval) or tasks (ranking).

The one implementation behind ``tzrec-bench predict`` (from a training checkpoint) and
``python -m tzrec_acc predict`` (from a checkpoint or an exported package): both build a
*predictor* (a :class:`~tzrec_gr.serving.ServingSession`, or anything with its
``recommend`` / ``score``) and its :class:`Limits`, then call
:func:`~tzrec_gr.serving.predict_command.run_predict` (the header and ids lines, then
:func:`write_predictions`: :func:`predict_file` or :func:`predict_records`, the summary line
and the exit status); their options come from :func:`add_predict_arguments`.

Why it lives here: tzrec-gr is the one package both commands import (tzrec-bench depends on
it; tzrec-acc serves tzrec-gr models only with its ``[gr]`` extra), it holds the serving API
the predictions come from, and nothing here adds a hard dependency to it: Parquet needs
pyarrow, imported only for a Parquet file (:func:`tzrec_ops.extras.require`; tzrec-bench
installs it), the progress bar tqdm when installed (none without it); CSV, TSV and JSONL are
read and written with the standard library.

Input (one row per user; ``--input`` ``.parquet``/``.pq``, ``.csv``, ``.tsv`` or
``.jsonl``/``.ndjson``/``.json`` (JSON lines), the text ones optionally ``.gz`` and with a
UTF-8 byte-order mark, as training reads them):

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

Lists are lists in Parquet and JSONL; in CSV and TSV a JSON list (``["a b", "c,d"]``: what
the output's CSV writes, and the way to give ids with spaces or commas) or space-separated
ids (``"3 17 42"``; brackets and commas tolerated). An item of a history the model does not
know (``--unknown-items``) is left out of it by default, counted and reported
(``unknown_items="drop"``: a model trained with ``--min-events`` drops rare items, and the
rest of the user's history still says who they are), or skips the user's row
(``"skip-user"``); an unknown candidate always skips the row. A history longer than the
model takes keeps its newest events (as training does); with ``exclude_seen`` the dropped
events' items stay excluded.

Ids (``--ids``, :func:`item_vocabulary`): a checkpoint or package that carries the training
data's :class:`~tzrec_gr.vocabulary.IdVocabularies` takes and returns *raw* item ids, the
ids of the event log it was trained on (integers of any range, or strings; a CSV field is
read with the vocabulary's ``parse``; in JSONL and Parquet ``"12"`` and ``12`` are the same
id), mapped to the model's rows on the host; an id the vocabulary does not hold is a bad
row (or is dropped, above). Raw integer ids are never read as the model's rows, even when
they fall inside ``0..N-1``. The model's own ids ``[0, num_items)`` are read and written only with
``--ids model`` (``items=None``), and by a file that carries no vocabulary (the commands
print a note).

Seen items (retrieval): left out by default, as ``ServingSession.recommend`` and
``PackageSession.recommend`` do (``exclude_seen=True``): a user's own items are not
recommended again; ``--include-seen`` (or ``--no-exclude-seen``) ranks them like any other
item, as tzrec-bench's trainer metrics do.

Output (``--output`` ``.parquet``/``.pq`` or ``.csv``; one row per valid input row, in input
order): retrieval: ``user_id``, ``item_ids`` (the top ``k``, best first, in the input's
kind of ids; fewer when the user has seen nearly the whole catalogue) and ``scores``;
ranking: ``user_id``, ``candidates`` and one column of probabilities per task (in the
candidates' order). In CSV every list is a JSON list in its cell (``["a b", "c,d"]``,
``[0.91, 0.5]``): any id reads back with a CSV reader and ``json.loads``. The file is
written under a temporary name and renamed at the end, so a failed run leaves no partial
output, and a run that answers no row (every one skipped, or none read) writes none and
raises :class:`NothingAnsweredError`.

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
import sys
from typing import Any, Optional, Sequence, Tuple

import torch

from tzrec_gr.serving._predict import (
    ON_ERROR,
    OUTPUT_FORMATS,
    BadRow,
    Predictor,
    PredictSummary,
    Records,
    check_options,
    check_output_path,
    output_format,
    predict_file,
    predict_records,
)
from tzrec_gr.serving._rows import (
    INPUT_FORMATS,
    UNKNOWN_ITEMS,
    BadRowError,
    Limits,
    NothingAnsweredError,
    PredictError,
    PredictKind,
    input_format,
    predict_kind,
    read_records,
)
from tzrec_gr.vocabulary import IdVocabularies, Vocabulary
from tzrec_ops.devices import DeviceError, resolve_device

__all__ = [
    "BadRow",
    "BadRowError",
    "IDS",
    "INPUT_FORMATS",
    "Limits",
    "NothingAnsweredError",
    "OUTPUT_FORMATS",
    "PredictError",
    "PredictKind",
    "PredictSummary",
    "Predictor",
    "UNKNOWN_ITEMS",
    "add_predict_arguments",
    "check_options",
    "check_output_path",
    "input_format",
    "item_vocabulary",
    "output_format",
    "pick_device",
    "predict_file",
    "predict_kind",
    "predict_records",
    "read_records",
    "seen_rule",
    "session_limits",
    "write_predictions",
]

#: output file suffix -> format
#: ``--ids``: the users' raw ids (through the model's vocabulary) or the model's own rows
IDS = ("raw", "model")


def session_limits(session: Any, tasks: Optional[Sequence[str]] = None) -> Limits:
    """The :class:`Limits` of a :class:`~tzrec_gr.serving.ServingSession`'s model.

    Args:
        session: the session.
        tasks: ranking: a name per task for the output columns. Default: ``task_0``,
            ``task_1``, ...

    The server says what its rows hold (:meth:`ModelServer.predict_limits
    <tzrec_gr.serving.ModelServer.predict_limits>`).
    """
    return session.server.predict_limits(tasks)


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
    """The header's words for ``--exclude-seen`` / ``--include-seen``."""
    if exclude_seen:
        return "seen items excluded (--include-seen to rank them too)"
    return "seen items kept, as the trainer's metrics rank them (--include-seen)"


def write_predictions(
    predictor: Predictor,
    limits: Limits,
    args: argparse.Namespace,
    *,
    prog: str,
    items: Optional[Vocabulary],
    batch_size: int,
    records: Optional[Tuple[Optional[int], Records]] = None,
    destination: Optional[str] = None,
) -> int:
    """The end of both ``predict`` commands (their driver,
    :func:`~tzrec_gr.serving.predict_command.run_predict`, calls it): the predictions of
    ``args.input`` (or of
    ``records``: ``(total, records)``, e.g. users looked up by id) to ``args.output`` with
    the options of :func:`add_predict_arguments`, then the summary line on stdout
    (``wrote DESTINATION: ...``, default ``args.output``).

    Returns:
        0, or 1 after one line ``{prog}: error: ...`` on stderr for a bad row under
        ``--on-error fail`` or no row answered (nothing written either way).

    Raises:
        PredictError: a bad option or file (the caller's exit status 2).
    """
    options = dict(k=args.k, exclude_seen=args.exclude_seen, items=items,
                   batch_size=batch_size, on_error=args.on_error,
                   unknown_items=args.unknown_items, progress=args.progress)
    source = args.input if records is None else "the users"
    try:
        if records is None:
            summary = predict_file(predictor, limits, args.input, args.output, **options)
        else:
            summary = predict_records(predictor, limits, records[1], args.output,
                                      total=records[0], **options)
    except BadRowError as exc:
        print(f"{prog}: error: {source} {exc} (--on-error fail: nothing written)",
              file=sys.stderr)
        return 1
    except NothingAnsweredError as exc:
        print(f"{prog}: error: {source}: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {destination or args.output}: {summary}")
    return 0


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


def add_predict_arguments(parser: argparse.ArgumentParser, input_required: bool = True) -> None:
    """The options both ``predict`` commands share: ``--input`` (required unless
    ``input_required`` is False: the command has another source of users), ``--output``,
    ``--k``, ``--exclude-seen/--no-exclude-seen/--include-seen`` (default: seen items
    excluded), ``--unknown-items``, ``--ids``, ``--batch-size``, ``--device``,
    ``--on-error``, ``--no-progress``."""
    parser.add_argument(
        "--input",
        required=input_required,
        metavar="FILE",
        help="users' histories: .parquet, .csv, .tsv or .jsonl/.json (JSON lines; the text "
        "ones may be .gz) with columns user_id, item_ids, timestamps (lists; in CSV a JSON "
        "list or ids separated by spaces), and for ranking actions and candidates (and "
        "contextual when the model has contextual features)",
    )
    parser.add_argument(
        "--output",
        required=True,
        metavar="FILE",
        help="predictions, one row per user: .parquet or .csv (its folder must exist; in CSV "
        "every list is a JSON list in its cell, so any id reads back)",
    )
    parser.add_argument("--k", type=int, default=10, help="retrieval: items recommended per user")
    parser.add_argument(
        "--exclude-seen",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="retrieval: never recommend an item of the user's history (the default, as "
        "ServingSession.recommend; --no-exclude-seen or --include-seen: rank them like any "
        "other item, as the trainer's metrics do)",
    )
    parser.add_argument(
        "--include-seen",
        dest="exclude_seen",
        action="store_false",
        help="retrieval: rank the user's own items like any other (= --no-exclude-seen)",
    )
    parser.add_argument(
        "--unknown-items",
        choices=UNKNOWN_ITEMS,
        default="drop",
        help="an item of a history the model does not know (e.g. one --min-events left out "
        "of training): drop it from the history (the default: counted and reported) or skip "
        "the user (a bad row); an unknown candidate always skips the row",
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
        help="a bad row (unknown candidate, unsorted timestamps, empty history...): skip it, "
        "report its row number and count it; or fail naming it (exit 1, no output written)",
    )
    parser.add_argument(
        "--no-progress", dest="progress", action="store_false", help="no progress bar"
    )
