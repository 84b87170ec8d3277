"""Construction by name: the model (the one place that maps settings to constructor
arguments) and the task it trains on."""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from tzrec_bench.baselines import (
    ItemKNN,
    ItemTransitions,
    MostPopular,
    PopularityRanking,
    SASRec,
)
from tzrec_bench.data import Action, SequenceDataset
from tzrec_bench.train.config import FITTED_MODELS, TrainConfig
from tzrec_bench.train.distributed import DistContext
from tzrec_bench.train.ranking import RankingTask
from tzrec_bench.train.retrieval import RetrievalTask
from tzrec_bench.train.task import Task
from tzrec_gr.embeddings import TableFactory
from tzrec_gr.models import HSTURanking, HSTURetrieval

#: (model class, its constructor arguments except ``device``: plain values that JSON holds)
Spec = Tuple[type, Dict[str, Any]]


def _hstu_retrieval(config: TrainConfig, num_items: int, task_bits: Sequence[int]) -> Spec:
    return HSTURetrieval, dict(
        num_items=num_items,
        embedding_dim=config.embedding_dim,
        max_seq_len=config.max_seq_len,  # attention scaling fixed to the trained bound
        num_heads=config.num_heads,
        num_layers=config.num_layers,
        num_negatives=config.num_negatives,
        temperature=config.temperature,
        dropout_ratio=config.dropout,
        backend=config.backend,
    )


def _sasrec(config: TrainConfig, num_items: int, task_bits: Sequence[int]) -> Spec:
    return SASRec, dict(
        num_items=num_items,
        embedding_dim=config.embedding_dim,
        max_seq_len=config.max_seq_len,
        num_heads=config.num_heads,
        num_layers=config.num_layers,
        dropout_ratio=config.dropout,
        num_negatives=config.num_negatives,
        temperature=config.temperature,
    )


def _hstu_ranking(config: TrainConfig, num_items: int, task_bits: Sequence[int]) -> Spec:
    return HSTURanking, dict(
        num_items=num_items,
        item_embedding_dim=config.embedding_dim,
        embedding_dim=config.embedding_dim,
        task_bitmasks=list(task_bits),
        action_weights=[int(a) for a in Action],  # every feedback bit of the history
        max_uih_len=config.max_seq_len,
        max_targets=config.num_candidates,
        num_heads=config.num_heads,
        num_layers=config.num_layers,
        dropout_ratio=config.dropout,
        backend=config.backend,
    )


def _counts(cls: type) -> Callable[[TrainConfig, int, Sequence[int]], Spec]:
    """A retrieval baseline fitted from counts, built from the catalogue size alone."""
    return lambda config, num_items, task_bits: (cls, dict(num_items=num_items))


def _popularity_ranking(config: TrainConfig, num_items: int, task_bits: Sequence[int]) -> Spec:
    return PopularityRanking, dict(num_items=num_items, task_bitmasks=list(task_bits))


MODELS: Dict[str, Callable[[TrainConfig, int, Sequence[int]], Spec]] = {
    "hstu-retrieval": _hstu_retrieval,
    "sasrec": _sasrec,
    "hstu-ranking": _hstu_ranking,
    "most-popular": _counts(MostPopular),
    "item-transitions": _counts(ItemTransitions),
    "item-knn": _counts(ItemKNN),
    "popularity-ranking": _popularity_ranking,
}


def is_fitted(config: TrainConfig) -> bool:
    """Whether ``config.model`` is fitted from the training events (``model.fit(train)``)
    rather than trained by gradient steps."""
    return config.model in FITTED_MODELS


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
    cls, kwargs = MODELS[config.model](config, num_items, task_bits)
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
    cls, kwargs = MODELS[config.model](config, num_items, task_bits)
    if embedding_tables != "plain":
        kwargs = {**kwargs, "embedding_tables": embedding_tables}
    return cls(**kwargs, device=device)


def make_task(config: TrainConfig, dataset: SequenceDataset, ctx: DistContext) -> Task:
    """The task ``config.model`` trains on, over ``dataset``."""
    kind = RetrievalTask if config.task == "retrieval" else RankingTask
    return kind(dataset, config, ctx)
