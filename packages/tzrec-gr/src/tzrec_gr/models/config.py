"""Build a model from a config: the one lookup from a model's class name to its class.

A model config is what tzrec-bench's trainer saves with every checkpoint (``model_config``)
and what tzrec-acc reads beside a plain state dict::

    {"model": "HSTURanking", "kwargs": {"num_items": 1000, "item_embedding_dim": 32, ...}}

with ``kwargs`` the model's constructor arguments. The class name is looked up in the model
registry (:func:`tzrec_gr.models.registry.record_for_class`): any trained (not fitted) model
registered there, tzrec-gr's own or a plugin's, can be rebuilt from its config.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping, Optional

from torch import nn

import tzrec_gr.models.ranking  # noqa: F401  (registers hstu-ranking)
import tzrec_gr.models.retrieval  # noqa: F401  (registers hstu-retrieval)
from tzrec_gr.models.registry import (
    ModelRecord,
    ModelRegistryError,
    get_model,
    model_names,
    record_for_class,
)
from tzrec_ops import BackendError

__all__ = ["MODEL_CLASSES", "build_from_config"]


def _buildable(name: Any) -> Optional[ModelRecord]:
    """The record of the trained model whose class is named ``name``, else None (fitted
    baselines are fitted from counts, not rebuilt from a config)."""
    if not isinstance(name, str):
        return None
    try:
        record = record_for_class(name)
    except ModelRegistryError:
        return None
    return None if record.fitted else record


class _ModelClasses(Mapping[str, type]):
    """A read-only view of the model registry: class name -> class of every trained model,
    sorted by name, read at each use (so plugins and later registrations are in it)."""

    def __getitem__(self, name: str) -> type:
        record = _buildable(name)
        if record is None:
            raise KeyError(name)
        return record.model_class

    def __iter__(self) -> Iterator[str]:
        records = (get_model(n) for n in model_names())
        return iter(sorted(r.model_class.__name__ for r in records if not r.fitted))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"MODEL_CLASSES({dict(self)!r})"


#: the models a config may name, by class name: a view of the model registry (its trained
#: models), not a list of its own
MODEL_CLASSES: Mapping[str, type] = _ModelClasses()


def build_from_config(spec: Mapping[str, Any], backend: Optional[str] = None) -> nn.Module:
    """A fresh model (random weights, training mode) from ``{"model": name, "kwargs": {...}}``.

    Args:
        spec: the config: ``model`` one of :data:`MODEL_CLASSES`' names, ``kwargs`` the
            constructor arguments.
        backend: the ops backend to build with, replacing the config's. Default: the
            config's.

    Returns:
        nn.Module: the model.

    Raises:
        ValueError: ``spec`` lacks ``model`` or ``kwargs``, names another model, its
            kwargs do not fit the class, or its ops backend is unknown or unavailable.
    """
    if not isinstance(spec, Mapping) or "model" not in spec or "kwargs" not in spec:
        got = sorted(spec) if isinstance(spec, Mapping) else type(spec).__name__
        raise ValueError(
            f"a model config must hold 'model' (one of {', '.join(MODEL_CLASSES)}) and "
            f"'kwargs' (the constructor arguments), got {got}"
        )
    name = spec["model"]
    record = _buildable(name)
    if record is None:
        raise ValueError(f"model must be one of {', '.join(MODEL_CLASSES)}, got {name!r}")
    if not isinstance(spec["kwargs"], Mapping):
        raise ValueError(f"the config's kwargs must be a mapping, got {type(spec['kwargs'])}")
    kwargs = dict(spec["kwargs"])
    if backend is not None:
        kwargs["backend"] = backend
    try:
        return record.model_class(**kwargs)
    except TypeError as exc:
        raise ValueError(f"the config's kwargs do not fit {name}: {exc}") from exc
    except BackendError as exc:  # an unknown or unavailable ops backend
        raise ValueError(f"cannot build {name}: {exc}") from exc
