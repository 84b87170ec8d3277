"""The training loop shared by every trained model, and evaluation of a saved run.

One optimizer step: every rank takes its slice of the global batch, computes its task's
mean loss scaled by its share of the global batch's loss terms, and DDP (or, in a
captured step, :class:`~tzrec_bench.train.grad_sync.GradSync`) averages the gradients,
which makes them the gradients of the global-batch mean (the same as a
one-process run); then gradient clipping, AdamW and the warm-up schedule. Validation runs
every ``eval_every`` steps (default: once per epoch) and at the end; early stopping and
``best.pt`` follow ``config.key_metric``; the test split is evaluated once, with the best
weights (:mod:`~tzrec_bench.train.run`, shared with the fitted baselines of
:mod:`~tzrec_bench.train.fitted`). Rank 0 alone prints, plots and writes files.

A run that diverges reports nothing: a NaN or infinite training loss stops it with
:class:`~tzrec_bench.train.metrics.NonFiniteError` naming the step (checked on the device
each step, read at the log and validation steps that wait for the GPU anyway), and the
metrics refuse non-finite scores. Ctrl-C ends the run at a step boundary (under torchrun,
the same one on every rank) with a checkpoint that ``--resume`` continues exactly.
Where the weights live (``--sharding``) is a strategy of :mod:`~tzrec_bench.train.strategies`,
chosen once. With ``--compile`` the training step runs under ``torch.compile``; evaluation
stays eager, and checkpoints hold the same keys as an eager run's. On a CUDA device the
step is captured in CUDA graphs where it can be (``--cuda-graphs``,
:mod:`~tzrec_bench.train.graphed_step`). With ``--ema-decay`` an average of the weights,
updated after every step (:mod:`~tzrec_bench.train.averaging`), is what validation, early
stopping, ``best.pt`` and the test see; training itself is unchanged.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple, Type, Union

import numpy as np
import torch

from tzrec_bench.data.log_files import describe_files
from tzrec_bench.train import checkpoint, graphed_step, validation
from tzrec_bench.train.averaging import WeightAverage
from tzrec_bench.train.config import ConfigError, TrainConfig
from tzrec_bench.train.distributed import (
    AnyRankFlag,
    DistContext,
    close,
    init_distributed,
    mean_over_ranks,
    shard,
)
from tzrec_bench.train.factory import AttributeSizes, build_model, is_fitted, make_task
from tzrec_bench.train.fitted import FittedRun
from tzrec_bench.train.graphed_step import CapturedStep
from tzrec_bench.train.interrupts import Interrupted, deferred_interrupts
from tzrec_bench.train.metrics import NonFiniteError
from tzrec_bench.train.report import metrics_table, open_ended_progress, progress_bar
from tzrec_bench.train.run import Run, RunResult, backend_name, load_data
from tzrec_bench.train.strategies import Replicated, Sharded, Strategy
from tzrec_bench.train.task import amp_dtype, autocast
from tzrec_gr.checkpoint import resolve_checkpoint


def _warmup(steps: int):
    return lambda step: min(1.0, (step + 1) / steps) if steps else 1.0


class Trainer(Run):
    """A run trained by gradient steps through ``strategy`` (see the module docstring)."""

    def __init__(self, config: TrainConfig, ctx: DistContext,
                 strategy: Type[Strategy]) -> None:
        super().__init__(config, ctx, strategy.embedding_tables)
        captured = graphed_step.wanted(config, ctx)
        self.strategy: Strategy = strategy(self.model, self.task, config, ctx, self.files,
                                           captured)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.strategy.scheduled, _warmup(config.warmup_steps)
        )
        # the step of the first non-finite loss (1-based), or -1: written on the device
        self._diverged_at = torch.full((), -1, dtype=torch.int64, device=ctx.device)
        self.amp = amp_dtype(config, ctx.device)
        # the last partial batch of an epoch is dropped: every global batch is full, and
        # each epoch's shuffle changes which users that leaves out
        self.steps_per_epoch = len(self.task.train_rows) // config.batch_size
        self.total_steps = config.total_steps(self.steps_per_epoch)
        self.eval_every = config.eval_every or self.steps_per_epoch
        self._epoch, self._order = -1, np.empty(0, dtype=np.int64)
        #: the step in CUDA graphs (--cuda-graphs), or None: eager
        self.captured = CapturedStep(self) if captured else None
        #: the average of the weights (--ema-decay), or None
        self.average = (WeightAverage(self.model, config.ema_decay) if config.ema_decay
                        else None)
        if config.resume:
            self._resume()

    def header(self) -> str:
        c = self.config
        amp = "bf16" if self.amp is not None else "off"
        return (
            f"tzrec-bench train: {c.model} on {c.shown('data')} ({self.task.describe()})\n"
            f"  {self.ctx.placement}, {backend_name(c)}, amp {amp}"
            f"{', training step under torch.compile' if c.compile else ''}\n"
            f"  {'at most ' if c.patience else ''}{self.total_steps} steps "
            f"({self.steps_per_epoch} per epoch of {c.batch_size} "
            f"users), validation every {self.eval_every}, early stopping on {c.key_metric}"
            + "".join("\n" + line for line in self.strategy.header_lines())
            + (f"\n{self.captured.describe()}" if self.captured is not None else "")
            + (f"\n{self.average.describe()}" if self.average is not None else "")
        )

    # -- one step ----------------------------------------------------------------------

    def global_rows(self, step: int) -> np.ndarray:
        """The rows of the global batch of ``step``: epoch ``e`` is shuffled by ``(seed, e)``."""
        epoch, index = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            rng = np.random.default_rng([self.config.seed, epoch])
            self._epoch, self._order = epoch, rng.permutation(self.task.train_rows)
        size = self.config.batch_size
        return self._order[index * size : (index + 1) * size]

    def train_step(self, rows: np.ndarray) -> torch.Tensor:
        """One optimizer step on the global batch ``rows``; returns this rank's loss, weighted
        so that its mean over ranks is the mean over the global batch."""
        local = shard(rows, self.ctx)
        # weighting each rank's mean by its share of the global batch's loss terms makes the
        # sum of the ranks' gradients that of the mean over the whole global batch; the
        # strategy says what the summed gradients are divided by (DDP: the world size)
        averaged = self.strategy.averaged_over
        scale = (
            self.task.loss_terms(local) * averaged / max(self.task.loss_terms(rows), 1)
        )
        self.model.train()
        if self.captured is not None:
            loss = self.captured(local, self.step, scale)
        else:
            batch = self.task.batch(local, self.step)
            with autocast(self.ctx.device, self.amp):
                loss = self.strategy.module(batch) * scale
            self.strategy.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if self.config.clip_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(self.strategy.clipped, self.config.clip_grad_norm)
            self.strategy.optimizer.step()
        if self.average is not None:  # after the step, eager or replayed (in place)
            self.average.update(self.step)
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

    # -- validation and checkpoints ----------------------------------------------------

    def validate(self) -> None:
        """Validates the averaged weights under --ema-decay (so early stopping and best.pt
        follow them), else the trained ones."""
        self._check_finite()
        if self.average is None:
            super().validate()
            return
        with self.average.applied():
            super().validate()

    def load_best(self) -> None:
        # with no best kept (no valid metric) the test evaluates the last average
        if self.average is not None:
            self.average.copy_to_model()
        super().load_best()

    def model_states(self) -> Dict[str, Any]:
        states = {**self.strategy.states(), "scheduler": self.scheduler.state_dict()}
        if self.average is not None:  # beside the trained weights, which --resume goes on from
            states[checkpoint.AVERAGE] = self.average.state_dict()
        return states

    def _resume(self) -> None:
        path = self.out_dir / checkpoint.CHECKPOINT
        if not path.exists():
            self.log(f"--resume: no checkpoint at {path}; starting from step 0")
            return
        state = checkpoint.load(path)
        conflicts = self.config.resume_conflicts(TrainConfig.from_dict(state["config"]))
        if conflicts:
            raise ConfigError("resume", f"cannot resume from {path}: " + "; ".join(conflicts))
        checkpoint.check_same_data(state, path, self.vocabularies, "--resume",
                                   self.config.columns)
        self.continue_run(state)
        self.strategy.load_states(state, path)
        if self.average is not None:
            try:
                self.average.load_state_dict(state[checkpoint.AVERAGE])
            except (KeyError, ValueError) as exc:
                raise checkpoint.CheckpointError(
                    f"{path}: no weight average of this model to resume --ema-decay from "
                    f"({exc})") from None
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
        self.strategy.resume_best()
        self.log(f"resumed from {path} at step {self.step}")

    # -- the loop ----------------------------------------------------------------------

    def advance(self) -> Tuple[float, int]:
        """Steps with progress, validation and checkpoints; returns (seconds, tokens) trained
        in this process."""
        config = self.config

        def open_ended() -> Optional[str]:  # the bar's layout while early stopping decides
            return open_ended_progress(self.step, self.total_steps, self.eval_every,
                                       config.patience, self.stopper.bad_evaluations)

        layout = open_ended()
        bar = progress_bar(
            self.ctx.is_main and config.progress,
            total=None if layout else self.total_steps, initial=self.step, unit="step",
            desc=config.model, bar_format=layout,
        )
        train_seconds, tokens = 0.0, 0
        window_seconds, window_tokens, window_samples = 0.0, 0, 0
        # Ctrl-C: every rank stops at the same step boundary, the first one by which every
        # rank knows that some rank saw it (one step after, under torchrun)
        any_interrupted = AnyRankFlag(self.ctx)
        with deferred_interrupts(True) as interrupted:
            while self.step < self.total_steps and not self.stopper.should_stop:
                if any_interrupted.poll(interrupted[0]):
                    bar.close()
                    self._stop_interrupted()
                rows = self.global_rows(self.step)
                started = time.perf_counter()
                loss = self.train_step(rows)
                self.step += 1
                logged = self.step % config.log_every == 0 or self.step == self.total_steps
                if logged:  # read at log steps only: on a GPU, .item() waits for the step
                    self._check_finite()
                    value = mean_over_ranks(loss, self.ctx).item()  # the global-batch mean
                elapsed = time.perf_counter() - started
                if config.compile and self.step == self.start_step + 1:
                    self.log(f"first step under torch.compile: {elapsed:.1f} s (compiling; "
                             "the first batch of other sizes compiles once more)")
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
                    self.validate()
                    if not bar.disable and bar.bar_format:  # no longer open-ended?
                        layout = open_ended()
                        bar.total = None if layout else self.total_steps
                        bar.bar_format = layout
                        bar.refresh()
                if (
                    self.step % config.checkpoint_every == 0 if config.checkpoint_every
                    else validated
                ):
                    self.save_checkpoint()
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
                self.save_checkpoint()
            saved = self.out_dir / checkpoint.CHECKPOINT
        except NonFiniteError as exc:
            self.log(f"no checkpoint saved: {exc}")
        raise Interrupted(self.step, saved)


def train(config: TrainConfig) -> RunResult:
    """Trains ``config.model`` on ``config.data``; under torchrun, data-parallel."""
    validation.validate(config)
    sharded = config.sharding == "torchrec"
    ctx = init_distributed(config.device, group=sharded)
    try:
        if is_fitted(config):
            return FittedRun(config, ctx).run()
        return Trainer(config, ctx, Sharded if sharded else Replicated).run()
    finally:
        close(ctx)


def evaluate(
    path: Union[str, Path],
    split: str = "test",
    overrides: Optional[Mapping[str, Any]] = None,
    max_users: Optional[int] = None,
) -> Dict[str, float]:
    """Metrics of a saved model on ``split``, printed as a table by rank 0.

    Args:
        path: a checkpoint file or a run's folder (see :func:`resolve_checkpoint`).
        split: ``"test"`` or ``"valid"``.
        overrides: settings to change from the saved ones (``data_dir``, ``device``, ...).
        max_users: evaluate a fixed seeded subset of this many users of the split (the
            users of ``train --test-users`` or ``--eval-users`` of the same number); None:
            every user.
    """
    file = resolve_checkpoint(path)
    state = checkpoint.load(file)
    config = TrainConfig.from_dict(state["config"]).replaced(**(overrides or {}))
    config.check()
    ctx = init_distributed(config.device)
    try:
        checkpoint.seed_everything(config.seed)
        dataset = load_data(config, ctx)
        checkpoint.check_same_data(state, file, dataset.id_vocabularies(config.shown("data")),
                                   "evaluate", config.columns)
        task = make_task(config, dataset, ctx)
        # the attribute links come with the state dict: the file is not read again
        model = build_model(config, task.num_items, task.task_bits, ctx.device,
                            attributes=AttributeSizes.saved(state.get("model_config", {})))
        model.load_state_dict(state["model"])
        model.eval()
        metrics = task.evaluate(model, split, max_users)
        if ctx.is_main:
            print(f"{config.model} on {config.shown('data')}, {file} (step {state['step']})")
            files = describe_files(dataset.files, dataset.skipped_files)
            if files:
                print(f"  read {files}")
            print(metrics_table({split: metrics}, exclude_seen=(
                config.exclude_seen if config.facts.excludes_seen else None),
                users_of={split: len(getattr(task.split, split))}))
        return metrics
    finally:
        close(ctx)
