"""The training loop shared by every model, and evaluation of a saved run.

One optimizer step: every rank takes its slice of the global batch, computes its task's
mean loss scaled by its share of the global batch's loss terms, and DDP averages the
gradients, which makes them the gradients of the global-batch mean (the same as a
one-process run); then gradient clipping, AdamW and the warm-up schedule. Validation runs
every ``eval_every`` steps (default: once per epoch) and at the end; early stopping and
``best.pt`` follow ``config.key_metric``; the test split is evaluated once, with the best
weights. Rank 0 alone prints, plots and writes files.

A run that diverges reports nothing: a NaN or infinite training loss stops it with
:class:`~tzrec_bench.train.metrics.NonFiniteError` naming the step (checked on the device
each step, read at the log and validation steps that wait for the GPU anyway), and the
metrics refuse non-finite scores. Models without trainable parameters (the count-based
baselines of :mod:`tzrec_bench.baselines.simple`) are fitted once on the training events
instead of trained, then validated and tested the same way. Ctrl-C ends the run at a step
boundary (under torchrun, the same one on every rank) with a checkpoint that ``--resume``
continues exactly.
With ``--sharding torchrec`` the item table is split over the processes
(:mod:`tzrec_bench.train.sharding` says what else changes). With ``--compile`` the
training step's forward (model and loss, so also their backward) runs under
``torch.compile``, compiled in place before DDP wraps it; evaluation stays eager, and
checkpoints hold the same keys as an eager run's (they are read from the model itself).
On CUDA, AdamW uses its fused kernel.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import resource
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple, Union

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from tzrec_bench.data import SequenceDataset, load_dataset
from tzrec_bench.train import checkpoint
from tzrec_bench.train.config import ConfigError, TrainConfig
from tzrec_bench.train.distributed import (
    AnyRankFlag,
    DistContext,
    barrier,
    close,
    gather_objects,
    init_distributed,
    mean_over_ranks,
    pick_device,
    shard,
)
from tzrec_bench.train.early_stopping import EarlyStopping
from tzrec_bench.train.factory import build_model, is_fitted, make_task, model_config
from tzrec_bench.train.metrics import NonFiniteError
from tzrec_bench.train.plot import plot_curves
from tzrec_bench.train.report import (
    metrics_table,
    open_ended_progress,
    steady_state,
    throughput_line,
)
from tzrec_bench.train.sharding import (
    ShardedTables,
    check_catalogue,
    check_sharding,
    consolidate,
    meta_table,
    plan_lines,
)
from tzrec_bench.train.task import Batch, Task, amp_dtype, autocast
from tzrec_gr.serving import resolve_checkpoint
from tzrec_gr.vocabulary import VOCABULARY_KEY
from tzrec_ops.registry import resolve_backend

METRICS_FILE = "metrics.json"
# a sharded run's folders of shards (torch.distributed.checkpoint)
CHECKPOINT_SHARDS = "checkpoint.dcp"
BEST_SHARDS = "best.dcp"
HISTORY_FILE = "history.json"
PLOT_FILE = "curves.png"


@dataclass
class RunResult:
    """What :func:`train` returns (on every rank).

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


class TrainStep(nn.Module):
    """The model and its task's loss as one ``forward``.

    DDP synchronizes gradients only for computations that go through its own ``forward``,
    and the models' losses are methods, so DDP wraps this module rather than the model.
    """

    def __init__(self, model: nn.Module, task: Task) -> None:
        super().__init__()
        self.model = model
        self.task = task

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.task.loss(self.model, batch)


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
    """``ops backend <name>``: the tzrec-ops backend the HSTU models resolve to."""
    if config.model == "sasrec":
        return "plain PyTorch (no tzrec-ops)"
    if not config.model.startswith("hstu"):
        return "counts (no tzrec-ops)"
    return f"ops backend {resolve_backend(config.backend, op='hstu_mha').name}"


