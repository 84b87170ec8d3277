"""``tzrec-bench predict``: top-K recommendations or candidate scores for users.

::

    tzrec-bench predict runs/hstu --input users.parquet --output top10.parquet --k 10
    tzrec-bench predict runs/ranking/best.pt --input users.csv --output scores.csv
    tzrec-bench predict runs/hstu --users 17,42 --output top10.csv       # histories from
    tzrec-bench predict runs/hstu --users-file ids.txt --data events.csv   # the run's log

The model is a checkpoint of ``tzrec-bench train`` (``best.pt``, or a run's folder: its
``best.pt``, else ``checkpoint.pt``, :func:`tzrec_gr.checkpoint.resolve_checkpoint`) of
a model with a registered server (:func:`tzrec_gr.serving.server.server_for`), e.g.
``hstu-retrieval`` (top-K of the catalogue per user) or ``hstu-ranking`` (per-task
probabilities of each user's candidates), loaded by :func:`tzrec_gr.checkpoint.load_model`
(which checks its vocabulary against its catalogue) and served by
:class:`tzrec_gr.serving.ServingSession`. Item ids are the raw ids of the data the model was
trained on, through the vocabulary the checkpoint carries (``--ids model``: the model's rows;
a checkpoint without a vocabulary reads model ids, with a note). Seen items are left out
unless ``--include-seen``; an item the model does not know is dropped from a history
(counted) unless ``--unknown-items skip-user``. The first lines say which rules apply.

The users are the rows of ``--input`` (the columns: :mod:`tzrec_gr.serving.files`), or
(retrieval) the raw user ids of ``--users`` / ``--users-file``, whose histories are read from
the run's event log (``--data`` for another copy or path) through the same reader, column
mapping, ``--min-events`` and cache as training (:mod:`tzrec_bench.predict_users`); ids the
log does not hold are counted and named, not an error. The header and ids lines, reading,
checking, batching, writing and the summary are
:func:`tzrec_gr.serving.predict_command.run_predict`, shared with ``python -m tzrec_acc
predict``. A CSV output holds one row per user with each list as a JSON list in
its cell (``["a b", "c,d"]``), so any id reads back with a CSV reader.

Exit status: 0 when at least one user was answered (the last line counts answered and
skipped rows); 1 for a missing input, users or data file, a bad row under ``--on-error
fail`` (named by its row number), or no user answered (every row skipped, no --users id in
the log); no output is written then; 2 for bad options, a missing output folder, a damaged
checkpoint or one of a model ``predict`` does not serve.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = ["EXPECTED", "add_parser", "load_session", "run", "task_names"]

#: what predict and show read, for the messages about other files
EXPECTED = "a checkpoint.pt or best.pt written by `tzrec-bench train`"


def add_parser(subparsers: argparse._SubParsersAction, formatter: type) -> argparse.ArgumentParser:
    """The ``predict`` subcommand's parser."""
    from tzrec_gr.serving.files import add_predict_arguments

    p = subparsers.add_parser(
        "predict",
        help="top-K recommendations or candidate scores for users (a file of histories, or "
        "user ids of the run's log)",
        description=(
            "Load a model trained by `tzrec-bench train` (any with a registered server: "
            "hstu-retrieval, hstu-ranking or a plugin's) "
            "and write, for every user of --input (or of --users/--users-file: their "
            "histories are read from the run's event log), the top --k items of the "
            "catalogue (retrieval; the user's own items left out unless --include-seen) or "
            "each candidate's probability per task (ranking). Item ids are raw: the ids of "
            "the event log the model was trained on, through the vocabulary its checkpoint "
            "carries; an item the model does not know is dropped from the history and "
            "counted (--unknown-items skip-user: the row is skipped); --ids model reads and "
            "writes the model's rows 0..num_items-1 instead. Bad rows are reported by row "
            "number (the first data row is 1). Exit 1 when no user could be answered."
        ),
        epilog=(
            "input columns: user_id, item_ids, timestamps, and for ranking actions and "
            "candidates (contextual too for a model with contextual features); lists are "
            "lists in Parquet and JSON lines, JSON lists or space-separated ids in CSV/TSV.\n"
            "output: one row per user; in CSV each list is a JSON list in its cell "
            "(read back with csv + json.loads).\n"
            "examples:\n"
            "  tzrec-bench predict runs/hstu --input users.parquet --output top10.parquet\n"
            "  tzrec-bench predict runs/ranking/best.pt --input users.csv --output scores.csv\n"
            "  tzrec-bench predict runs/hstu --users 17,42 --output top10.csv\n"
            "  tzrec-bench show runs/hstu --user 17     # the history predict uses"
        ),
        formatter_class=formatter,
    )
    p.add_argument("checkpoint", metavar="PATH",
                   help="a run's --out-dir (its best.pt, else checkpoint.pt) or a .pt file")
    add_predict_arguments(p, input_required=False)
    users = p.add_argument_group("users by id (retrieval; instead of --input)")
    users.add_argument("--users", metavar="ID,ID,...",
                       help="raw user ids of the run's event log, comma-separated")
    users.add_argument("--users-file", metavar="FILE", help="raw user ids, one a line")
    users.add_argument("--data", metavar="LOG",
                       help="the event log to read the users' histories from, with the "
                       "run's --columns and --min-events (default: the run's --data)")
    p.add_argument("--backend", metavar="NAME",
                   help="tzrec-ops backend to serve with, e.g. pytorch or triton (default: "
                   "the one saved with the model)")
    return p


