"""Where a trained model's weights live across processes, chosen once per run by
``--sharding``: :class:`Replicated` (every process holds the whole model, DDP averages the
gradients) or :class:`Sharded` (torchrec splits the item table, :mod:`.sharding`).

A strategy owns what differs between the two: the item tables the model is built with,
the module a training step calls, the optimizers, the model and optimizer states of
``checkpoint.pt`` and the weights kept at the best validation step. The loop
(:class:`tzrec_bench.train.loop.Trainer`) calls it and never asks which one it has.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tzrec_bench.train import checkpoint
from tzrec_bench.train.checkpoint import RunFiles
from tzrec_bench.train.config import ConfigError, TrainConfig
from tzrec_bench.train.distributed import DistContext, barrier, broadcast_states
from tzrec_bench.train.sharding import ShardedTables, consolidate, meta_table
from tzrec_bench.train.task import Batch, Task

#: a sharded run's folders of shards (torch.distributed.checkpoint), in the run's folder
CHECKPOINT_SHARDS = "checkpoint.dcp"
BEST_SHARDS = "best.dcp"


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


def adamw(params: List[torch.Tensor], config: TrainConfig) -> torch.optim.AdamW:
    """The run's AdamW: the fused kernel when every parameter is on a CUDA device (one
    launch per step instead of one per parameter group of tensors), else torch's default
    (foreach on the CPU); the two agree within float rounding."""
    fused = True if params and all(p.is_cuda for p in params) else None
    return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay,
                             fused=fused)


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
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


class WholeModel:
    """The best weights of a model that every process holds whole: a CPU copy in memory
    (loaded back for the test split) and ``best.pt``, written at each new best.

    Used as is by a fitted baseline's run, and by :class:`Replicated`.
    """

    embedding_tables: Any = "plain"

    def __init__(self, model: nn.Module, files: RunFiles) -> None:
        self.model = model
        self.files = files
        self.best: Optional[Dict[str, torch.Tensor]] = None

    def keep_best(self, step: int, metrics: Dict[str, float]) -> None:
        """Keeps the current weights as the best (every rank; rank 0 writes best.pt)."""
        self.best = {
            k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()
        }
        self.files.write(checkpoint.BEST, step, metrics=metrics, model=self.best)

    def resume_best(self) -> None:
        """Takes the best weights of the run being resumed from its best.pt, which must be
        that run's (the run id of its checkpoint.pt)."""
        path = self.files.folder / checkpoint.BEST
        if path.exists():
            payload = checkpoint.load(path)
            checkpoint.check_same_run(payload, path,
                                      self.files.description.get(checkpoint.RUN_ID),
                                      self.files.folder / checkpoint.CHECKPOINT)
            self.best = payload["model"]

    def load_best(self) -> None:
        """Puts the best weights (if any run validated) into the model."""
        if self.best is not None:
            self.model.load_state_dict(self.best)

    def publish_best(self, step: Optional[int], metrics: Dict[str, float]) -> None:
        """Nothing to do: best.pt was written when the weights were kept."""


