"""``predict``: a checkpoint's or a package's predictions for a file of users."""

from __future__ import annotations

import argparse
import pathlib
from typing import Any, Optional, Tuple

from tzrec_acc.cli._options import UsageError, _files, _model_file
from tzrec_ops.extras import require


def _predict(args: argparse.Namespace, destination: Optional[str] = None) -> int:
    """``predict``; ``destination`` names where the rows go in the last line (default:
    ``--output``)."""
    files = _files()
    try:  # the options and files first: nothing is loaded for a run that cannot finish
        files.check_output_path(args.output)
        files.input_format(args.input)
        device = files.pick_device(args.device)
        if args.batch_size < 1 or args.k < 1:
            raise files.PredictError("--batch-size and --k must be >= 1")
        if not pathlib.Path(args.input).is_file():
            raise files.PredictError(f"--input: no file at {args.input}")
        model_path = _model_file(args.model, args.config)
        if not model_path.is_file():
            raise files.PredictError(f"model: no file at {model_path}")
    except files.PredictError as exc:
        raise UsageError(str(exc)) from exc
    batch_size = args.batch_size
    if model_path.suffix == ".pt2":
        if args.config is not None or args.backend is not None:
            raise UsageError("--config and --backend apply to checkpoints, not to packages")
        predictor, limits, batch_size = _package_predictor(model_path, batch_size)
        what = f"package {model_path}"
    else:
        from tzrec_acc.checkpoint import load_checkpoint

        serving = _serving()
        try:
            model, vocabularies = load_checkpoint(model_path, args.config, args.backend)
            predictor = serving.ServingSession(model, device=device, vocabularies=vocabularies)
        except (ValueError, TypeError) as exc:
            raise UsageError(str(exc)) from exc
        limits = files.session_limits(predictor)
        what = f"{type(model).__name__} from {model_path} on {device}"
    command = require("tzrec_gr.serving.predict_command", "tzrec-acc[gr]", "predict")
    try:  # the header, the summary line and the exit status: tzrec-bench predict's too
        return command.run_predict(predictor, limits, args, prog="python -m tzrec_acc predict",
                                   title=f"{what} ({limits.kind})", model_file=str(model_path),
                                   batch_size=batch_size, destination=destination)
    except files.PredictError as exc:
        raise UsageError(str(exc)) from exc


def _package_predictor(path: pathlib.Path, batch_size: int) -> Tuple[Any, Any, int]:
    """(session, limits, batch size) of a ``--form full`` package written by export
    (:class:`tzrec_acc.serving.PackageSession`), in batches of at most its ``--max-batch``."""
    from tzrec_acc import serving

    try:
        session = serving.PackageSession(path)
    except (FileNotFoundError, ValueError) as exc:
        raise UsageError(str(exc)) from exc
    return session, session.limits, min(batch_size, session.max_batch)


def _serving() -> Any:
    """:mod:`tzrec_gr.serving` (``tzrec-acc[gr]``)."""
    return require("tzrec_gr.serving", "tzrec-acc[gr]", "predict")
