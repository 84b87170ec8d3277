"""Data-parallel runs under torchrun: process group, device, sharding of global batches, and
a host flag the ranks agree on (:class:`AnyRankFlag`, Ctrl-C).

``torchrun --nproc-per-node N`` sets ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE``; without
them a run is one process. The process group uses NCCL on CUDA and gloo on the CPU.

Every rank walks the same sequence of global batches (the same seeded order) and takes a
disjoint slice of each (:func:`shard`), so a run on N processes sees exactly the global
batches of a one-process run with the same ``--batch-size``.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from tzrec_bench.train.config import ConfigError
from tzrec_ops.devices import DeviceError, resolve_device


@dataclass(frozen=True)
class DistContext:
    """Where this process stands in the run.

    Attributes:
        rank: this process, in ``[0, world_size)``.
        local_rank: this process on its host (picks the GPU).
        world_size: processes in the run.
        device: where this process trains.
        owns_group: this context created the process group (and destroys it in :func:`close`).
    """

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    owns_group: bool = False

    @property
    def is_main(self) -> bool:
        """Rank 0: the only one that prints, plots and writes files."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def placement(self) -> str:
        """Where the run trains, for reports: ``cuda:0-1, 2 processes`` or ``cpu, 1 process``."""
        if self.world_size == 1:
            return f"{self.device}, 1 process"
        if self.device.type == "cuda":  # one process per GPU, by local rank
            return f"cuda:0-{self.world_size - 1}, {self.world_size} processes"
        return f"{self.device}, {self.world_size} processes"


def pick_device(name: str, local_rank: int = 0) -> torch.device:
    """:func:`tzrec_ops.devices.resolve_device`, its error a :class:`ConfigError`."""
    try:
        return resolve_device(name, local_rank)
    except DeviceError as exc:
        raise ConfigError("device", str(exc)) from None


def init_distributed(device: str, group: bool = False) -> DistContext:
    """The context of this process; joins the process group when run under torchrun.

    ``group`` makes a process group of one for a run outside torchrun (torchrec's sharded
    modules need one whatever the number of processes)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    target = pick_device(device, local_rank)
    owns_group = False
    if (world_size > 1 or group) and not dist.is_initialized():
        backend = "nccl" if target.type == "cuda" else "gloo"
        options: Dict[str, Any] = {}
        if target.type == "cuda":
            # NCCL binds the group to this GPU: no guessing from the rank at the first barrier
            torch.cuda.set_device(target)
            options["device_id"] = target
        if world_size == 1:  # a group of one needs no rendezvous (nor torchrun's variables)
            options.update(store=dist.HashStore(), rank=0, world_size=1)
        dist.init_process_group(backend, **options)
        owns_group = True
    return DistContext(rank, local_rank, world_size, target, owns_group)


def close(ctx: DistContext) -> None:
    """Leave the process group: once every rank is done with it, and after freeing what
    still holds it (DDP's reducer sits in reference cycles), so that its worker threads stop
    here and not during interpreter shutdown, where gloo aborted a rank now and then
    ("terminate called without an active exception": 2 of 14 two-process CPU runs)."""
    if ctx.owns_group and dist.is_initialized():
        dist.barrier()
        gc.collect()
        dist.destroy_process_group()


def shard(rows: np.ndarray, ctx: DistContext) -> np.ndarray:
    """This rank's contiguous slice of ``rows`` (sizes differ by at most one)."""
    return np.array_split(rows, ctx.world_size)[ctx.rank]


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        dist.barrier()


def gather_objects(obj: Any, ctx: DistContext) -> List[Any]:
    """``obj`` of every rank, in rank order, on every rank."""
    if not ctx.distributed:
        return [obj]
    gathered: List[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, obj)
    return gathered


def mean_over_ranks(value: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """The mean of a scalar over ranks (itself in a one-process run)."""
    if not ctx.distributed:
        return value
    total = value.detach().clone()
    dist.all_reduce(total)
    return total / ctx.world_size


class AnyRankFlag:
    """A host flag (Ctrl-C seen) that every rank reads the same way at the same call.

    Every rank calls :meth:`poll` once per step boundary, with its own flag. In a
    one-process run it returns the flag. Under torchrun it returns whether any rank's flag
    was set at the *previous* call: each call waits for the previous call's all-reduce (MAX)
    and starts the next one without waiting for it, so the exchange overlaps a step and
    every rank gets the same answer at the same boundary, one step after the first rank saw
    its flag. A True answer starts no further exchange (every rank stops there).

    The flag stays in host memory and travels over a gloo group of its own: on NCCL it
    would be a device tensor, and reading it back each step would wait for the GPU. Making
    the group is a collective: every rank builds this object at the same point of the run.

    Args:
        ctx (DistContext): this process's place in the run.
    """

    def __init__(self, ctx: DistContext) -> None:
        self._group = dist.new_group(backend="gloo") if ctx.distributed else None
        self._pending: Optional[Tuple[Any, torch.Tensor]] = None

    def poll(self, flag: bool) -> bool:
        """Whether any rank had set its flag by the previous call (this rank's ``flag`` in a
        one-process run)."""
        if self._group is None:
            return flag
        seen = False
        if self._pending is not None:
            work, value = self._pending
            work.wait()
            seen = bool(value.item())
        self._pending = None
        if not seen:
            value = torch.tensor([int(flag)], dtype=torch.int32)
            work = dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self._group,
                                   async_op=True)
            self._pending = (work, value)
        return seen

    def close(self) -> None:
        """Waits for the exchange still under way (every rank started it)."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None


def broadcast_states(module: torch.nn.Module, ctx: DistContext) -> None:
    """Every rank's parameters and buffers made rank 0's (what DDP does when it wraps a
    module), for a run that reduces its gradients without DDP."""
    if ctx.distributed:
        for tensor in module.state_dict().values():
            dist.broadcast(tensor, src=0)
