"""``tzrec-bench train`` and ``evaluate``: their option tables and what runs them (the
dispatcher, :mod:`tzrec_bench.cli`, adds them beside the other subcommands).

Every ``train`` option is a :class:`~tzrec_bench.train.config.TrainConfig` field of the same
name; the options typed on the command line are recorded (:data:`GIVEN`) so that
``--resume`` can tell an option typed again from one left at its default.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable, Optional

from tzrec_bench.data import DATASETS
from tzrec_bench.data.load import DATA_ENV, DataOptionError, check_data_options
from tzrec_bench.train.config import (
    AMP_MODES,
    CUDA_GRAPHS,
    DEFAULT_EPOCHS,
    DEVICES,
    SHARDING_TYPES,
    SHARDINGS,
    TABLE_OPTIMIZER_NAMES,
    TrainConfig,
    model_choices,
)
from tzrec_bench.train.tasks import facts_of_task
from tzrec_gr.models.registry import TASKS, get_model
from tzrec_ops.registry import BackendError, resolve_backend

DEFAULTS = TrainConfig()


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


def add_train_parser(subparsers: argparse._SubParsersAction,
                     formatter: type) -> argparse.ArgumentParser:
    """The ``train`` subcommand's parser (its option table)."""
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
        formatter_class=formatter,
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
    g.add_argument("--item-attributes", metavar="PATH",
                   help="retrieval: a JSON file (gzip allowed) mapping each raw item id to a "
                   "list of attributes (categories, brands, ...); each item's embedding adds "
                   "the mean of its attributes' embeddings (S3-Rec's *_item2attributes.json "
                   "are in this format)")
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


def run_train(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Runs ``train``; returns the exit status."""
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


def add_evaluate_parser(subparsers: argparse._SubParsersAction,
                        formatter: type) -> argparse.ArgumentParser:
    """The ``evaluate`` subcommand's parser."""
    p = subparsers.add_parser(
        "evaluate",
        help="evaluate a saved model on the test (or validation) events",
        description=(
            "Evaluate a model saved by `tzrec-bench train` with the settings it was trained "
            "with (stored in the checkpoint), over every evaluated user of the split (or a "
            "fixed subset of them: --max-users)."
        ),
        formatter_class=formatter,
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


def run_evaluate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Runs ``evaluate``; returns the exit status."""
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
