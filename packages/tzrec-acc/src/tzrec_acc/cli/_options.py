"""The command line's parser and what its commands share: the usage error, the model file
an argument names and the tzrec-gr extra ``predict`` needs."""

from __future__ import annotations

import argparse
import pathlib
from typing import Any, Optional, Tuple

from tzrec_ops.commandline import ArgumentParser
from tzrec_ops.devices import add_device_option

FORMATS = ("aoti", "fx", "trt")
FORMS = ("full", "serving")
QUANTIZE = ("none", "emb-int8", "emb-int4", "emb-fp16", "dense-int8")
PRECISIONS = ("fp32", "bf16", "fp16")
DYNAMIC = ("users", "tokens")


class UsageError(Exception):
    """A bad option, file or model: exit status 2 with the message."""


def _dynamic(text: str) -> Tuple[str, ...]:
    if text == "none":
        return ()
    dims = tuple(d.strip() for d in text.split(",") if d.strip())
    bad = [d for d in dims if d not in DYNAMIC]
    if bad or not dims:
        raise argparse.ArgumentTypeError(
            f"--dynamic takes 'none' or a comma list of {', '.join(DYNAMIC)}, got {text!r}"
        )
    return dims


def _parser() -> argparse.ArgumentParser:
    from tzrec_acc import cli  # the first line of its docstring describes the command

    parser = ArgumentParser(
        prog="python -m tzrec_acc", description=cli.__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="export a saved tzrec-gr model as a package")
    ex.add_argument(
        "--model",
        required=True,
        help="tzrec-bench checkpoint or run folder (its best.pt, else checkpoint.pt), or a "
        "state dict",
    )
    ex.add_argument("--config", help="JSON/TOML model config, for a plain state dict")
    ex.add_argument(
        "--format",
        choices=FORMATS,
        help="default: trt with ENABLE_TRT=1, aoti with ENABLE_AOT=1, else fx",
    )
    ex.add_argument("--output", required=True, help="the package path (.pt2)")
    ex.add_argument(
        "--form",
        choices=FORMS,
        default="full",
        help="full forward, or the cached serving step (score / extend against a cache)",
    )
    ex.add_argument(
        "--dynamic",
        type=_dynamic,
        default=DYNAMIC,
        help="dynamic dims: 'users,tokens' (default), 'users', 'tokens' or 'none'",
    )
    ex.add_argument("--max-batch", type=int, default=256, help="users per call, at most")
    ex.add_argument(
        "--quantize",
        choices=QUANTIZE,
        help="default: from QUANT_EMB (FP32: none, INT8: emb-int8, ...)",
    )
    ex.add_argument("--precision", choices=PRECISIONS, default="fp32")
    ex.add_argument("--backend", help="ops backend to build the model with (e.g. pytorch)")
    add_device_option(ex, "cpu", "The device the package is exported for and served on.")
    ex.add_argument("--batch", type=int, default=4, help="users in the sample batch")
    ex.add_argument("--history", type=int, help="history events per user (default: bound)")
    ex.add_argument("--new", type=int, default=4, help="candidates / new events per user")
    ex.add_argument("--workspace-size", type=int, default=1 << 30, help="TensorRT bytes")
    ex.add_argument("--min-block-size", type=int, default=5, help="TensorRT block size")
    run = sub.add_parser(
        "run",
        help="score the sample batch with an exported package, or a file of users (--input)",
        description="Without --input: run the package on the sample batch stored beside it "
        "and compare with the eager outputs stored at export. With --input: predict for "
        "every user of the file, exactly as 'predict PACKAGE --input FILE' does.",
    )
    run.add_argument("package", help="a package written by export")
    run.add_argument(
        "--input",
        metavar="FILE",
        help="users' histories (.parquet, .csv or .jsonl, the columns of predict --input); "
        "the package must be one predict takes (a --form full package)",
    )
    run.add_argument(
        "--output",
        metavar="FILE",
        help="with --input: predictions to .parquet or .csv (default: CSV on stdout)",
    )
    run.add_argument("--batch-size", type=int, metavar="B", help="with --input: as predict's")
    run.add_argument("--on-error", choices=("skip", "fail"), help="with --input: as predict's")
    run.add_argument("--ids", choices=("raw", "model"), help="with --input: as predict's")
    run.add_argument(
        "--no-progress", dest="progress", action="store_false", help="with --input: no bar"
    )
    pr = sub.add_parser(
        "predict",
        help="top-K recommendations or candidate scores for a file of users' histories",
        description="Predict for every user of --input (Parquet, CSV or JSONL) and write "
        "--output (Parquet or CSV): top --k items (retrieval checkpoints and packages) or each "
        "candidate's probability per task (ranking checkpoints and packages); packages: "
        "written by export --form full.",
    )
    pr.add_argument(
        "model",
        help="a tzrec-bench checkpoint or run folder (its best.pt, else checkpoint.pt), a "
        "state dict (with --config) or a package (.pt2) written by export --form full",
    )
    pr.add_argument("--config", help="JSON/TOML model config, for a plain state dict")
    pr.add_argument("--backend", help="ops backend to build the model with (checkpoints)")
    try:
        _files().add_predict_arguments(pr)
    except ImportError:  # without tzrec-gr: ``predict`` says what to install when run
        pr.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def _files() -> Any:
    from tzrec_ops.extras import require

    return require("tzrec_gr.serving.files", "tzrec-acc[gr]", "predict")


def _model_file(model: str, config: Optional[str]) -> pathlib.Path:
    """``--model``: the file, or a tzrec-bench run's folder's ``best.pt``, else its
    ``checkpoint.pt`` (:func:`tzrec_gr.checkpoint.resolve_checkpoint`; a state dict with
    ``--config`` is a file)."""
    if config is not None or not pathlib.Path(model).is_dir():
        return pathlib.Path(model)
    from tzrec_acc.checkpoint import resolve_path

    return resolve_path(model)
