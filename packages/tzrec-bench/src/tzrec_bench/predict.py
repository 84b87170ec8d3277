"""``tzrec-bench predict``: top-K recommendations or candidate scores for a file of users.

::

    tzrec-bench predict runs/hstu --input users.parquet --output top10.parquet --k 10
    tzrec-bench predict runs/ranking/best.pt --input users.csv --output scores.csv

The model is a checkpoint of ``tzrec-bench train`` (``best.pt``, or a run's folder: its
``best.pt``, else ``checkpoint.pt``, :func:`tzrec_gr.checkpoint.resolve_checkpoint`) of
``hstu-retrieval`` (top-K of the catalogue per user) or ``hstu-ranking`` (per-task
probabilities of each user's candidates), served by
:class:`tzrec_gr.serving.ServingSession`. Item ids are the raw ids of the data the model was
trained on, through the vocabulary the checkpoint carries (``--ids model``: the model's rows;
a checkpoint without a vocabulary reads model ids, with a note). Seen items are kept unless
``--exclude-seen`` (the trainer's rule). The first lines say which rules apply. Reading,
checking, batching and writing are :func:`tzrec_gr.serving.files.predict_file`, shared with
``python -m tzrec_acc predict``; the input columns and the output are described there and
in the README.

Exit status: 0 on success; 1 for a missing input file, or a bad row under
``--on-error fail`` (named by its row number; no output written); 2 for bad options, a
missing output folder, a damaged checkpoint or one of a model ``predict`` does not serve.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

__all__ = ["add_parser", "run", "task_names"]


def add_parser(subparsers: argparse._SubParsersAction, formatter: type) -> argparse.ArgumentParser:
    """The ``predict`` subcommand's parser."""
    from tzrec_gr.serving.files import add_predict_arguments

    p = subparsers.add_parser(
        "predict",
        help="top-K recommendations or candidate scores for a file of users' histories",
        description=(
            "Load a model trained by `tzrec-bench train` (hstu-retrieval or hstu-ranking) "
            "and write, for every user of --input, the top --k items of the catalogue "
            "(retrieval; the user's own items ranked like any other, as the trainer's "
            "metrics do, unless --exclude-seen) or each candidate's probability per task "
            "(ranking). Item ids are raw: the ids of the event log the model was trained "
            "on, through the vocabulary its checkpoint carries (an unknown id is a bad "
            "row); --ids model reads and writes the model's rows 0..num_items-1 instead. "
            "Bad rows are reported by row number (the first data row is 1)."
        ),
        epilog=(
            "input columns: user_id, item_ids, timestamps, and for ranking actions and "
            "candidates (contextual too for a model with contextual features); lists are "
            "lists in Parquet and JSONL, space-separated strings in CSV ('3 17 42').\n"
            "examples:\n"
            "  tzrec-bench predict runs/hstu --input users.parquet --output top10.parquet\n"
            "  tzrec-bench predict runs/ranking/best.pt --input users.csv --output scores.csv"
        ),
        formatter_class=formatter,
    )
    p.add_argument("checkpoint", metavar="PATH",
                   help="a run's --out-dir (its best.pt, else checkpoint.pt) or a .pt file")
    add_predict_arguments(p)
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


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Runs ``predict``; returns the exit status."""
    from tzrec_bench.train import checkpoint
    from tzrec_gr.checkpoint import resolve_checkpoint
    from tzrec_gr.serving.files import (
        BadRowError,
        PredictError,
        check_output_path,
        input_format,
        item_vocabulary,
        pick_device,
        predict_file,
        seen_rule,
    )
    from tzrec_gr.vocabulary import IdVocabularies, VocabularyError

    # every option, the output folder and the input file first: no model is loaded for a
    # run that cannot finish
    try:
        check_output_path(args.output)
        input_format(args.input)
        device = pick_device(args.device)
        if args.batch_size < 1:
            raise PredictError(f"--batch-size must be >= 1, got {args.batch_size}")
        if args.k < 1:
            raise PredictError(f"--k must be >= 1, got {args.k}")
    except (PredictError, ImportError) as exc:
        return _fail(parser, str(exc), 2)
    if not Path(args.input).is_file():
        return _fail(parser, f"--input: no file at {args.input}", 1)
    file = resolve_checkpoint(args.checkpoint)
    if not file.is_file():
        return _fail(parser, f"checkpoint: no checkpoint at {file}", 2)
    payload = checkpoint.load(file)  # CheckpointError: exit 2, naming the file
    try:
        vocabularies = IdVocabularies.from_payload(payload, str(file))
        items, ids_line = item_vocabulary(args.ids, vocabularies, str(file))
        session, tasks = _session(payload, file, device, args.backend, vocabularies)
    except (ValueError, TypeError, PredictError, VocabularyError) as exc:
        return _fail(parser, str(exc), 2)
    from tzrec_gr.serving.files import session_limits

    limits = session_limits(session, tasks)
    what = (
        f"top {args.k} of {limits.num_items} items" if limits.kind == "retrieval"
        else f"{len(limits.tasks)} task probabilities ({', '.join(limits.tasks)}) per candidate"
    )
    rules = f"; {seen_rule(args.exclude_seen)}" if limits.kind == "retrieval" else ""
    print(f"tzrec-bench predict: {payload['config'].get('model', '?')} from {file} on "
          f"{device}: {what}{rules}")
    print(ids_line)
    try:
        summary = predict_file(
            session,
            limits,
            args.input,
            args.output,
            k=args.k,
            exclude_seen=args.exclude_seen,
            items=items,
            batch_size=args.batch_size,
            on_error=args.on_error,
            progress=args.progress,
        )
    except BadRowError as exc:
        return _fail(parser, f"{args.input} {exc} (--on-error fail: nothing written)", 1)
    except PredictError as exc:
        return _fail(parser, str(exc), 2)
    print(f"wrote {args.output}: {summary}")
    return 0


def _session(
    payload: Dict[str, Any], file: Path, device: Any, backend: Any, vocabularies: Any
) -> Tuple[Any, Any]:
    """The serving session over the checkpoint's model, and its task names (ranking)."""
    from tzrec_gr.models import build_from_config
    from tzrec_gr.serving import ServingSession

    spec = payload.get("model_config")
    name = payload["config"].get("model", "?")
    if not isinstance(spec, dict) or spec.get("model") not in ("HSTURetrieval", "HSTURanking"):
        raise ValueError(
            f"{file} holds a {name} model; predict serves hstu-retrieval and hstu-ranking "
            "checkpoints"
        )
    model = build_from_config(spec, backend)
    try:
        model.load_state_dict(payload["model"])
    except RuntimeError as exc:
        raise ValueError(f"the state dict in {file} does not fit its model: {exc}") from exc
    bits: List[int] = list(spec["kwargs"].get("task_bitmasks", []))
    tasks = task_names(bits) if spec["model"] == "HSTURanking" else None
    return ServingSession(model, device=device, vocabularies=vocabularies), tasks
