"""``--sharding torchrec``: the item table sharded over the processes by torchrec.

With ``--sharding replicate`` (the default) every process holds the whole model and DDP
averages its gradients. With ``--sharding torchrec`` the model's item table is a
:class:`~tzrec_gr.embeddings.TorchrecEmbeddingTable` built on the ``meta`` device, and
torchrec's ``DistributedModelParallel`` (DMP) splits it over the processes as its planner
decides under ``--sharding-type`` (``row_wise``: each rank a slice of the rows;
``table_wise``: the table whole on one rank); lookups travel by all-to-all. The rest of the
model (the dense part) is data-parallel as before.

What changes with it:

* **Initial weights.** Each rank fills its shard with :func:`~tzrec_gr.embeddings.init_rows_`,
  so the table starts from the same values on any number of processes.
* **Optimizers.** The table is updated inside the backward pass by fbgemm's fused optimizer
  (``--table-optimizer``: row-wise Adagrad by default; Adam on CUDA only, fbgemm's CPU kernels
  lack it) at the constant ``--lr``: the warm-up, gradient clipping and weight decay apply to
  the dense parameters (AdamW) only.
* **Gradients.** torchrec sums the table's gradients over ranks, so the dense gradients are
  summed too (a DDP communication hook) and each rank's loss is weighted by its share of the
  global batch: every gradient is that of the global-batch mean, as in a one-process run.
* **Checkpoints.** Each rank writes its shards with ``torch.distributed.checkpoint`` (the
  ``*.dcp`` folders of a run); :func:`consolidate` turns one into a plain state dict, the
  form ``best.pt``, ``evaluate`` and tzrec-acc read.

The options it accepts are checked in :mod:`tzrec_bench.train.validation`; the trainer
drives it through :class:`tzrec_bench.train.strategies.Sharded`.

torchrec is imported only here, when a sharded run starts (``pip install
'tzrec-bench[torchrec]'``; on a machine without CUDA, :data:`tzrec_bench.plan.CPU_INSTALL`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torch import nn

from tzrec_bench.plan import require_torchrec
from tzrec_bench.train.config import TrainConfig
from tzrec_bench.train.distributed import DistContext, barrier
from tzrec_gr.embeddings import TorchrecEmbeddingTable, init_rows_, to_plain_state_dict

#: --table-optimizer (config.TABLE_OPTIMIZER_NAMES) -> fbgemm's EmbOptimType member
TABLE_OPTIMIZERS = {
    "rowwise-adagrad": "EXACT_ROWWISE_ADAGRAD",
    "adagrad": "EXACT_ADAGRAD",
    "sgd": "EXACT_SGD",
    "adam": "ADAM",
}


def meta_table(
    num_embeddings: int, embedding_dim: int, *, name: str, device: Any = None
) -> TorchrecEmbeddingTable:
    """A :data:`~tzrec_gr.embeddings.TableFactory`: a torchrec table on ``meta`` (no memory),
    which DMP materializes shard by shard on each rank."""
    return TorchrecEmbeddingTable(num_embeddings, embedding_dim, name, torch.device("meta"))


def _sum_gradients(state, bucket):  # noqa: ANN001, ANN202 (DDP checks real annotations)
    """A DDP communication hook: the sum of the ranks' gradients (DDP's own divides by the
    world size). ``bucket`` is a ``dist.GradBucket``; returns a future of its buffer."""
    work = dist.all_reduce(bucket.buffer(), async_op=True)
    return work.get_future().then(lambda future: future.value()[0])


class ShardedTables:
    """The DMP-wrapped training module, its optimizers and its sharded checkpoints.

    Args:
        step_module (nn.Module): the model and its loss (``strategies.TrainStep``), whose
            model was built with :func:`meta_table`.
        config (TrainConfig): the run's settings.
        ctx (DistContext): this process (the process group must exist, even for one).
    """

    def __init__(self, step_module: nn.Module, config: TrainConfig, ctx: DistContext) -> None:
        torchrec = require_torchrec("--sharding torchrec")
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from torchrec.distributed.embedding import EmbeddingCollectionSharder
        from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
        from torchrec.distributed.planner.storage_reservations import (
            FixedPercentageStorageReservation,
        )
        from torchrec.distributed.planner.types import ParameterConstraints
        from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper

        self.config = config
        self.ctx = ctx
        self.tables = {
            name: module for name, module in step_module.named_modules()
            if isinstance(module, TorchrecEmbeddingTable)
        }
        fused = {
            "optimizer": getattr(EmbOptimType, TABLE_OPTIMIZERS[config.table_optimizer]),
            "learning_rate": config.lr,
        }
        sharder = EmbeddingCollectionSharder(fused_params=fused)
        types = ["row_wise", "table_wise"] if config.sharding_type == "auto" else [
            config.sharding_type
        ]
        constraints = {t.name: ParameterConstraints(sharding_types=types)
                       for t in self.tables.values()}
        topology = Topology(
            world_size=ctx.world_size,
            compute_device=ctx.device.type,
            local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world_size)),
        )
        planner = EmbeddingShardingPlanner(
            topology=topology,
            constraints=constraints,
            storage_reservation=FixedPercentageStorageReservation(config.storage_reservation),
        )
        plan = planner.collective_plan(step_module, [sharder], dist.GroupMember.WORLD)
        self.module = torchrec.distributed.DistributedModelParallel(
            step_module, device=ctx.device, plan=plan, sharders=[sharder]
        )
        self.plan = plan
        for ddp in self.module.modules():
            if isinstance(ddp, nn.parallel.DistributedDataParallel):
                ddp.register_comm_hook(None, _sum_gradients)
        self._init_tables()
        table_params = set(self.module.fused_optimizer.params)
        self.dense = {
            name: p for name, p in self.module.named_parameters()
            if name not in table_params and p.requires_grad
        }
        # a model with no dense parameter still needs an optimizer that the scheduler holds
        dense = self.dense or {"_unused": torch.zeros(1, requires_grad=True)}
        self.dense_optimizer = KeyedOptimizerWrapper(
            dense,
            lambda params: torch.optim.AdamW(
                params, lr=config.lr, weight_decay=config.weight_decay
            ),
        )
        self.optimizer = CombinedOptimizer(
            [("tables", self.module.fused_optimizer), ("dense", self.dense_optimizer)]
        )

    @torch.no_grad()
    def _init_tables(self) -> None:
        """Each rank's shards get their rows of the whole table (init_rows_)."""
        state = self.module.state_dict()
        for path, table in self.tables.items():
            weight = state[f"{path}.collection.embeddings.{table.name}.weight"]
            for shard in weight.local_shards():
                row, column = shard.metadata.shard_offsets
                init_rows_(shard.tensor, row, seed=self.config.seed, first_column=column,
                           table_width=table.embedding_dim)

    def describe(self) -> List[str]:
        """One line per table: its sharding type and each rank's rows and columns."""
        lines = []
        for path, table in self.tables.items():
            module_plan = self.plan.plan.get(f"{path}.collection")
            sharding = module_plan[table.name] if module_plan else None
            if sharding is None:
                continue
            shards = ", ".join(
                f"rank {s.placement.rank()}: rows {s.shard_offsets[0]}-"
                f"{s.shard_offsets[0] + s.shard_sizes[0] - 1}"
                + (f" cols {s.shard_offsets[1]}-{s.shard_offsets[1] + s.shard_sizes[1] - 1}"
                   if s.shard_sizes[1] != table.embedding_dim else "")
                for s in sharding.sharding_spec.shards
            )
            lines.append(f"{table.name} table {table.num_embeddings} x {table.embedding_dim} "
                         f"{sharding.sharding_type}: {shards}")
        return lines

    @property
    def dense_parameters(self) -> List[nn.Parameter]:
        return list(self.dense.values())

    # -- checkpoints -----------------------------------------------------------------------

    def save(self, folder: Path, with_optimizer: bool) -> None:
        """Writes every rank's shards to ``folder`` (a collective): the model, and the
        optimizers' states when ``with_optimizer``. A folder is complete or absent: it is
        written under another name and renamed once every rank is done."""
        import torch.distributed.checkpoint as dcp

        partial = folder.with_name(folder.name + ".partial")
        if self.ctx.is_main:
            shutil.rmtree(partial, ignore_errors=True)
        barrier(self.ctx)
        dcp.save(self._state(with_optimizer), checkpoint_id=str(partial))
        barrier(self.ctx)
        if self.ctx.is_main:
            old = folder.with_name(folder.name + ".old")
            if folder.exists():
                os.replace(folder, old)
            os.replace(partial, folder)
            shutil.rmtree(old, ignore_errors=True)
        barrier(self.ctx)

    def load(self, folder: Path, with_optimizer: bool) -> None:
        """Reads what :meth:`save` wrote into this run's shards (the same world size)."""
        import torch.distributed.checkpoint as dcp

        if with_optimizer:
            # AdamW creates its state at its first step, and DCP loads in place: a step on
            # zero gradients makes the tensors to load into (the weights are loaded after)
            self.dense_optimizer.init_state()
            self.dense_optimizer.zero_grad(set_to_none=True)
        state = self._state(with_optimizer)
        dcp.load(state, checkpoint_id=str(folder))
        self.module.load_state_dict(state["model"])
        if with_optimizer:
            self.optimizer.load_state_dict(state["optimizer"])

    def _state(self, with_optimizer: bool) -> Dict[str, Any]:
        state: Dict[str, Any] = {"model": self.module.state_dict()}
        if with_optimizer:
            state["optimizer"] = self.optimizer.state_dict()
        return state


def consolidate(folder: Path, prefix: str = "model.") -> Dict[str, torch.Tensor]:
    """The plain state dict of the model saved in a sharded checkpoint folder: every table
    gathered whole, keys as a model with plain tables has them (``item_embeddings.weight``).

    Runs in one process with no process group; needs the memory of the whole model.

    Args:
        folder (Path): a ``*.dcp`` folder written by :meth:`ShardedTables.save`.
        prefix (str): the model's prefix in the saved module. Default: ``"model."`` (the
            trainer's ``strategies.TrainStep``).
    """
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    single = folder.with_name(folder.name + ".consolidated.pt")
    try:
        dcp_to_torch_save(folder, single)
        saved = torch.load(single, map_location="cpu", weights_only=True)["model"]
    finally:
        single.unlink(missing_ok=True)
    model = {k[len(prefix):]: v for k, v in saved.items() if k.startswith(prefix)}
    return to_plain_state_dict(model)