def _adamw(params: List[torch.Tensor], config: TrainConfig) -> torch.optim.AdamW:
    """The run's AdamW: the fused kernel when every parameter is on a CUDA device (one
    launch per step instead of one per parameter group of tensors), else torch's default
    (foreach on the CPU); the two agree within float rounding."""
    fused = True if params and all(p.is_cuda for p in params) else None
    return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay,
                             fused=fused)


def _load_optimizer_state(optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    """Loads ``state`` (an optimizer's ``state_dict``) into ``optimizer``, keeping the
    implementation ``optimizer`` was built with (fused or not), which a checkpoint written on
    another device may not share: ``load_state_dict`` alone takes the saved groups'."""
    optimizer.load_state_dict(state)
    fused = optimizer.defaults.get("fused")
    for group in optimizer.param_groups:
        for flag in ("fused", "foreach", "capturable"):
            if flag in optimizer.defaults:
                group[flag] = optimizer.defaults[flag]
        if fused:  # the fused kernel reads each step count on the parameter's device
            for param in group["params"]:
                entry = optimizer.state.get(param, {})
                if "step" in entry:
                    entry["step"] = entry["step"].to(param.device, torch.float32)


def _warmup(steps: int):
    return lambda step: min(1.0, (step + 1) / steps) if steps else 1.0


class Interrupted(KeyboardInterrupt):
    """Ctrl-C ended the run at a step boundary (the same one on every rank under torchrun);
    ``checkpoint`` is where ``--resume`` goes on (None when no checkpoint could be written)."""

    def __init__(self, step: int, checkpoint: Optional[Path]) -> None:
        super().__init__(step)
        self.step = step
        self.checkpoint = checkpoint


@contextlib.contextmanager
def _deferred_interrupts(enabled: bool) -> Iterator[List[bool]]:
    """While active, Ctrl-C (SIGINT) sets a flag (the yielded list's only item) instead of
    raising, so the loop can stop between steps; a second Ctrl-C raises at once. Off when
    not ``enabled`` and outside the main thread.

    Under torchrun the ranks run in sessions of their own, so a Ctrl-C reaches only
    torchrun, whose agent sends each rank one SIGINT (and SIGKILL 30 s later); the ranks
    may see it at different steps, and the loop agrees on the stop step through
    :class:`~tzrec_bench.train.distributed.AnyRankFlag`."""
    flag = [False]
    previous = None
    if enabled:
        def handler(signum: int, frame: Any) -> None:
            if flag[0]:
                raise KeyboardInterrupt
            flag[0] = True

        try:
            previous = signal.signal(signal.SIGINT, handler)
        except ValueError:  # not the main thread: Ctrl-C keeps its usual meaning
            previous = None
    try:
        yield flag
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


class Trainer:
    """One run: built from a config, then :meth:`run`. See the module docstring."""

    def __init__(self, config: TrainConfig, ctx: DistContext) -> None:
        self.config = config
        self.ctx = ctx
        self.out_dir = Path(config.out_dir)
        checkpoint.seed_everything(config.seed)  # the same initial weights on every rank
        dataset = load_data(config, ctx)
        self.vocabularies = dataset.id_vocabularies(config.data)
        self._vocabulary_state = self.vocabularies.state()  # encoded once, saved often
        self.task = make_task(config, dataset, ctx)
        self.sharded = config.sharding == "torchrec"
        check_catalogue(config, self.task.num_items)
        self.model = build_model(
            config, self.task.num_items, self.task.task_bits, ctx.device,
            embedding_tables=meta_table if self.sharded else "plain",
        )
        self.fitted = is_fitted(config)
        torch.manual_seed(config.seed + ctx.rank)  # each rank its own dropout masks
        step_module = TrainStep(self.model, self.task)
        self.tables: Optional[ShardedTables] = None
        if self.sharded:
            self.tables = ShardedTables(step_module, config, ctx)
            self.step_module: nn.Module = self.tables.module
            self.optimizer = self.tables.optimizer
            scheduled = self.tables.dense_optimizer  # the fused table optimizer has no warm-up
            self.clipped = self.tables.dense_parameters
        else:
            if config.compile:
                # in place (the module keeps its class and state_dict keys), and before DDP
                # wraps it, as torch advises; dynamic=None: the sizes that differ between
                # batches (tokens, candidates) become dynamic at the first recompile
                step_module.compile(dynamic=None)
            if ctx.distributed and not self.fitted:
                ids = [ctx.device.index] if ctx.device.type == "cuda" else None
                step_module = DistributedDataParallel(step_module, device_ids=ids)
            self.step_module = step_module
            # a fitted baseline has no parameters; AdamW over none would refuse to start
            trained = list(self.model.parameters()) or [torch.zeros(1, requires_grad=True)]
            self.optimizer = scheduled = _adamw(trained, config)
            self.clipped = trained
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            scheduled, _warmup(config.warmup_steps)
        )
        # the step of the first non-finite loss (1-based), or -1: written on the device
        self._diverged_at = torch.full((), -1, dtype=torch.int64, device=ctx.device)
        self.amp = amp_dtype(config, ctx.device)
        self.stopper = EarlyStopping(config.patience, config.min_delta)
        self.history: Dict[str, List[Dict[str, Any]]] = {"train": [], "valid": []}
        self.best_state: Optional[Dict[str, torch.Tensor]] = None
        self.step = 0
        self.start_step = 0  # where this process began: a resumed run starts mid-history
        self._saved_step: Optional[int] = None
        num_rows = len(self.task.train_rows)
        # a fitted baseline reads every training event at once: it has no batch to check
        if not self.fitted and not ctx.world_size <= config.batch_size <= num_rows:
            raise ConfigError(
                "batch_size",
                f"must be between the number of processes ({ctx.world_size}) and the "
                f"training users ({num_rows}); got {config.batch_size}",
            )
        # the last partial batch of an epoch is dropped: every global batch is full, and
        # each epoch's shuffle changes which users that leaves out
        self.steps_per_epoch = num_rows // config.batch_size
        self.total_steps = config.total_steps(self.steps_per_epoch)
        self.eval_every = config.eval_every or self.steps_per_epoch
        self._epoch, self._order = -1, np.empty(0, dtype=np.int64)
        if config.resume and not self.fitted:
            self._resume()

    # -- printing ----------------------------------------------------------------------

    def log(self, message: str) -> None:
        if self.ctx.is_main:
            tqdm.write(message)

    def _header(self) -> str:
        c = self.config
        amp = "bf16" if self.amp is not None else "off"
        if self.fitted:
            return (
                f"tzrec-bench train: {c.model} on {c.data} ({self.task.describe()})\n"
                f"  {self.ctx.placement}, fitted from the training events (no gradient steps)"
            )
        return (
            f"tzrec-bench train: {c.model} on {c.data} ({self.task.describe()})\n"
            f"  {self.ctx.placement}, {backend_name(c)}, amp {amp}"
            f"{', training step under torch.compile' if c.compile else ''}\n"
            f"  {'at most ' if c.patience else ''}{self.total_steps} steps "
            f"({self.steps_per_epoch} per epoch of {c.batch_size} "
            f"users), validation every {self.eval_every}, early stopping on {c.key_metric}"
            + "".join("\n" + line for line in (plan_lines(self.tables) if self.tables else ()))
        )

    # -- one step ----------------------------------------------------------------------

    def _global_rows(self, step: int) -> np.ndarray:
        """The rows of the global batch of ``step``: epoch ``e`` is shuffled by ``(seed, e)``."""
        epoch, index = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            rng = np.random.default_rng([self.config.seed, epoch])
            self._epoch, self._order = epoch, rng.permutation(self.task.train_rows)
        size = self.config.batch_size
        return self._order[index * size : (index + 1) * size]

    def _train_step(self, rows: np.ndarray) -> torch.Tensor:
        """One optimizer step on the global batch ``rows``; returns this rank's loss, weighted
        so that its mean over ranks is the mean over the global batch."""
        local = shard(rows, self.ctx)
        # weighting each rank's mean by its share of the global batch's loss terms makes the
        # sum of the ranks' gradients that of the mean over the whole global batch; DDP
        # averages (divides by the world size) unless the tables are sharded, where every
        # gradient is summed (train/sharding.py)
        averaged = 1 if self.sharded else self.ctx.world_size
        scale = (
            self.task.loss_terms(local) * averaged / max(self.task.loss_terms(rows), 1)
        )
        batch = self.task.batch(local, self.step)
        self.model.train()
        with autocast(self.ctx.device, self.amp):
            loss = self.step_module(batch) * scale
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.config.clip_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.clipped, self.config.clip_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        # reported as a term of the mean over ranks, which is then the global-batch mean
        loss = loss.detach() * (self.ctx.world_size / averaged)
        self._diverged_at = torch.where(
            (self._diverged_at < 0) & ~torch.isfinite(loss), self.step + 1, self._diverged_at
        )
        return loss

    def _check_finite(self) -> None:
        """Raises :class:`NonFiniteError` if a loss so far was NaN or infinite (on any rank).

        Reads one device value: called where the loop waits for the device anyway."""
        flag = self._diverged_at.clone()
        if self.ctx.distributed:
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        step = int(flag.item())
        if step >= 0:
            raise NonFiniteError(
                f"the training loss is NaN or infinite at step {step}: the run diverged "
                f"(--lr {self.config.lr}); no metric is reported. Lower --lr, or keep "
                "--clip-grad-norm on"
            )

    # -- evaluation --------------------------------------------------------------------

    def _evaluate(self, split: str, max_users: Optional[int]) -> Dict[str, float]:
        self.model.eval()
        try:
            return self.task.evaluate(self.model, split, max_users)
        finally:
            self.model.train()

    def _validate(self) -> None:
        self._check_finite()
        metrics = self._evaluate("valid", self.config.eval_users)
        key = self.config.key_metric
        improved = self.stopper.update(metrics[key], self.step)
        self.history["valid"].append({"step": self.step, **metrics})
        if improved and self.tables is not None:  # each rank its shards; best.pt at the end
            self.tables.save(self.out_dir / BEST_SHARDS, with_optimizer=False)
        elif improved:
            self.best_state = {
                k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()
            }
            if self.ctx.is_main:
                checkpoint.save(
                    self.out_dir / checkpoint.BEST,
                    {**self._description(), "step": self.step, "metrics": metrics,
                     "model": self.best_state},
                )
        if improved:
            note = "new best"
        elif self.stopper.best is None:
            note = "no valid value yet"
        else:
            note = f"best {self.stopper.best:.4f} at step {self.stopper.best_step}"
        self.log(f"step {self.step}: valid {key} {metrics[key]:.4f} ({note})")

    # -- checkpoints -------------------------------------------------------------------

    def _description(self) -> Dict[str, Any]:
        """What every file of the run holds besides states: the run's settings, the model's
        class and constructor arguments (rebuilt from them by tzrec-acc), and the data's id
        vocabularies and fingerprint (raw ids in and out, the data checked on reuse)."""
        return {
            "config": self.config.to_dict(),
            "model_config": model_config(self.config, self.task.num_items,
                                         self.task.task_bits),
            VOCABULARY_KEY: self._vocabulary_state,
        }

    def _save_checkpoint(self) -> None:
        rng = gather_objects(checkpoint.capture_rng(), self.ctx)  # a collective: every rank
        if self.tables is not None:
            self.tables.save(self.out_dir / CHECKPOINT_SHARDS, with_optimizer=True)
            states: Dict[str, Any] = {checkpoint.SHARDED: {"folder": CHECKPOINT_SHARDS}}
        else:
            states = {"model": self.model.state_dict(),
                      "optimizer": self.optimizer.state_dict()}
        if self.ctx.is_main:
            checkpoint.save(
                self.out_dir / checkpoint.CHECKPOINT,
                {
                    **self._description(),
                    "step": self.step,
                    "world_size": self.ctx.world_size,
                    **states,
                    "scheduler": self.scheduler.state_dict(),
                    "early_stopping": self.stopper.state_dict(),
                    "history": self.history,
                    "rng": rng,
                },
            )
        barrier(self.ctx)  # no rank goes on (or exits) before the file is complete
        self._saved_step = self.step

    def _resume(self) -> None:
        path = self.out_dir / checkpoint.CHECKPOINT
        if not path.exists():
            self.log(f"--resume: no checkpoint at {path}; starting from step 0")
            return
        state = checkpoint.load(path)
        conflicts = self.config.resume_conflicts(TrainConfig.from_dict(state["config"]))
        if conflicts:
            raise ConfigError("resume", f"cannot resume from {path}: " + "; ".join(conflicts))
        checkpoint.check_same_data(state, path, self.vocabularies, "--resume")
        if self.tables is not None:
            if state["world_size"] != self.ctx.world_size:
                raise ConfigError(
                    "resume",
                    f"{path} holds tables sharded over {state['world_size']} process(es); a "
                    f"sharded run resumes on as many (this run has {self.ctx.world_size}). "
                    f"Its model, gathered whole, is in {checkpoint.BEST} at the end of a run "
                    "(tzrec_bench.train.sharding.consolidate reads the shards in one process)",
                )
            self.tables.load(self.out_dir / state[checkpoint.SHARDED]["folder"], True)
        else:
            self.model.load_state_dict(state["model"])
            _load_optimizer_state(self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        # the warm-up's current lr (a sharded run's optimizer states do not hold it)
        for group, lr in zip(self.scheduler.optimizer.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr
        self.stopper.load_state_dict(state["early_stopping"])
        self.history = state["history"]
        self.step = self.start_step = state["step"]
        if len(state["rng"]) == self.ctx.world_size:
            checkpoint.restore_rng(state["rng"][self.ctx.rank])
        else:  # another world size: the data is the same, dropout masks cannot be
            self.log(f"--resume: the checkpoint has {len(state['rng'])} process(es), this "
                     f"run has {self.ctx.world_size}: dropout masks will differ")
            torch.manual_seed(self.config.seed + self.ctx.rank + self.step)
        best = self.out_dir / checkpoint.BEST
        if best.exists() and self.tables is None:
            self.best_state = checkpoint.load(best)["model"]
        self.log(f"resumed from {path} at step {self.step}")

    # -- the run -----------------------------------------------------------------------

    def run(self) -> RunResult:
        """Trains to the last step (or early stop), then evaluates and reports."""
        self.log(self._header())
        if self.fitted:
            started = time.perf_counter()
            self.model.fit(self.task.split.train)
            train_seconds, tokens = time.perf_counter() - started, 0
            self.log(f"fitted in {train_seconds:.2f} s")
        else:
            train_seconds, tokens = self._train_loop()
        # ru_maxrss is in KiB on Linux: the peak so far, before evaluation and gathering
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self._peak_memory = [int(p) for p in gather_objects(peak, self.ctx)]
        if self.stopper.should_stop:
            self.log(f"early stopping at step {self.step}: no better {self.config.key_metric} "
                     f"in {self.stopper.bad_evaluations} evaluations")
        if not self.history["valid"] or self.history["valid"][-1]["step"] != self.step:
            self._validate()
        if self._saved_step != self.step:
            self._save_checkpoint()
        if self.best_state is not None:
            self.model.load_state_dict(self.best_state)
        elif self.tables is not None and (self.out_dir / BEST_SHARDS).exists():
            self.tables.load(self.out_dir / BEST_SHARDS, with_optimizer=False)
        test = self._evaluate("test", None)
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
            peak_memory=self._peak_memory,
        )
        if self.tables is not None:
            self._write_best_gathered(result)
        if self.ctx.is_main:
            self._report(result)
        return result

    def _write_best_gathered(self, result: RunResult) -> None:
        """``best.pt`` of a sharded run: rank 0 gathers the best shards into a plain model."""
        if self.ctx.is_main and (self.out_dir / BEST_SHARDS).exists():
            checkpoint.save(
                self.out_dir / checkpoint.BEST,
                {**self._description(),
                 "step": result.best_step, "metrics": result.valid,
                 "model": consolidate(self.out_dir / BEST_SHARDS)},
            )
        barrier(self.ctx)

    def _train_loop(self) -> Tuple[float, int]:
        """Steps with progress, validation and checkpoints; returns (seconds, tokens) trained."""
        config = self.config

        def open_ended() -> Optional[str]:  # the bar's layout while early stopping decides
            return open_ended_progress(self.step, self.total_steps, self.eval_every,
                                       config.patience, self.stopper.bad_evaluations)

        layout = open_ended()
        bar = tqdm(
            total=None if layout else self.total_steps, initial=self.step, unit="step",
            desc=config.model, bar_format=layout,
            # a log file (not a terminal) gets a redraw every 10 s, not a line of them per second
            dynamic_ncols=True, mininterval=0.5 if sys.stderr.isatty() else 10.0,
            disable=not (self.ctx.is_main and config.progress),
        )
        train_seconds, tokens = 0.0, 0
        window_seconds, window_tokens, window_samples = 0.0, 0, 0
        # Ctrl-C: every rank stops at the same step boundary, the first one by which every
        # rank knows that some rank saw it (one step after, under torchrun)
        any_interrupted = AnyRankFlag(self.ctx)
        with _deferred_interrupts(True) as interrupted:
            while self.step < self.total_steps and not self.stopper.should_stop:
                if any_interrupted.poll(interrupted[0]):
                    bar.close()
                    self._stop_interrupted()
                rows = self._global_rows(self.step)
                started = time.perf_counter()
                loss = self._train_step(rows)
                self.step += 1
                logged = self.step % config.log_every == 0 or self.step == self.total_steps
                if logged:  # read at log steps only: on a GPU, .item() waits for the step
                    self._check_finite()
                    value = mean_over_ranks(loss, self.ctx).item()  # the global-batch mean
                elapsed = time.perf_counter() - started
                train_seconds += elapsed
                window_seconds += elapsed
                batch_tokens = self.task.tokens(rows, self.step - 1)
                tokens += batch_tokens
                window_tokens += batch_tokens
                window_samples += len(rows)
                bar.update(1)
                if logged:
                    rate = window_tokens / window_seconds
                    self.history["train"].append({
                        "step": self.step, "loss": value, "tokens_per_s": rate,
                        "seconds": window_seconds, "tokens": window_tokens,
                        "samples": window_samples,
                    })
                    bar.set_postfix(loss=f"{value:.4f}", tok_s=f"{rate:.0f}")
                    window_seconds, window_tokens, window_samples = 0.0, 0, 0
                validated = self.step % self.eval_every == 0
                if validated:
                    self._validate()
                    if not bar.disable and bar.bar_format:  # no longer open-ended?
                        layout = open_ended()
                        bar.total = None if layout else self.total_steps
                        bar.bar_format = layout
                        bar.refresh()
                if (
                    self.step % config.checkpoint_every == 0 if config.checkpoint_every
                    else validated
                ):
                    self._save_checkpoint()
        any_interrupted.close()
        bar.close()
        return train_seconds, tokens

    def _stop_interrupted(self) -> None:
        """Saves a checkpoint at this step boundary (unless the run diverged) and raises
        :class:`Interrupted`."""
        saved: Optional[Path] = None
        try:
            self._check_finite()
            if self._saved_step != self.step:
                self._save_checkpoint()
            saved = self.out_dir / checkpoint.CHECKPOINT
        except NonFiniteError as exc:
            self.log(f"no checkpoint saved: {exc}")
        raise Interrupted(self.step, saved)

    def _report(self, result: RunResult) -> None:
        """Prints the metrics table and throughput; writes the metrics, history and plot."""
        config = self.config
        self.out_dir.mkdir(parents=True, exist_ok=True)
        # retrieval ranks targets against the catalogue: say whether history items took part
        seen = config.exclude_seen if config.task == "retrieval" else None
        summary = {
            "steps": result.steps, "best_step": result.best_step,
            "stopped_early": result.stopped_early, "valid": result.valid, "test": result.test,
            **({} if seen is None else {"exclude_seen": seen}),
        }
        (self.out_dir / METRICS_FILE).write_text(json.dumps(summary, indent=2) + "\n")
        (self.out_dir / HISTORY_FILE).write_text(json.dumps(self.history) + "\n")
        print(metrics_table({f"valid (step {result.best_step})": result.valid,
                             "test": result.test}, exclude_seen=seen))
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
            shown = [config.key_metric, "hr@10"] if config.task == "retrieval" else list(
                result.test)
            try:
                path = plot_curves(self.history, list(dict.fromkeys(shown)),
                                   self.out_dir / PLOT_FILE, f"{config.model} on {config.data}",
                                   result.best_step)
                print(f"curves: {path}")
            except ImportError as exc:
                print(f"plot skipped: {exc}")
        print(f"checkpoints and metrics: {self.out_dir}")


def check_compile(config: TrainConfig, device: torch.device) -> None:
    """Refuses ``--compile`` with dropout in the HSTU models' GPU kernels: they draw a fresh
    dropout seed per call (a host value), dynamo breaks the graph there, and torch 2.11's
    Inductor then fails to compile the kernels that take it (H200: an AttributeError in its
    kernel-signature code)."""
    if config.compile and config.dropout > 0 and config.model.startswith("hstu") and (
        device.type == "cuda"
    ):
        raise ConfigError(
            "compile",
            f"not supported with dropout in the GPU kernels (--dropout {config.dropout}): "
            "their per-call dropout seed breaks the compiled graph; expected --dropout 0 with "
            "--compile, or no --compile",
        )


def train(config: TrainConfig) -> RunResult:
    """Trains ``config.model`` on ``config.data``; under torchrun, data-parallel."""
    config.check()
    device = pick_device(config.device)
    check_sharding(config, device)
    check_compile(config, device)
    ctx = init_distributed(config.device, group=config.sharding == "torchrec")
    try:
        return Trainer(config, ctx).run()
    finally:
        close(ctx)


def evaluate(
    path: Union[str, Path], split: str = "test", overrides: Optional[Mapping[str, Any]] = None
) -> Dict[str, float]:
    """Metrics of a saved model on ``split``, printed as a table by rank 0.

    Args:
        path: a checkpoint file or a run's folder (see :func:`resolve_checkpoint`).
        split: ``"test"`` or ``"valid"``.
        overrides: settings to change from the saved ones (``data_dir``, ``device``, ...).
    """
    file = resolve_checkpoint(path)
    state = checkpoint.load(file)
    config = TrainConfig.from_dict({**state["config"], **(overrides or {})})
    config.check()
    ctx = init_distributed(config.device)
    try:
        checkpoint.seed_everything(config.seed)
        dataset = load_data(config, ctx)
        checkpoint.check_same_data(state, file, dataset.id_vocabularies(config.data),
                                   "evaluate")
        task = make_task(config, dataset, ctx)
        model = build_model(config, task.num_items, task.task_bits, ctx.device)
        model.load_state_dict(state["model"])
        model.eval()
        metrics = task.evaluate(model, split, None)
        if ctx.is_main:
            print(f"{config.model} on {config.data}, {file} (step {state['step']})")
            print(metrics_table({split: metrics}, exclude_seen=(
                config.exclude_seen if config.task == "retrieval" else None)))
        return metrics
    finally:
        close(ctx)
