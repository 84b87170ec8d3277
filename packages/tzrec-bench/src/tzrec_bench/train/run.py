"""What every training run shares, fitted or trained by gradient steps: the data, task and
model, validation with early stopping and the best weights, ``checkpoint.pt``, the test
split evaluated with the best weights, and the report (rank 0 alone prints and writes).

:class:`Run` is the base of :class:`~tzrec_bench.train.loop.Trainer` and
:class:`~tzrec_bench.train.fitted.FittedRun`; each says how the model gets its weights
(:meth:`Run.advance`) and what ``checkpoint.pt`` holds of its model and optimizer.
"""

from __future__ import annotations

import dataclasses
import json
import math
import resource
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from tqdm import tqdm

from tzrec_bench.data import SequenceDataset, load_dataset
from tzrec_bench.data.log_files import describe_files
from tzrec_bench.train import checkpoint, run_folder, validation
from tzrec_bench.train.checkpoint import RunFiles
from tzrec_bench.train.config import TrainConfig
from tzrec_bench.train.distributed import DistContext, barrier, gather_objects
from tzrec_bench.train.early_stopping import EarlyStopping
from tzrec_bench.train.factory import (
    build_model,
    is_fitted,
    item_attributes,
    make_task,
    model_config,
)
from tzrec_bench.train.plot import plot_curves
from tzrec_bench.train.report import (
    evaluated_users,
    metrics_table,
    steady_state,
    throughput_line,
)
from tzrec_bench.train.run_folder import HISTORY_FILE, METRICS_FILE, PLOT_FILE
from tzrec_bench.train.strategies import Strategy, WholeModel
from tzrec_gr.embeddings import TableFactory
from tzrec_gr.models.registry import get_model
from tzrec_gr.vocabulary import VOCABULARY_KEY
from tzrec_ops.registry import resolve_backend


@dataclass
class RunResult:
    """What :func:`~tzrec_bench.train.loop.train` returns (on every rank).

    Attributes:
        steps: optimizer steps taken in total (a resumed run counts the earlier ones).
        stopped_early: early stopping ended the run.
        best_step: the step of the best validation metric (None if never validated).
        valid: validation metrics at ``best_step``.
        test: test metrics of the best weights.
        history: ``{"train": [{step, loss, tokens_per_s, seconds, tokens, samples}],
            "valid": [{step, metrics...}]}`` (train: one entry per log window).
        train_seconds: time spent in training steps in this process (no evaluation).
        tokens: tokens of the global batches trained on in this process.
        out_dir: the run's folder.
        peak_memory: each rank's peak resident memory (bytes) by the end of training,
            before the final evaluation.
    """

    steps: int
    stopped_early: bool
    best_step: Optional[int]
    valid: Dict[str, float]
    test: Dict[str, float]
    history: Dict[str, List[Dict[str, Any]]]
    train_seconds: float
    tokens: int
    out_dir: Path
    peak_memory: List[int] = dataclasses.field(default_factory=list)


def json_text(value: Any, indent: Optional[int] = None) -> str:
    """``value`` as strict JSON: a NaN or infinite number (a metric of no user) is null,
    never the bare ``NaN`` that JSON readers refuse."""
    return json.dumps(_finite(value), indent=indent, allow_nan=False) + "\n"


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def load_data(config: TrainConfig, ctx: DistContext) -> SequenceDataset:
    """The run's data set; rank 0 loads (and caches) it before the other ranks read it."""
    options = {}
    if config.data == "synthetic":
        options = {"num_users": config.synthetic_users, "num_items": config.synthetic_items}

    def load() -> SequenceDataset:
        return load_dataset(config.data, config.data_dir, config.cache_dir, config.seed,
                            columns=config.columns, min_events=config.min_events, **options)

    if ctx.is_main:
        dataset = load()
        barrier(ctx)
    else:
        barrier(ctx)
        dataset = load()
    return dataset


def backend_name(config: TrainConfig) -> str:
    """``ops backend <name>``: the tzrec-ops backend a model that takes one (a ``backend``
    argument) resolves to."""
    record = get_model(config.model)
    if record.fitted:
        return "counts (no tzrec-ops)"
    if not record.takes("backend"):
        return "plain PyTorch (no tzrec-ops)"
    return f"ops backend {resolve_backend(config.backend, op='hstu_mha').name}"