def task_names(bits: Sequence[int]) -> Tuple[str, ...]:
    """The ranking tasks' names (``click``, ``like``, ``long_view``) from their label bits;
    ``task_<bit>`` for a bit tzrec-bench does not name."""
    from tzrec_bench.train.ranking import TASK_BITS

    names = {int(bit): name for name, bit in TASK_BITS.items()}
    return tuple(names.get(int(b), f"task_{int(b)}") for b in bits)


def _fail(parser: argparse.ArgumentParser, message: str, status: int) -> int:
    print(f"{parser.prog}: error: {message}", file=sys.stderr)
    return status


def _check_source(args: argparse.Namespace) -> None:
    """One source of users: ``--input``, or ``--users``/``--users-file`` (PredictError)."""
    from tzrec_gr.serving.files import PredictError, input_format

    by_id = [o for o, v in (("--users", args.users), ("--users-file", args.users_file)) if v]
    if args.input is not None and by_id:
        raise PredictError(f"--input and {by_id[0]} are two sources of users; give one")
    if len(by_id) == 2:
        raise PredictError("--users and --users-file: give one")
    if args.input is None and not by_id:
        raise PredictError("give the users: --input FILE, --users ID,... or --users-file FILE")
    if args.data is not None and not by_id:
        raise PredictError("--data applies with --users or --users-file (the histories of "
                           "--input are in the file)")
    if args.input is not None:
        input_format(args.input)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Runs ``predict``; returns the exit status."""
    from tzrec_bench.predict_users import read_user_ids
    from tzrec_gr.checkpoint import resolve_checkpoint
    from tzrec_gr.serving.files import (
        PredictError,
        check_output_path,
        pick_device,
        session_limits,
    )
    from tzrec_gr.serving.predict_command import run_predict

    # every option, the output folder and the input file first: no model is loaded for a
    # run that cannot finish
    try:
        check_output_path(args.output)
        _check_source(args)
        user_ids = None if args.input is not None else read_user_ids(args.users, args.users_file)
        device = pick_device(args.device)
        if args.batch_size < 1:
            raise PredictError(f"--batch-size must be >= 1, got {args.batch_size}")
        if args.k < 1:
            raise PredictError(f"--k must be >= 1, got {args.k}")
    except (PredictError, ImportError, ValueError) as exc:
        return _fail(parser, str(exc), 2)
    if args.input is not None and not Path(args.input).is_file():
        return _fail(parser, f"--input: no file at {args.input}", 1)
    file = resolve_checkpoint(args.checkpoint)
    if not file.is_file():
        return _fail(parser, f"checkpoint: no checkpoint at {file}", 2)
    try:
        session, tasks, config = load_session(file, device, args.backend)
        limits = session_limits(session, tasks)
        if user_ids is not None and limits.extra_columns:
            raise PredictError(_by_id_needs(limits.extra_columns))
    except (ValueError, TypeError, PredictError) as exc:  # CheckpointError is a ValueError
        return _fail(parser, str(exc), 2)
    title = (f"{config.get('model', type(session.model).__name__)} from {file} on {device}: "
             f"{_predicts(limits, args.k)}")
    users = None if user_ids is None else _users(user_ids, args.data, config)
    try:
        return run_predict(session, limits, args, prog=parser.prog, title=title,
                           model_file=str(file), batch_size=args.batch_size, users=users)
    except PredictError as exc:
        return _fail(parser, str(exc), 2)


def _by_id_needs(columns: Sequence[str]) -> str:
    """Why ``--users`` cannot give a model's rows: they need ``columns`` besides the
    histories the log holds."""
    named = ", ".join(columns)
    return (f"--users: the model's rows need {named} besides the histories the run's log "
            f"holds; give them in --input FILE (columns user_id, item_ids, timestamps, "
            f"{named})")


def _predicts(limits: Any, k: int) -> str:
    """What the header says is predicted per user."""
    if limits.predicts.takes_k:
        return f"top {k} of {limits.num_items} items"
    tasks = limits.tasks
    return f"{len(tasks)} task probabilities ({', '.join(tasks)}) per candidate"


def load_session(
    file: Path, device: Any = "cpu", backend: Optional[str] = None, encode_graphs: bool = True
) -> Tuple[Any, Optional[Tuple[str, ...]], Dict[str, Any]]:
    """The serving session over the checkpoint's model (through
    :func:`tzrec_gr.checkpoint.load_model`: its weights and its vocabulary checked against
    its catalogue), its task names (a model built with label bits per task: ranking) and
    the run's saved settings. ``encode_graphs``: the session's (False: whole histories are
    encoded eagerly).

    Raises:
        CheckpointError (a ValueError): a damaged checkpoint, or one of a model without a
            registered server (:func:`tzrec_gr.serving.server.server_for`); ValueError: an
            unknown backend.
    """
    from tzrec_gr.checkpoint import CheckpointError, load_model
    from tzrec_gr.models.registry import record_for_class
    from tzrec_gr.serving import ServingSession
    from tzrec_gr.serving.server import servable_models, server_for

    model, vocabularies = load_model(file, backend, expected=EXPECTED)
    config, bits = _saved(file)
    try:
        server_for(model)
    except TypeError:
        name = config.get("model", type(model).__name__)
        served = ", ".join(record_for_class(c).name for c in servable_models())
        raise CheckpointError(f"{file} holds a {name} model, which has no registered server; "
                              f"predict serves {served}") from None
    tasks = None if bits is None else task_names(bits)
    session = ServingSession(model, device=device, vocabularies=vocabularies,
                             encode_graphs=encode_graphs)
    return session, tasks, config


def _saved(file: Path) -> Tuple[Dict[str, Any], Optional[List[int]]]:
    """The run's saved settings (``config``; empty for a checkpoint written without them)
    and the label bit of each task the model was built with (its ``task_bitmasks``; None
    for a model without), read with the tensors memory-mapped: the weights were read once
    by load_model."""
    import torch

    payload = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    payload = payload if isinstance(payload, dict) else {}
    config = payload.get("config")
    spec = payload.get("model_config")
    kwargs = spec.get("kwargs") if isinstance(spec, dict) else None
    bits = kwargs.get("task_bitmasks") if isinstance(kwargs, dict) else None
    return (dict(config) if isinstance(config, dict) else {},
            None if bits is None else [int(b) for b in bits])


def _users(ids: List[str], data_path: Optional[str], config: Dict[str, Any]) -> Any:
    """The :data:`~tzrec_gr.serving.predict_command.Users` of the raw user ids ``ids``, whose
    histories are read from the run's log (or ``data_path``); a bad ``data_path`` is a
    PredictError (exit 2), a malformed or missing log exit 1 (by main)."""
    from tzrec_bench.data import DataFormatError
    from tzrec_gr.serving.files import PredictError

    def users(items: Any) -> Any:
        try:
            return _found(ids, data_path, config, items is not None)
        except DataFormatError:
            raise
        except ValueError as exc:
            raise PredictError(str(exc)) from exc

    return users


def _found(ids: List[str], data_path: Optional[str], config: Dict[str, Any],
           raw_items: bool) -> Any:
    """``(total, records)`` of the users ``ids`` found in the run's log (or ``data_path``),
    after a line naming those it does not hold; an exit status when none is found."""
    from tzrec_bench.predict_users import load_run_data, lookup_users, user_records

    data = load_run_data(config, data_path)  # FileNotFoundError, DataFormatError: exit 1
    lookup = lookup_users(data.dataset, ids)
    if lookup.unknown:
        print(f"{lookup.unknown_line(data.source)}", file=sys.stderr)
    if not lookup.found:
        print(f"tzrec-bench predict: error: no user could be answered ({len(ids)} ids, none "
              f"in {data.source}); nothing written", file=sys.stderr)
        return 1
    print(f"users: {len(lookup.found)} of {len(ids)} found in {data.source}")
    return len(lookup.found), user_records(data.dataset, lookup, raw_items)
