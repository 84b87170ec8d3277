"""Construction by name: the model (its registry record maps the settings to constructor
arguments) and the task it trains on."""

from __future__ import annotations

from typing import Any, Dict, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from tzrec_bench.data import SequenceDataset
from tzrec_bench.data.item_attributes import ItemAttributes, load_item_attributes
from tzrec_bench.train.config import TrainConfig
from tzrec_bench.train.distributed import DistContext
from tzrec_bench.train.task import Task
from tzrec_gr.embeddings import TableFactory
from tzrec_gr.models.registry import get_model

#: (model class, its constructor arguments except ``device``: plain values that JSON holds)
Spec = Tuple[type, Dict[str, Any]]


class AttributeSizes(NamedTuple):
    """The sizes of a model's attribute table without its links (a checkpoint's state dict
    brings those)."""

    num_attributes: int
    num_links: int

    @classmethod
    def saved(cls, model_config: Mapping[str, Any]) -> Optional["AttributeSizes"]:
        """The sizes in a checkpoint's ``model_config``; None for a model without them."""
        kwargs = model_config.get("kwargs", {})
        if not kwargs.get("num_attributes"):
            return None
        return cls(int(kwargs["num_attributes"]), int(kwargs["num_attribute_links"]))


#: a model's item attributes: links and sizes (read from a file), or sizes alone
Attributes = Union[ItemAttributes, AttributeSizes]


def _spec(
    config: TrainConfig,
    num_items: int,
    task_bits: Sequence[int],
    attributes: Optional[Attributes] = None,
) -> Spec:
    """``config.model``'s class and constructor arguments, from its registry record (with
    the sizes of its attribute table when ``attributes`` are given)."""
    record = get_model(config.model)
    if record.trainer_kwargs is None:
        raise ValueError(f"model {config.model!r} has no trainer builder: tzrec-bench cannot "
                         "train it")
    kwargs = record.trainer_kwargs(config, num_items, task_bits)
    if attributes is not None:
        kwargs.update(num_attributes=attributes.num_attributes,
                      num_attribute_links=attributes.num_links)
    return record.model_class, kwargs


def item_attributes(config: TrainConfig, dataset: SequenceDataset) -> Optional[ItemAttributes]:
    """The attributes of ``config.item_attributes`` in ``dataset``'s items; None without."""
    if config.item_attributes is None:
        return None
    return load_item_attributes(config.item_attributes, dataset.item_raw_ids)


def is_fitted(config: TrainConfig) -> bool:
    """Whether ``config.model`` is fitted from the training events (``model.fit(train)``)
    rather than trained by gradient steps."""
    return get_model(config.model).fitted


def model_config(
    config: TrainConfig,
    num_items: int,
    task_bits: Sequence[int] = (),
    attributes: Optional[Attributes] = None,
) -> Dict[str, Any]:
    """``{"model": class name, "kwargs": constructor arguments}`` of ``config.model``: what
    checkpoints store so that a model is rebuilt without this package (``tzrec-acc``).

    Args:
        config (TrainConfig): the run's settings.
        num_items (int): catalogue size.
        task_bits (Sequence[int]): the ranking model's label bit per task (ignored by the
            retrieval models).
        attributes (ItemAttributes | AttributeSizes | None): the items' attributes
            (:func:`item_attributes`), or the sizes of a saved model's table.
    """
    cls, kwargs = _spec(config, num_items, task_bits, attributes)
    return {"model": cls.__name__, "kwargs": kwargs}


def build_model(
    config: TrainConfig,
    num_items: int,
    task_bits: Sequence[int] = (),
    device: Optional[torch.device] = None,
    embedding_tables: Union[str, TableFactory] = "plain",
    attributes: Optional[Attributes] = None,
) -> nn.Module:
    """The model ``config.model`` for a catalogue of ``num_items`` (arguments as in
    :func:`model_config`), with its parameters on ``device`` and its items linked to
    ``attributes`` (given as sizes alone, the links stay to be loaded with a state dict);
    ``embedding_tables`` is the HSTU models' table implementation (a checkpoint's
    ``model_config`` holds plain tables)."""
    cls, kwargs = _spec(config, num_items, task_bits, attributes)
    if embedding_tables != "plain":
        kwargs = {**kwargs, "embedding_tables": embedding_tables}
    model = cls(**kwargs, device=device)
    if isinstance(attributes, ItemAttributes):
        model.item_attributes.set_links(torch.from_numpy(attributes.offsets),
                                        torch.from_numpy(attributes.attribute_ids))
    return model


def make_task(config: TrainConfig, dataset: SequenceDataset, ctx: DistContext) -> Task:
    """The task ``config.model`` trains on, over ``dataset``."""
    return config.facts.trainer_class()(dataset, config, ctx)
