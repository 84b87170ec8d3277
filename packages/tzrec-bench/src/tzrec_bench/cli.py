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
so more subcommands slot in beside these. The file is past 600 lines mostly for ``train``'s
option table (about 180 lines); moving that table to its own module is the next split.

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
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence, Tuple

from tzrec_bench import __version__
from tzrec_bench.data import DATASETS, DataFormatError
from tzrec_bench.data.cache import CacheLockTimeout
from tzrec_bench.data.load import DATA_ENV, DataOptionError, check_data_options
from tzrec_bench.train.checkpoint import CheckpointError, DataMismatchError
from tzrec_bench.train.config import (
    AMP_MODES,
    CUDA_GRAPHS,
    DEFAULT_EPOCHS,
    DEVICES,
    SHARDING_TYPES,
    SHARDINGS,
    TABLE_OPTIMIZER_NAMES,
    ConfigError,
    TrainConfig,
    model_choices,
)
from tzrec_bench.train.metrics import NonFiniteError
from tzrec_bench.train.run_folder import RunFolderError
from tzrec_bench.train.tasks import facts_of_task
from tzrec_gr.models.registry import TASKS, get_model
from tzrec_ops.commandline import ArgumentParser
from tzrec_ops.registry import BackendError, resolve_backend

DEFAULTS = TrainConfig()


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` where there is a default worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False, True, argparse.SUPPRESS) or "default" in action.help:
            return action.help
        return super()._get_help_string(action)


def _number(kind: type, least: float, inclusive: bool = True) -> Callable[[str], float]:
    """An argparse type: a ``kind`` at least (or above) ``least``, with a clear error."""
    bound = f">= {least}" if inclusive else f"> {least}"

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if kind is int else 'a number'} {bound}, got {text!r}"
            ) from None
        if value < least or (not inclusive and value == least):
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text!r}")
        return value

    return parse


def _fraction(text: str) -> float:
    value = _number(float, 0.0)(text)
    if value >= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text!r}")
    return value


POSITIVE = _number(int, 1)
COUNT = _number(int, 0)
#: the namespace entry listing the options typed on the command line (see _record_given)
GIVEN = "given_options"


def _record_given(parser: argparse.ArgumentParser) -> None:
    """Makes the options that ``parser`` stores (values and flags) note their ``dest`` in
    the namespace's :data:`GIVEN` set when typed, so that ``--resume`` can tell an option
    typed again from one left at its default. Call before adding the options."""
    for name in ("store", "store_true", "store_false"):
        base = parser._registry_get("action", name)

        class Recorded(base):  # type: ignore[misc, valid-type]
            def __call__(self, parser, namespace, values, option_string=None):
                super().__call__(parser, namespace, values, option_string)
                setattr(namespace, GIVEN, {*getattr(namespace, GIVEN, ()), self.dest})

        parser.register("action", name, Recorded)
        if name == "store":  # the action of an option that names none
            parser.register("action", None, Recorded)


# -- train -----------------------------------------------------------------------------------


def _model_line(name: str) -> str:
    """``--model``'s help for one model, from its record."""
    record = get_model(name)
    kind = f"{record.task}, fitted from counts" if record.fitted else record.task
    return f"{name} ({kind})" + (f": {record.description}" if record.description else "")


def _add_train(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "train",
        help="train a model, evaluate it, save checkpoints, metrics and curves",
        description=(
            "Train a model on a data set with AdamW, validate as it trains (leave-one-out: "
            "each user's second-to-last event), stop early when the validation metric stops "
            "improving, then evaluate the best weights on the test events (each user's "
            "last). Retrieval is ranked over the whole catalogue (HR@K, NDCG@K, MRR); "
            "ranking reports AUC per task. Under torchrun the same command trains "
            "data-parallel (DDP: gloo on CPU, NCCL on GPU) on the same global batches."
        ),
        epilog=(
            "examples:\n"
            "  tzrec-bench train --data synthetic --epochs 3\n"
            "  tzrec-bench train --model sasrec --data ml-100k --data-dir ../shared/data/ml-100k\n"
            "  torchrun --nproc-per-node 2 -m tzrec_bench train --max-steps 100\n"
            "outputs in --out-dir: checkpoint.pt (latest, for --resume), best.pt (best "
            "validation), metrics.json, history.json, curves.png"
        ),
        formatter_class=_HelpFormatter,
    )
    _record_given(p)
    d = DEFAULTS
    g = p.add_argument_group("what to train")
    g.add_argument("--model", choices=model_choices(), default=d.model,
                   help="a registered model (a plugin's too): " + "; ".join(
                       _model_line(name) for name in model_choices()))
    g.add_argument("--data", default=d.data, metavar="NAME|PATH",
                   help=f"a named data set ({', '.join(DATASETS)}: synthetic is generated, "
                   "the others are read from --data-dir), or the path of your own event log: "
                   "a file or a folder of Parquet, CSV, JSONL, 'user item [time]' text "
                   "or .seq ('user item item ...', one user a line) files, gzip allowed")
    g.add_argument("--data-dir", metavar="PATH",
                   help=f"folder with a named data set's files (default: ${DATA_ENV}/<data>; "
                   f"${DATA_ENV}/amazon-s3 for amazon-beauty and amazon-sports)")
    _add_log_options(g)
    g.add_argument("--cache-dir", metavar="PATH",
                   help="where parsed data sets are cached (default: $TZREC_BENCH_CACHE, "
                   "else ~/.cache/tzrec-bench)")
    g.add_argument("--synthetic-users", type=POSITIVE, default=d.synthetic_users, metavar="N",
                   help="users of the synthetic data set")
    g.add_argument("--synthetic-items", type=POSITIVE, default=d.synthetic_items, metavar="N",
                   help="catalogue size of the synthetic data set")

    g = p.add_argument_group("model")
    g.add_argument("--max-seq-len", type=POSITIVE, default=d.max_seq_len, metavar="N",
                   help="events of history kept per user (the most recent)")
    g.add_argument("--embedding-dim", type=POSITIVE, default=d.embedding_dim, metavar="E",
                   help="embedding and layer width")
    g.add_argument("--num-layers", type=POSITIVE, default=d.num_layers, metavar="N",
                   help="attention layers")
    g.add_argument("--num-heads", type=POSITIVE, default=d.num_heads, metavar="H",
                   help="attention heads (must divide --embedding-dim)")
    g.add_argument("--dropout", type=_fraction, default=d.dropout, metavar="P",
                   help="dropout rate, in [0, 1)")
    g.add_argument("--num-negatives", type=POSITIVE, default=d.num_negatives, metavar="N",
                   help="retrieval: sampled negatives per step (shared by every position); "
                   "at least the catalogue size: every item (the full softmax)")
    g.add_argument("--temperature", type=_number(float, 0.0, inclusive=False),
                   default=d.temperature, metavar="T",
                   help="retrieval: softmax temperature of the sampled-softmax loss")
    g.add_argument("--num-candidates", type=POSITIVE, default=d.num_candidates, metavar="N",
                   help="ranking: candidates per user in training (a window of its history "
                   "events at a random place each step)")
    g.add_argument("--no-input-projection", dest="input_projection", action="store_false",
                   help="hstu-retrieval: feed the item embeddings to the first layer as they "
                   "are scored (tied, as SASRec), without the input Linear map")
    g.add_argument("--linear-terms", action="store_true",
                   help="hstu-ranking: add linear maps of the user and of the item embedding "
                   "to each candidate's logits, beside the head's MLP of their product")

    g = p.add_argument_group("optimisation")
    g.add_argument("--batch-size", type=POSITIVE, default=d.batch_size, metavar="B",
                   help="users per global batch (split across processes under torchrun)")
    g.add_argument("--lr", type=_number(float, 0.0, inclusive=False), default=d.lr,
                   help="AdamW learning rate")
    g.add_argument("--weight-decay", type=_number(float, 0.0), default=d.weight_decay,
                   metavar="W", help="AdamW weight decay")
    g.add_argument("--warmup-steps", type=COUNT, default=d.warmup_steps, metavar="N",
                   help="steps of linear learning-rate warm-up")
    g.add_argument("--clip-grad-norm", type=_number(float, 0.0), default=d.clip_grad_norm,
                   metavar="X", help="clip the gradient norm to X (0 disables)")
    g.add_argument("--ema-decay", type=_fraction, default=d.ema_decay, metavar="D",
                   help="validate, keep (best.pt) and test an exponential moving average of "
                   "the weights, updated after each step with decay D (warm-up: "
                   "min(D, (1+t)/(10+t)) at step t), e.g. 0.999; checkpoint.pt keeps the "
                   "trained weights and the average; 0 (default): off")
    g.add_argument("--amp", choices=AMP_MODES, default=d.amp,
                   help="mixed precision: auto is bf16 autocast on CUDA, off on CPU")
    g.add_argument("--compile", action="store_true",
                   help="run the training step's forward (the model and its loss, hence "
                   "also the backward) through torch.compile; the first steps include the "
                   "compile time (about two compiles: sizes that change between batches "
                   "are made dynamic at the first recompile). Evaluation stays eager. With "
                   "dropout on, the compiled step draws its masks from Inductor's generator "
                   "(seeded by --seed; not the eager run's masks). Not with the fitted "
                   "baselines or --sharding torchrec")
    g.add_argument("--cuda-graphs", choices=CUDA_GRAPHS, default=d.cuda_graphs,
                   help="capture the whole training step (forward, loss, backward, clipping, "
                   "AdamW) in CUDA graphs, one per bucket of batch sizes (the batch padded "
                   "with users left out of the loss), and replay them: the GPU no longer "
                   "waits for Python. Under torchrun the graph also averages the gradients "
                   "(one NCCL all-reduce). auto: on a CUDA device, a model that supports "
                   "it, without --compile; on: also with --compile, an error where it "
                   "cannot apply; off: never")
    g.add_argument("--epochs", type=POSITIVE, metavar="N",
                   help=f"passes over the training users (default: {DEFAULT_EPOCHS} when "
                   "--max-steps is not given)")
    g.add_argument("--max-steps", type=POSITIVE, metavar="N",
                   help="stop after N optimizer steps in total (with --epochs, whichever "
                   "comes first)")

    g = p.add_argument_group("evaluation and early stopping")
    g.add_argument("--eval-every", type=POSITIVE, metavar="N",
                   help="validate every N steps (default: once per epoch) and at the end")
    g.add_argument("--eval-users", type=POSITIVE, metavar="N",
                   help="validate on a fixed random subset of N users (default: all)")
    g.add_argument("--test-users", type=POSITIVE, metavar="N",
                   help="test on a fixed random subset of N users (default: all), for quick "
                   "runs; the metrics table and metrics.json say how many of how many")
    g.add_argument("--eval-batch-size", type=POSITIVE, default=d.eval_batch_size, metavar="B",
                   help="users per evaluation batch")
    g.add_argument("--exclude-seen", action="store_true",
                   help="retrieval: rank each target among the items not already in the "
                   "user's history (for data where an item is consumed once, as MovieLens)")
    g.add_argument("--eval-negatives", type=COUNT, default=d.eval_negatives, metavar="N",
                   help="retrieval: also rank each target against N items the user never "
                   "interacted with (the SASRec paper's protocol, N=100; one seeded draw "
                   "shared by every model), reported as sampled_hr@10, sampled_ndcg@10 and "
                   "sampled_mrr beside the full-catalogue metrics; 0: off")
    tasks = [facts_of_task(task) for task in TASKS]
    g.add_argument("--metric", choices=[m for t in tasks for m in t.metrics], metavar="NAME",
                   help="validation metric for early stopping and best.pt (default: "
                   + ", ".join(f"{t.key_metric} for {t.name}" for t in tasks) + "); "
                   + "; ".join(f"{t.name}: {', '.join(t.metrics)}" for t in tasks))
    g.add_argument("--patience", type=COUNT, default=d.patience, metavar="N",
                   help="stop after N validations in a row without improvement (0 never stops)")
    g.add_argument("--min-delta", type=_number(float, 0.0), default=d.min_delta, metavar="X",
                   help="the least gain that counts as an improvement")

    g = p.add_argument_group(
        "the item table across processes",
        "--sharding torchrec splits the HSTU models' item table over the processes with "
        "torchrec's DistributedModelParallel (pip install 'tzrec-bench[torchrec]'); the "
        "table then trains with a fused optimizer at the constant --lr, and checkpoints "
        "are folders of each rank's shards (best.pt is gathered whole at the end)",
    )
    g.add_argument("--sharding", choices=SHARDINGS, default=d.sharding,
                   help="replicate: every process holds the whole model (DDP)")
    g.add_argument("--sharding-type", choices=SHARDING_TYPES, default=d.sharding_type,
                   help="how torchrec splits the table: row_wise (a slice of rows per rank), "
                   "table_wise (the whole table on one rank) or auto (its planner chooses)")
    g.add_argument("--table-optimizer", choices=TABLE_OPTIMIZER_NAMES,
                   default=d.table_optimizer,
                   help="the tables' fused optimizer (adam needs CUDA)")
    g.add_argument("--storage-reservation", type=_fraction, default=d.storage_reservation,
                   metavar="F", help="share of each device's memory the planner leaves "
                   "for the dense part and activations")

    g = p.add_argument_group("the run")
    g.add_argument("--device", choices=DEVICES, default=d.device,
                   help="auto is the GPU when CUDA is available (cuda:LOCAL_RANK under "
                   "torchrun), else the CPU")
    g.add_argument("--backend", metavar="NAME",
                   help="tzrec-ops backend of the HSTU models, e.g. pytorch or triton "
                   "(default: the best available: triton on a CUDA GPU, pytorch on CPU)")
    g.add_argument("--seed", type=COUNT, default=d.seed,
                   help="seed of the weights, the data order, the negatives and the "
                   "synthetic data")
    g.add_argument("--out-dir", default=d.out_dir, metavar="PATH",
                   help="folder for checkpoints, metrics and curves, of this run alone: a "
                   "new run refuses a folder holding an earlier run's files")
    g.add_argument("--overwrite", action="store_true",
                   help="a new run in an --out-dir holding an earlier run's files: remove "
                   "those files (checkpoints, metrics, curves; nothing else) and start anew")
    g.add_argument("--resume", action="store_true",
                   help="continue the run in --out-dir from its checkpoint.pt (model, "
                   "optimizer, data position, RNG) with that run's settings (data, columns "
                   "and every other option), but for the options typed again; "
                   "--max-steps/--epochs count from the start of the run")
    g.add_argument("--checkpoint-every", type=POSITIVE, metavar="N",
                   help="write checkpoint.pt every N steps (default: at each validation) "
                   "and at the end")
    g.add_argument("--log-every", type=POSITIVE, default=d.log_every, metavar="N",
                   help="record the loss and throughput every N steps")
    g.add_argument("--no-plot", dest="plot", action="store_false",
                   help="do not draw curves.png (it needs matplotlib: tzrec-bench[plot])")
    g.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bars, of training or evaluation (the metrics are "
                   "printed all the same)")
    return p


def _add_log_options(group: argparse._ArgumentGroup) -> None:
    """``--columns`` and ``--min-events``: how an event log given by path is read."""
    group.add_argument("--columns", metavar="KEY=COLUMN,...",
                       help="an event log's columns by name: user, item (ids: integers or "
                       "strings), time (integer Unix seconds, or Parquet/JSON timestamps; "
                       "'time=' for none: the file order), rating, action (an integer "
                       "bitmask); default user=user_id,item=item_id,time=timestamp (time used "
                       "when present); e.g. user=uid,item=sku,time=ts. Ties in time keep the "
                       "file order (files by name, rows in order)")
    group.add_argument("--min-events", type=COUNT, metavar="K",
                       help="k-core filter: drop users and items with fewer than K events, "
                       "repeatedly, until none is left (default: no filter)")


def _data_option_error(config: TrainConfig) -> Optional[str]:
    """What is wrong with --data and the options that go with it, before any file is read."""
    try:
        check_data_options(config.data, config.data_dir, config.columns, config.min_events)
    except (DataOptionError, FileNotFoundError) as exc:
        return str(exc)
    return None


def _backend_error(name: Optional[str]) -> Optional[str]:
    if name is None:
        return None
    try:
        resolve_backend(name)
    except BackendError as exc:
        return f"--backend {name}: {exc}"
    return None


def _run_train(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from tzrec_bench.train.loop import train
    from tzrec_bench.train.run_folder import resumed_config

    fields = {name: getattr(args, name) for name in DEFAULTS.to_dict() if hasattr(args, name)}
    fields["min_events"] = fields["min_events"] or 0
    config = TrainConfig(**fields)
    if config.resume:  # the checkpoint's settings, but for the options typed again
        config = resumed_config(config, getattr(args, GIVEN, set()))
    error = _data_option_error(config) or _backend_error(config.backend)
    if error:
        parser.error(error)
    train(config)
    return 0


# -- evaluate --------------------------------------------------------------------------------


def _add_evaluate(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "evaluate",
        help="evaluate a saved model on the test (or validation) events",
        description=(
            "Evaluate a model saved by `tzrec-bench train` with the settings it was trained "
            "with (stored in the checkpoint), over every evaluated user of the split (or a "
            "fixed subset of them: --max-users)."
        ),
        formatter_class=_HelpFormatter,
    )
    p.add_argument("checkpoint", metavar="PATH",
                   help="a run's --out-dir (its best.pt, else checkpoint.pt) or a .pt file")
    p.add_argument("--split", choices=("test", "valid"), default="test",
                   help="test: each user's last event; valid: the one before")
    p.add_argument("--data", metavar="NAME|PATH",
                   help="the data to evaluate on (default: the checkpoint's): a named data "
                   "set or an event log's path, as in train; refused unless its users, items "
                   "and events are those the model was trained on")
    p.add_argument("--data-dir", metavar="PATH",
                   help="a named data set's folder, if it moved since training")
    p.add_argument("--columns", metavar="KEY=COLUMN,...",
                   help="the event log's columns, as in train (default: the checkpoint's)")
    p.add_argument("--cache-dir", metavar="PATH", help="where parsed data sets are cached")
    p.add_argument("--device", choices=DEVICES, help="default: the one used in training")
    p.add_argument("--backend", metavar="NAME", help="tzrec-ops backend of the HSTU models")
    p.add_argument("--eval-batch-size", type=POSITIVE, metavar="B",
                   help="users per evaluation batch")
    p.add_argument("--eval-negatives", type=COUNT, metavar="N",
                   help="retrieval: also the sampled protocol against N negatives (see train)")
    p.add_argument("--max-users", type=POSITIVE, metavar="N",
                   help="evaluate a fixed random subset of N users of the split (default: "
                   "all; the same users as train's --test-users N, or --eval-users N)")
    p.add_argument("--no-progress", dest="progress", action="store_false", default=None,
                   help="no progress bar")
    return p


def _run_evaluate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from tzrec_bench.train.loop import evaluate
    from tzrec_gr.checkpoint import resolve_checkpoint

    if not resolve_checkpoint(args.checkpoint).is_file():
        parser.error(f"checkpoint: no checkpoint at {resolve_checkpoint(args.checkpoint)}")
    if args.data_dir is not None and not Path(args.data_dir).is_dir():
        parser.error(f"--data-dir: no such folder: {args.data_dir}")
    if args.data is not None:  # the rest is the checkpoint's, checked once it is read
        try:
            check_data_options(args.data, folders=False)
        except DataOptionError as exc:
            parser.error(str(exc))
    error = _backend_error(args.backend)
    if error:
        parser.error(error)
    overrides = {
        name: getattr(args, name)
        for name in ("data", "data_dir", "columns", "cache_dir", "device", "backend",
                     "eval_batch_size", "eval_negatives", "progress")
        if getattr(args, name) is not None
    }
    if args.data is not None:  # other data: the saved folder and mapping may not apply
        overrides.setdefault("data_dir", None)
        if args.data in DATASETS:
            overrides["columns"] = None
    evaluate(args.checkpoint, args.split, overrides, args.max_users)
    return 0


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
    "train": (_add_train, _run_train),
    "evaluate": (_add_evaluate, _run_evaluate),
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