class Run:
    """One run's shared state and its end: validate, save, test, report.

    Args:
        config: the run's settings (already validated without the data).
        ctx: this process.
        embedding_tables: the item tables the model is built with (its strategy's).
    """

    #: where the best weights are kept (set by the subclass)
    strategy: Union[WholeModel, Strategy]

    def __init__(self, config: TrainConfig, ctx: DistContext,
                 embedding_tables: Union[str, TableFactory]) -> None:
        # stored absolute: the checkpoint finds its data from any folder
        self.config = config = config.with_absolute_paths()
        self.ctx = ctx
        self.out_dir = Path(config.out_dir)
        run_folder.check(config)  # before anything is read or written
        checkpoint.seed_everything(config.seed)  # the same initial weights on every rank
        dataset = load_data(config, ctx)
        validation.check_split(dataset.lengths, config)
        self.data_files = describe_files(dataset.files, dataset.skipped_files)
        self.vocabularies = dataset.id_vocabularies(config.shown("data"))
        self.task = make_task(config, dataset, ctx)
        validation.validate(config, ctx.device, validation.DataSize(
            self.task.num_items, len(self.task.train_rows), ctx.world_size))
        self.attributes = attributes = item_attributes(config, dataset)
        self.model = build_model(config, self.task.num_items, self.task.task_bits,
                                 ctx.device, embedding_tables=embedding_tables,
                                 attributes=attributes)
        torch.manual_seed(config.seed + ctx.rank)  # each rank its own dropout masks
        self._clear_earlier_run()
        self.files = RunFiles(self.out_dir, {
            "config": config.to_dict(),
            "model_config": model_config(config, self.task.num_items, self.task.task_bits,
                                         attributes),
            VOCABULARY_KEY: self.vocabularies.state(),  # encoded once, saved often
            # a new run's id; a resumed one takes its checkpoint's (continue_run)
            checkpoint.RUN_ID: gather_objects(run_folder.new_run_id(), ctx)[0],
        }, ctx.is_main)
        self.stopper = EarlyStopping(config.patience, config.min_delta)
        self.history: Dict[str, List[Dict[str, Any]]] = {"train": [], "valid": []}
        self.step = 0
        self.start_step = 0  # where this process began: a resumed run starts mid-history
        self._saved_step: Optional[int] = None

    def log(self, message: str) -> None:
        if self.ctx.is_main:
            tqdm.write(message)

    def _clear_earlier_run(self) -> None:
        """Rank 0 removes the run files that :func:`run_folder.check` let through: those of
        an earlier run under ``--overwrite``, or those of the run a fitted baseline fits
        again on ``--resume``."""
        if self.config.resume and not is_fitted(self.config):
            return
        if self.ctx.is_main:
            removed = run_folder.clear(self.out_dir)
            if removed:
                self.log(f"removed the earlier run's {', '.join(removed)} from "
                         f"{self.config.shown('out_dir')}")
        barrier(self.ctx)

    def continue_run(self, state: Dict[str, Any]) -> None:
        """A resumed run goes on as the run of ``state`` (its checkpoint.pt): every file
        it writes carries that run's id."""
        self.files.description[checkpoint.RUN_ID] = state.get(checkpoint.RUN_ID)

    # -- what a subclass says ----------------------------------------------------------

    def header(self) -> str:
        """The lines printed before the run starts."""
        raise NotImplementedError

    def advance(self) -> Tuple[float, int]:
        """Gives the model its weights; returns (seconds, tokens) trained in this process."""
        raise NotImplementedError

    def model_states(self) -> Dict[str, Any]:
        """checkpoint.pt's model, optimizer and scheduler entries (a collective)."""
        raise NotImplementedError

    def load_best(self) -> None:
        """Puts the weights the test split is evaluated with into the model."""
        self.strategy.load_best()

    # -- the run -----------------------------------------------------------------------

    def run(self) -> RunResult:
        """Fits or trains the model, then validates, saves, tests and reports."""
        self.log(self.header() + (f"\n  read {self.data_files}" if self.data_files else "")
                 + (f"\n  {self.attributes.describe()}" if self.attributes else ""))
        train_seconds, tokens = self.advance()
        # ru_maxrss is in KiB on Linux: the peak so far, before evaluation and gathering
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        peak_memory = [int(p) for p in gather_objects(peak, self.ctx)]
        if self.stopper.should_stop:
            self.log(f"early stopping at step {self.step}: no better {self.config.key_metric} "
                     f"in {self.stopper.bad_evaluations} evaluations")
        if not self.history["valid"] or self.history["valid"][-1]["step"] != self.step:
            self.validate()
        if self._saved_step != self.step:
            self.save_checkpoint()
        self.load_best()
        test = self.evaluate("test", self.config.test_users)
        valid = next(
            (r for r in self.history["valid"] if r["step"] == self.stopper.best_step),
            self.history["valid"][-1],
        )
        result = RunResult(
            steps=self.step,
            stopped_early=self.stopper.should_stop,
            best_step=self.stopper.best_step,
            valid={k: v for k, v in valid.items() if k != "step"},
            test=test,
            history=self.history,
            train_seconds=train_seconds,
            tokens=tokens,
            out_dir=self.out_dir,
            peak_memory=peak_memory,
        )
        self.strategy.publish_best(result.best_step, result.valid)
        if self.ctx.is_main:
            self._report(result)
        return result

    def evaluate(self, split: str, max_users: Optional[int]) -> Dict[str, float]:
        self.model.eval()
        try:
            return self.task.evaluate(self.model, split, max_users)
        finally:
            self.model.train()

    def validate(self) -> None:
        """Evaluates the validation split, updates early stopping and keeps a new best."""
        metrics = self.evaluate("valid", self.config.eval_users)
        key = self.config.key_metric
        improved = self.stopper.update(metrics[key], self.step)
        self.history["valid"].append({"step": self.step, **metrics})
        if improved:
            self.strategy.keep_best(self.step, metrics)
            note = "new best"
        elif self.stopper.best is None:
            note = "no valid value yet"
        else:
            note = f"best {self.stopper.best:.4f} at step {self.stopper.best_step}"
        self.log(f"step {self.step}: valid {key} {metrics[key]:.4f} ({note})")

    def save_checkpoint(self) -> None:
        """checkpoint.pt: what ``--resume`` restores, every rank's RNG state included."""
        rng = gather_objects(checkpoint.capture_rng(), self.ctx)  # a collective: every rank
        states = self.model_states()
        self.files.write(
            checkpoint.CHECKPOINT, self.step, world_size=self.ctx.world_size, **states,
            early_stopping=self.stopper.state_dict(), history=self.history, rng=rng,
        )
        barrier(self.ctx)  # no rank goes on (or exits) before the file is complete
        self._saved_step = self.step

    def _report(self, result: RunResult) -> None:
        """Prints the metrics table and throughput; writes the metrics, history and plot."""
        config = self.config
        self.out_dir.mkdir(parents=True, exist_ok=True)
        # a task that ranks the catalogue says whether history items took part
        seen = config.exclude_seen if config.facts.excludes_seen else None
        users_of = {split: len(getattr(self.task.split, split)) for split in ("valid", "test")}
        summary = {
            "steps": result.steps, "best_step": result.best_step,
            "stopped_early": result.stopped_early, "valid": result.valid, "test": result.test,
            "users": evaluated_users({"valid": result.valid, "test": result.test}, users_of),
            **({} if seen is None else {"exclude_seen": seen}),
        }
        (self.out_dir / METRICS_FILE).write_text(json_text(summary, indent=2))
        (self.out_dir / HISTORY_FILE).write_text(json_text(self.history))
        valid_column = f"valid (step {result.best_step})"
        print(metrics_table({valid_column: result.valid, "test": result.test}, exclude_seen=seen,
                            users_of={valid_column: users_of["valid"], "test": users_of["test"]}))
        if result.tokens:
            print(throughput_line(result.steps - self.start_step, result.train_seconds,
                                  result.tokens, self.ctx.placement, backend_name(config)))
            # windows of earlier processes (before --resume) are not this run's to report
            steady = steady_state(
                [w for w in self.history["train"] if w["step"] > self.start_step]
            )
            if steady:
                print(steady)
            gib = ", ".join(f"{p / 2**30:.2f}" for p in result.peak_memory)
            print(f"peak resident memory by the end of training (GiB, per rank): {gib}")
        if config.plot:
            shown = config.facts.plot_metrics(config.key_metric, result.test)
            try:
                path = plot_curves(self.history, shown,
                                   self.out_dir / PLOT_FILE,
                                   f"{config.model} on {config.shown('data')}",
                                   result.best_step)
                print(f"curves: {path}")
            except ImportError as exc:
                print(f"plot skipped: {exc}")
        print(f"checkpoints and metrics: {config.shown('out_dir')}")
