"""Every check of a training run's options, in one place: :func:`validate`.

A run calls it twice: before anything is built (no data, model or file yet), and again
once the data is loaded, when the catalogue and the training users are known. Each check
raises :class:`~tzrec_bench.train.config.ConfigError` naming the option (the CLI exits 2).
Data that leaves nothing to evaluate or train on under the leave-one-out split is refused
by :func:`check_split` before training, with a
:class:`~tzrec_bench.data.DataFormatError` naming the cause (the CLI exits 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from tzrec_bench.data import DataFormatError
from tzrec_bench.data.split import MIN_EVALUATED_LENGTH
from tzrec_bench.plan import require_torchrec
from tzrec_bench.train.config import ConfigError, TrainConfig, model_choices
from tzrec_bench.train.distributed import pick_device
from tzrec_gr.models.registry import get_model

#: fbgemm-gpu's CPU kernels train with these table optimizers only
CPU_TABLE_OPTIMIZERS = ("rowwise-adagrad", "adagrad", "sgd")


@dataclass(frozen=True)
class DataSize:
    """What the loaded data tells the checks that need it.

    Attributes:
        num_items: the catalogue's size.
        train_users: the training users (rows an epoch draws its batches from).
        world_size: the processes a global batch is split over.
    """

    num_items: int
    train_users: int
    world_size: int


def validate(
    config: TrainConfig, device: Optional[torch.device] = None, data: Optional[DataSize] = None
) -> None:
    """Raises :class:`ConfigError` (the first option that cannot run as configured).

    Args:
        config: the run's settings (:meth:`TrainConfig.check` is the first check).
        device: the device the run trains on (its type decides the GPU-only rules); None
            picks it from ``config.device`` as the run will.
        data: the loaded data; None before loading skips the checks that need it (the
            sharded catalogue and the batch size).
    """
    config.check()
    if device is None:
        device = pick_device(config.device)
    if config.sharding == "torchrec":
        _check_sharding(config, device)
    if data is None:
        return
    if config.sharding == "torchrec" and config.facts.catalogue_softmax:
        _check_sharded_catalogue(config, data.num_items)
    # a fitted baseline reads every training event at once: it has no batch to check
    if not get_model(config.model).fitted and not (
        data.world_size <= config.batch_size <= data.train_users
    ):
        raise ConfigError(
            "batch_size",
            f"must be between the number of processes ({data.world_size}) and the "
            f"training users ({data.train_users}); got {config.batch_size}",
        )


def check_split(lengths: np.ndarray, config: TrainConfig) -> None:
    """Raises :class:`DataFormatError` when the users' event counts ``lengths`` leave the
    leave-one-out split nothing to validate and test (no user with 3 events), or a trained
    model nothing to train on (no user with a training sequence of 2 events)."""
    source = config.shown("data")
    if not (lengths >= MIN_EVALUATED_LENGTH).any():
        raise DataFormatError(
            f"{source}: nothing to validate or test: the leave-one-out split holds out each "
            f"user's last 2 events and needs users with at least {MIN_EVALUATED_LENGTH} "
            f"events, but there is none ({_event_counts(lengths)})"
        )
    # an evaluated user trains on its events before the 2 held out; the others on all
    trained = np.where(lengths >= MIN_EVALUATED_LENGTH, lengths - 2, lengths)
    if not get_model(config.model).fitted and not (trained >= 2).any():
        raise DataFormatError(
            f"{source}: nothing to train on: a training sequence needs 2 events besides the "
            f"2 held out of a user with {MIN_EVALUATED_LENGTH} or more (users with 2 or at "
            f"least 4 events), but there is none ({_event_counts(lengths)})"
        )


def _event_counts(lengths: np.ndarray) -> str:
    """``40 users: 25 with 1 event, 15 with 2 events``."""
    values, counts = np.unique(lengths, return_counts=True)
    parts = [f"{c} with {v} event{'' if v == 1 else 's'}" for v, c in zip(values, counts)]
    return f"{len(lengths)} users: " + ", ".join(parts) if parts else "no user"


def _check_sharding(config: TrainConfig, device: torch.device) -> None:
    """``--sharding torchrec``: a model whose record allows it (its item tables can be
    sharded), a table optimizer with a kernel on ``device``, and torchrec installed (the
    error names the extra)."""
    if not get_model(config.model).shardable:
        shardable = [name for name in model_choices() if get_model(name).shardable]
        raise ConfigError(
            "sharding",
            f"torchrec shards tzrec-gr's item tables: --model must be one of "
            f"{', '.join(shardable)}, got {config.model!r}",
        )
    if device.type == "cpu" and config.table_optimizer not in CPU_TABLE_OPTIMIZERS:
        raise ConfigError(
            "table_optimizer",
            f"{config.table_optimizer!r} has no CPU kernel in fbgemm-gpu; on the CPU use one "
            f"of {', '.join(CPU_TABLE_OPTIMIZERS)}",
        )
    try:
        require_torchrec("--sharding torchrec")
    except ImportError as exc:
        raise ConfigError("sharding", str(exc)) from exc


def _check_sharded_catalogue(config: TrainConfig, num_items: int) -> None:
    """The full softmax reads the whole table every step, which a sharded table is for
    avoiding: a sharded run of a softmax over the catalogue must sample its negatives."""
    if config.num_negatives >= num_items:
        raise ConfigError(
            "num_negatives",
            f"{config.num_negatives} >= the {num_items} items trains on the full softmax, "
            "which gathers the whole table every step; with --sharding torchrec sample "
            f"fewer (e.g. --num-negatives {max(1, min(128, num_items // 2))})",
        )
