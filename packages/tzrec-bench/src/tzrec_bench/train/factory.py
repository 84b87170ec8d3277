"""Construction by name: the model (its registry record maps the settings to constructor
arguments) and the task it trains on."""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from tzrec_bench.data import SequenceDataset
from tzrec_bench.train.config import TrainConfig
from tzrec_bench.train.distributed import DistContext
from tzrec_bench.train.task import Task
from tzrec_gr.embeddings import TableFactory
from tzrec_gr.models.registry import get_model

#: (model class, its constructor arguments except ``device``: plain values that JSON holds)
Spec = Tuple[type, Dict[str, Any]]


def _spec(config: TrainConfig, num_items: int, task_bits: Sequence[int]) -> Spec:
    """``config.model``'s class and constructor arguments, from its registry record."""
    record = get_model(config.model)
    if record.trainer_kwargs is None:
        raise ValueError(f"model {config.model!r} has no trainer builder: tzrec-bench cannot "
                         "train it")
    return record.model_class, record.trainer_kwargs(config, num_items, task_bits)


def is_fitted(config: TrainConfig) -> bool:
    """Whether ``config.model`` is fitted from the training events (``model.fit(train)``)
    rather than trained by gradient steps."""
    return get_model(config.model).fitted


def model_config(
    config: TrainConfig, num_items: int, task_bits: Sequence[int] = ()
) -> Dict[str, Any]:
    """``{"model": class name, "kwargs": constructor arguments}`` of ``config.model``: what
    checkpoints store so that a model is rebuilt without this package (``tzrec-acc``).

    Args:
        config (TrainConfig): the run's settings.
        num_items (int): catalogue size.
        task_bits (Sequence[int]): the ranking model's label bit per task (ignored by the
            retrieval models).
    """
    cls, kwargs = _spec(config, num_items, task_bits)
    return {"model": cls.__name__, "kwargs": kwargs}


def build_model(
    config: TrainConfig,
    num_items: int,
    task_bits: Sequence[int] = (),
    device: Optional[torch.device] = None,
    embedding_tables: Union[str, TableFactory] = "plain",
) -> nn.Module:
    """The model ``config.model`` for a catalogue of ``num_items`` (arguments as in
    :func:`model_config`), with its parameters on ``device``; ``embedding_tables`` is the
    HSTU models' table implementation (a checkpoint's ``model_config`` holds plain tables)."""
    cls, kwargs = _spec(config, num_items, task_bits)
    if embedding_tables != "plain":
        kwargs = {**kwargs, "embedding_tables": embedding_tables}
    return cls(**kwargs, device=device)


def make_task(config: TrainConfig, dataset: SequenceDataset, ctx: DistContext) -> Task:
    """The task ``config.model`` trains on, over ``dataset``."""
    return config.facts.trainer_class()(dataset, config, ctx)
