"""Build a model from a config: the one lookup from a model's class name to its class.

A model config is what tzrec-bench's trainer saves with every checkpoint (``model_config``)
and what tzrec-acc reads beside a plain state dict::

    {"model": "HSTURanking", "kwargs": {"num_items": 1000, "item_embedding_dim": 32, ...}}

with ``kwargs`` the model's constructor arguments.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

from torch import nn

from tzrec_gr.models.ranking import HSTURanking
from tzrec_gr.models.retrieval import HSTURetrieval
from tzrec_ops import BackendError

__all__ = ["MODEL_CLASSES", "build_from_config"]

#: the models a config may name, by class name
MODEL_CLASSES: Dict[str, type] = {"HSTURanking": HSTURanking, "HSTURetrieval": HSTURetrieval}


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
    if name not in MODEL_CLASSES:
        raise ValueError(f"model must be one of {', '.join(MODEL_CLASSES)}, got {name!r}")
    if not isinstance(spec["kwargs"], Mapping):
        raise ValueError(f"the config's kwargs must be a mapping, got {type(spec['kwargs'])}")
    kwargs = dict(spec["kwargs"])
    if backend is not None:
        kwargs["backend"] = backend
    try:
        return MODEL_CLASSES[name](**kwargs)
    except TypeError as exc:
        raise ValueError(f"the config's kwargs do not fit {name}: {exc}") from exc
    except BackendError as exc:  # an unknown or unavailable ops backend
        raise ValueError(f"cannot build {name}: {exc}") from exc
