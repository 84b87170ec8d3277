"""The ``tzrec-bench`` command: ``train``, ``evaluate``, ``predict``, ``ops``, ``run-configs``
and ``plan`` (also ``python -m tzrec_bench``).

    tzrec-bench train --model hstu-retrieval --data synthetic --epochs 3
    tzrec-bench train --model sasrec --data ml-100k --data-dir ../shared/data/ml-100k
    torchrun --nproc-per-node 2 -m tzrec_bench train --max-steps 100   # data-parallel
    torchrun --nproc-per-node 2 -m tzrec_bench train --model hstu-ranking --sharding torchrec
    tzrec-bench plan --items 1e9 --embedding-dim 256 --world-size 64 --device cuda
    tzrec-bench evaluate tzrec-bench-runs/run --split test
    tzrec-bench predict tzrec-bench-runs/run --input users.parquet --output top10.parquet
    tzrec-bench predict tzrec-bench-runs/run --users 17,42 --output top10.csv
    tzrec-bench show tzrec-bench-runs/run --user 17
    tzrec-bench serve tzrec-bench-runs/run --port 8000     # the serve extra
    tzrec-bench ops --op hstu_mha --backends pytorch,triton --mode fwd,bwd
    tzrec-bench run-configs hstu-retrieval-synthetic --repeats 3

Each subcommand is a function that adds its parser and one that runs it (``SUBCOMMANDS``),
so more subcommands slot in beside these; each lives in its own module (``train`` and
``evaluate``: :mod:`tzrec_bench.train.command`).

Bad option values, damaged checkpoints and an ``--out-dir`` holding another run's files
exit with status 2 and a message naming the option or file; missing or malformed data
files, data with nothing to evaluate and a diverged run (a NaN or infinite loss or score)
exit with status 1; Ctrl-C exits 130.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import Callable, Dict, Optional, Sequence, Tuple

from tzrec_bench import __version__
from tzrec_bench.data import DataFormatError
from tzrec_bench.data.cache import CacheLockTimeout
from tzrec_bench.train import command as train_command
from tzrec_bench.train.checkpoint import CheckpointError, DataMismatchError
from tzrec_bench.train.config import ConfigError
from tzrec_bench.train.metrics import NonFiniteError
from tzrec_bench.train.run_folder import RunFolderError
from tzrec_ops.commandline import ArgumentParser


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` where there is a default worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False, True, argparse.SUPPRESS) or "default" in action.help:
            return action.help
        return super()._get_help_string(action)


# -- train and evaluate (tzrec_bench.train.command) ------------------------------------------


def _add_train(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return train_command.add_train_parser(subparsers, _HelpFormatter)


def _add_evaluate(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return train_command.add_evaluate_parser(subparsers, _HelpFormatter)


# -- predict -------------------------------------------------------------------------------


def _add_predict(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from tzrec_bench.predict import add_parser

    return add_parser(subparsers, _HelpFormatter)


def _run_predict(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from tzrec_bench.predict import run

    return run(args, parser)


def _add_show(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from tzrec_bench.show import add_parser

    return add_parser(subparsers, _HelpFormatter)


def _run_show(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from tzrec_bench.show import run

    return run(args, parser)


def _add_serve(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from tzrec_bench.service.command import add_parser

    return add_parser(subparsers, _HelpFormatter)


def _run_serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from tzrec_bench.service.command import run

    return run(args, parser)


# -- ops -----------------------------------------------------------------------------------


def _add_ops(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from tzrec_bench.benchmarks.opbench.command import add_parser

    return add_parser(subparsers, _HelpFormatter)


def _run_ops(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from tzrec_bench.benchmarks.opbench.command import UsageError, run_command

    try:
        return run_command(args)
    except UsageError as exc:  # one line, no usage block: the message names the option
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2


# -- run-configs ---------------------------------------------------------------------------


def _add_run_configs(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from tzrec_bench.regression.command import add_parser

    return add_parser(subparsers, _HelpFormatter)


def _run_run_configs(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from tzrec_bench.regression.command import run

    return run(args, parser)


# -- entry point -----------------------------------------------------------------------------

Runner = Callable[[argparse.Namespace, argparse.ArgumentParser], int]
# -- plan ------------------------------------------------------------------------------------


def _add_plan(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from tzrec_bench.plan import add_parser

    return add_parser(subparsers, _HelpFormatter)


def _run_plan(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from tzrec_bench.plan import run

    return run(args, parser)


def _add_train_speed(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from tzrec_bench.benchmarks.train_speed import add_parser

    return add_parser(subparsers, _HelpFormatter)


def _run_train_speed(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from tzrec_bench.benchmarks.train_speed import run

    return run(args, parser)


SUBCOMMANDS: Dict[str, Tuple[Callable[..., argparse.ArgumentParser], Runner]] = {
    "train": (_add_train, train_command.run_train),
    "evaluate": (_add_evaluate, train_command.run_evaluate),
    "predict": (_add_predict, _run_predict),
    "show": (_add_show, _run_show),
    "serve": (_add_serve, _run_serve),
    "ops": (_add_ops, _run_ops),
    "run-configs": (_add_run_configs, _run_run_configs),
    "plan": (_add_plan, _run_plan),
    "train-speed": (_add_train_speed, _run_train_speed),
}


def build_parser() -> Tuple[argparse.ArgumentParser, Dict[str, argparse.ArgumentParser]]:
    """The top-level parser and each subcommand's parser."""
    parser = ArgumentParser(
        prog="tzrec-bench",
        description="Train and evaluate tzrec-gr models and baselines on recommendation data, "
        "check them against baselines, and time tzrec-ops ops per backend.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    return parser, {name: add(subparsers) for name, (add, _) in SUBCOMMANDS.items()}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs one subcommand; returns the exit status (argparse exits 2 on bad options)."""
    parser, subparsers = build_parser()
    args = parser.parse_args(argv)
    sub = subparsers[args.command]
    try:
        return SUBCOMMANDS[args.command][1](args, sub)
    except ConfigError as exc:
        sub.error(str(exc))  # exits with status 2
    except (CheckpointError, DataMismatchError, RunFolderError) as exc:  # a damaged or
        # foreign checkpoint, data it was not trained on, a folder holding another run
        print(f"{sub.prog}: error: {exc}", file=sys.stderr)
        return 2
    except (FileNotFoundError, DataFormatError, CacheLockTimeout) as exc:
        print(f"{sub.prog}: error: {exc}", file=sys.stderr)
        return 1
    except NonFiniteError as exc:  # a diverged run: no metric, a non-zero exit
        print(f"{sub.prog}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 speaks for every rank
            print(_interrupted_message(exc, argv), file=sys.stderr)
        return 130


def _interrupted_message(exc: KeyboardInterrupt, argv: Optional[Sequence[str]]) -> str:
    """What Ctrl-C left behind, and the command that continues a training run: under
    torchrun (``WORLD_SIZE`` above 1) a torchrun command with this run's processes per node,
    e.g. ``torchrun --standalone --nproc-per-node 2 -m tzrec_bench train ... --resume``."""
    from tzrec_bench.train.interrupts import Interrupted

    if not isinstance(exc, Interrupted) or exc.checkpoint is None:
        return "tzrec-bench: interrupted"
    # --overwrite started the run anew: the run to continue is the one it started
    args = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--overwrite"]
    if "--resume" not in args:
        args.append("--resume")
    command, where = "tzrec-bench", ""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        nodes = ("--standalone " if per_node == world_size
                 else f"--nnodes {world_size // per_node} ")
        command = f"torchrun {nodes}--nproc-per-node {per_node} -m tzrec_bench"
        if per_node != world_size:
            where = "\n(on every node, with this run's rendezvous options)"
    return (
        f"tzrec-bench: interrupted at step {exc.step}; checkpoint saved to {exc.checkpoint}\n"
        f"continue with: {command} {shlex.join(args)}{where}"
    )
