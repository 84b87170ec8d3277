"""``run``: replay a package's sample batch, or predict for a file of users."""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import sys
import tempfile
from typing import Any, Dict

import torch

from tzrec_acc.cli._options import UsageError, _parser
from tzrec_acc.cli._predict import _predict


def _run(args: argparse.Namespace) -> int:
    from tzrec_acc import aot
    from tzrec_acc.serving import sample_path

    if args.input is not None:
        return _run_file(args)
    if any(v is not None for v in (args.output, args.batch_size, args.on_error, args.ids)):
        raise UsageError("--output, --batch-size, --on-error and --ids apply with --input FILE")
    package = pathlib.Path(args.package)
    if package.is_dir():
        raise UsageError(
            f"{package} is a folder: run without --input replays an exported package's sample "
            "batch; export the run first (export --model FOLDER), or give --input FILE to "
            "predict from its checkpoint"
        )
    sample_file = pathlib.Path(sample_path(args.package))
    for path in (package, sample_file):
        if not path.is_file():
            raise UsageError(f"no file at {path} (write both with python -m tzrec_acc export)")
    sample: Dict[str, Any] = torch.load(sample_file, weights_only=False)
    batch = sample["batches"][0]
    (out,) = aot.run_in_fresh_process(str(package), [batch], sample["kind"], sample["imports"])
    for i, tensor in enumerate(out):
        print(f"output {i}: shape {list(tensor.shape)} {str(tensor.dtype).replace('torch.', '')}")
        print(f"  first rows: {tensor[:3].tolist()}")
    report = aot.parity(sample["expected"][0], out)
    print("package vs the eager outputs stored at export:")
    print("  " + str(report).replace("\n", "\n  "))
    return 0 if report.ok else 1


def _run_file(args: argparse.Namespace) -> int:
    """``run PACKAGE --input FILE``: ``predict PACKAGE --input FILE`` (parsed by predict's
    own parser, so its defaults apply to what ``run`` does not take); no ``--output``: the
    rows are written to a temporary CSV and printed to stdout, the other lines to stderr."""
    argv = ["predict", args.package, "--input", args.input]
    if args.batch_size is not None:
        argv += ["--batch-size", str(args.batch_size)]
    if args.on_error is not None:
        argv += ["--on-error", args.on_error]
    if args.ids is not None:
        argv += ["--ids", args.ids]
    if not args.progress:
        argv.append("--no-progress")
    if args.output is not None:
        return _predict(_parser().parse_args([*argv, "--output", args.output]))
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "predictions.csv")
        with contextlib.redirect_stdout(sys.stderr):
            code = _predict(_parser().parse_args([*argv, "--output", path]), "stdout")
        if code == 0:
            sys.stdout.write(pathlib.Path(path).read_text())
    return code
