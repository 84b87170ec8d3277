"""What the training loop needs from a task (retrieval or ranking), and helpers they share.

A task owns the data split, turns rows of users into device batches, computes the model's
loss on a batch, and evaluates a split. The loop owns everything else (optimizer, steps,
early stopping, checkpoints), so both tasks train the same way.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Dict, Iterator, Optional, Protocol, Tuple

import numpy as np
import torch
from torch import nn

from tzrec_bench.train.config import TrainConfig
from tzrec_bench.train.distributed import DistContext, shard
from tzrec_ops.jagged import to_device

Batch = Dict[str, Any]


class Task(Protocol):
    """The contract of :class:`~tzrec_bench.train.retrieval.RetrievalTask` and
    :class:`~tzrec_bench.train.ranking.RankingTask`."""

    #: catalogue size, for the model's item table
    num_items: int
    #: the ranking model's label bit per task; empty for retrieval
    task_bits: tuple
    #: rows of the training dataset that have something to learn from
    train_rows: np.ndarray

    def loss_terms(self, rows: np.ndarray) -> int:
        """How many terms the loss of ``rows`` averages (tokens with a next item, or
        candidates): computed on the host from lengths, with no device read."""

    def tokens(self, rows: np.ndarray, step: int) -> int:
        """Tokens the model reads for ``rows`` at step ``step`` (for throughput)."""

    def batch(self, rows: np.ndarray, step: int) -> Batch:
        """The device inputs of the loss for ``rows`` at optimizer step ``step``. The task
        of a model whose record has ``graph_step`` also takes ``padded=(tokens, users)``
        (see :mod:`~tzrec_bench.train.graphed_step`)."""

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """The mean loss over the batch's terms."""

    def evaluate(self, model: nn.Module, split: str, max_users: Optional[int]) -> Dict[str, float]:
        """Metrics of ``split`` (``"valid"`` or ``"test"``) over all ranks' users, or over
        :func:`eval_rows`' subset of ``max_users``; ``count`` is the users evaluated."""

    def describe(self) -> str:
        """One line about the data, for the run's header."""


def staged(t: torch.Tensor, device: torch.device, index: bool = False) -> torch.Tensor:
    """``t`` (on the CPU) on ``device``, without the host waiting for the device: on CUDA
    through pinned memory, since a copy from pageable memory first waits for every kernel
    already queued, and the next batch could not be built while the last step runs. An
    ``index`` tensor (lengths, offsets) keeps its host copy for the model's checks."""
    if device.type == "cuda" and not t.is_pinned():
        t = t.pin_memory()
    return to_device(t, device) if index else t.to(device, non_blocking=True)


def amp_dtype(config: TrainConfig, device: torch.device) -> Optional[torch.dtype]:
    """The autocast dtype: ``auto`` is bf16 on CUDA and full precision on the CPU."""
    if config.amp == "bf16" or (config.amp == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


def autocast(device: torch.device, dtype: Optional[torch.dtype]) -> ContextManager:
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def eval_rows(num_rows: int, max_users: Optional[int], seed: int) -> np.ndarray:
    """The evaluated rows: all of them, or a fixed seeded subset of ``max_users``, sorted."""
    if max_users is None or max_users >= num_rows:
        return np.arange(num_rows)
    chosen = np.random.default_rng(seed).permutation(num_rows)[:max_users]
    return np.sort(chosen)


def held_out_users(users: int, config: TrainConfig) -> str:
    """The header's count of held-out users, with the bounds that ``--eval-users`` and
    ``--test-users`` set, e.g. ``9000 evaluated users (validation on 500, test on 2000)``."""
    bounds = [f"{name} on {limit}" for name, limit in (
        ("validation", config.eval_users), ("test", config.test_users))
        if limit is not None and limit < users]
    return f"{users} evaluated users" + (f" ({', '.join(bounds)})" if bounds else "")


def chunks(rows: np.ndarray, size: int) -> Iterator[np.ndarray]:
    for start in range(0, len(rows), size):
        yield rows[start : start + size]


def eval_shard(rows: np.ndarray, ctx: DistContext, lockstep: bool) -> Tuple[np.ndarray, int]:
    """This rank's evaluated rows, and how many of them are its own.

    With ``lockstep`` (tables sharded by torchrec, whose lookups are collectives that every
    rank must enter together) every rank gets the same number of rows: the short ones repeat
    a row, whose results the caller drops (the rows past the count), so that all ranks make
    the same sequence of calls.
    """
    own = shard(rows, ctx)
    if not lockstep:
        return own, len(own)
    size = -(-len(rows) // ctx.world_size)
    filler = own[-1:] if len(own) else rows[:1]
    return np.concatenate([own, np.repeat(filler, size - len(own))]), len(own)