class Replicated(WholeModel):
    """``--sharding replicate``: every process holds the whole model; under torchrun DDP
    averages the gradients; one AdamW (warm-up and clipping over every parameter).

    With ``--compile`` the training step (model and loss, so also their backward) is
    compiled in place before DDP wraps it, as torch advises; the state dict keys stay those
    of an eager run. A ``captured`` step (the trainer's :func:`graphed_step.wanted`) gets no
    DDP wrapper under torchrun: it reduces its gradients itself.
    """

    def __init__(self, model: nn.Module, task: Task, config: TrainConfig, ctx: DistContext,
                 files: RunFiles, captured: bool) -> None:
        super().__init__(model, files)
        step: nn.Module = TrainStep(model, task)
        if config.compile:
            # dynamic=None: the sizes that differ between batches (tokens, candidates)
            # become dynamic at the first recompile
            step.compile(dynamic=None)
        if ctx.distributed and captured:
            # the captured step reduces the gradients itself, inside its graphs
            # (graphed_step.GradSync): DDP's hooks would break the capture
            broadcast_states(model, ctx)
        elif ctx.distributed:
            ids = [ctx.device.index] if ctx.device.type == "cuda" else None
            step = DistributedDataParallel(step, device_ids=ids)
        #: what a training step calls
        self.module = step
        self.clipped: List[torch.Tensor] = list(model.parameters())
        self.optimizer: torch.optim.Optimizer = adamw(self.clipped, config)
        #: the optimizer the warm-up schedules
        self.scheduled: torch.optim.Optimizer = self.optimizer
        #: DDP divides the summed gradients by this
        self.averaged_over = ctx.world_size

    def header_lines(self) -> Tuple[str, ...]:
        return ()

    def states(self) -> Dict[str, Any]:
        """The model and optimizer states of checkpoint.pt."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_states(self, state: Mapping[str, Any], path: Any) -> None:
        """Loads what :meth:`states` saved (``state`` is the payload read from ``path``)."""
        self.model.load_state_dict(state["model"])
        load_optimizer_state(self.optimizer, state["optimizer"])


class Sharded:
    """``--sharding torchrec``: the item table split over the processes by torchrec's
    DistributedModelParallel (:class:`~tzrec_bench.train.sharding.ShardedTables`).

    The table's fused optimizer runs at the constant lr, so the warm-up and the clipping
    apply to the dense parameters; every gradient is summed over ranks, not averaged.
    Checkpoints are each rank's shards (``*.dcp`` folders); best.pt, the gathered plain
    model, is written at the end of the run.
    """

    embedding_tables: Any = staticmethod(meta_table)

    def __init__(self, model: nn.Module, task: Task, config: TrainConfig, ctx: DistContext,
                 files: RunFiles, captured: bool) -> None:
        # ``captured`` is always False here: a sharded step is never captured
        # (graphed_step.refusal)
        self.config = config
        self.ctx = ctx
        self.files = files
        self.tables = ShardedTables(TrainStep(model, task), config, ctx)
        self.module: nn.Module = self.tables.module
        self.optimizer: torch.optim.Optimizer = self.tables.optimizer
        self.scheduled: torch.optim.Optimizer = self.tables.dense_optimizer
        self.clipped: List[torch.Tensor] = list(self.tables.dense_parameters)
        self.averaged_over = 1

    def header_lines(self) -> Tuple[str, ...]:
        config = self.config
        return (
            f"  tables sharded by torchrec ({config.sharding_type}), table optimizer "
            f"{config.table_optimizer} (fused, lr {config.lr})",
            *(f"    {line}" for line in self.tables.describe()),
        )

    def states(self) -> Dict[str, Any]:
        """Writes every rank's shards (a collective); checkpoint.pt names their folder."""
        self.tables.save(self.files.folder / CHECKPOINT_SHARDS, with_optimizer=True)
        return {checkpoint.SHARDED: {"folder": CHECKPOINT_SHARDS}}

    def load_states(self, state: Mapping[str, Any], path: Any) -> None:
        """Loads the shards that ``state`` (read from ``path``) names, on as many processes."""
        if state["world_size"] != self.ctx.world_size:
            raise ConfigError(
                "resume",
                f"{path} holds tables sharded over {state['world_size']} process(es); a "
                f"sharded run resumes on as many (this run has {self.ctx.world_size}). "
                f"Its model, gathered whole, is in {checkpoint.BEST} at the end of a run "
                "(tzrec_bench.train.sharding.consolidate reads the shards in one process)",
            )
        self.tables.load(self.files.folder / state[checkpoint.SHARDED]["folder"], True)

    def keep_best(self, step: int, metrics: Dict[str, float]) -> None:
        """Each rank writes its shards; best.pt is gathered at the end (:meth:`publish_best`)."""
        self.tables.save(self.files.folder / BEST_SHARDS, with_optimizer=False)

    def resume_best(self) -> None:
        """Nothing to read: the best shards stay in their folder."""

    def load_best(self) -> None:
        if (self.files.folder / BEST_SHARDS).exists():
            self.tables.load(self.files.folder / BEST_SHARDS, with_optimizer=False)

    def publish_best(self, step: Optional[int], metrics: Dict[str, float]) -> None:
        """Rank 0 gathers the best shards into a plain model: best.pt."""
        if self.ctx.is_main and (self.files.folder / BEST_SHARDS).exists():
            self.files.write(checkpoint.BEST, step, metrics=metrics,
                             model=consolidate(self.files.folder / BEST_SHARDS))
        barrier(self.ctx)


#: a training run's strategy
Strategy = Union[Replicated, Sharded]
