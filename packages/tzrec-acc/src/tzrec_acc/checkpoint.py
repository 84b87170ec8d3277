"""Rebuild a tzrec-gr model from a saved file, without importing tzrec-bench.

Two sources:

* a checkpoint of tzrec-bench's trainer (``checkpoint.pt`` or ``best.pt``, or a run's folder:
  its ``best.pt``, else ``checkpoint.pt``), read by :mod:`tzrec_gr.checkpoint`, which
  defines the format (the model's class and constructor arguments, its state dict and the
  training data's raw ids);
* a state dict file plus a model config file (JSON or TOML) of the same form::

      {"model": "HSTURanking", "kwargs": {"num_items": 1000, "item_embedding_dim": 32, ...}}

  with ``kwargs`` the model's constructor arguments, and ``model`` the class name of a
  trained model of the model registry (:mod:`tzrec_gr.models.registry`: tzrec-gr's own, or
  a plugin's).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import torch
from torch import nn

from tzrec_ops.extras import require

__all__ = [
    "load_checkpoint",
    "load_model",
    "model_from_config",
    "resolve_path",
]

PathLike = Union[str, pathlib.Path]
_EXPECTED = "a checkpoint.pt or best.pt written by `tzrec-bench train`"


def _models() -> Any:
    return require("tzrec_gr.models", "tzrec-acc[gr]", "rebuilding tzrec-gr models")


def _build(name: str, kwargs: Mapping[str, Any]) -> nn.Module:
    """The registered model class ``name`` built with ``kwargs`` (ValueError naming the
    registered classes for another name)."""
    return _models().build_from_config({"model": name, "kwargs": kwargs})


def _read_config(path: PathLike) -> Dict[str, Any]:
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no model config at {path}")
    if path.suffix == ".toml":
        try:
            import tomllib
        except ImportError as exc:  # Python 3.10
            raise ValueError(f"{path}: TOML configs need Python 3.11; use JSON") from exc
        config = tomllib.loads(path.read_text())
    elif path.suffix == ".json":
        config = json.loads(path.read_text())
    else:
        raise ValueError(f"the model config must be a .json or .toml file, got {path}")
    if not isinstance(config.get("model"), str) or not isinstance(config.get("kwargs"), dict):
        raise ValueError(
            f"{path} must hold 'model' (one of {', '.join(_models().MODEL_CLASSES)}) and "
            f"'kwargs' (a table of constructor arguments), got keys {sorted(config)}"
        )
    return config


def model_from_config(config: Mapping[str, Any], backend: Optional[str] = None) -> nn.Module:
    """A fresh model from ``{"model": class name, "kwargs": {...}}`` (``backend`` overrides)."""
    kwargs = dict(config["kwargs"])
    if backend is not None:
        kwargs["backend"] = backend
    return _build(config["model"], kwargs)


def resolve_path(path: PathLike) -> pathlib.Path:
    """``path``, or for a tzrec-bench run's folder its ``best.pt``, else ``checkpoint.pt``
    (tzrec-gr's rule, :func:`tzrec_gr.checkpoint.resolve_checkpoint`)."""
    path = pathlib.Path(path)
    if not path.is_dir():
        return path
    return _checkpoints().resolve_checkpoint(path)


def _checkpoints() -> Any:
    return require("tzrec_gr.checkpoint", "tzrec-acc[gr]", "reading tzrec-bench checkpoints")


def load_model(
    path: PathLike, config: Optional[PathLike] = None, backend: Optional[str] = None
) -> nn.Module:
    """The model saved at ``path``, in eval mode on the CPU (:func:`load_checkpoint`
    without the vocabularies)."""
    return load_checkpoint(path, config, backend)[0]


def load_checkpoint(
    path: PathLike, config: Optional[PathLike] = None, backend: Optional[str] = None
) -> Tuple[nn.Module, Any]:
    """The model saved at ``path``, in eval mode on the CPU, and the id vocabularies the
    checkpoint carries (a :class:`tzrec_gr.vocabulary.IdVocabularies`; None for a plain
    state dict or a checkpoint without one).

    Args:
        path: a tzrec-bench checkpoint or run folder, or a state dict file when ``config``
            is given.
        config: a JSON/TOML model config for a plain state dict.
        backend: the ops backend to build with (e.g. ``"pytorch"`` to export on the CPU a
            model trained with the triton backend). Default: the saved one.

    Raises:
        FileNotFoundError, ValueError: a missing file, a file torch cannot load (truncated or
            damaged), a file of another kind, an unsupported model or a state dict that does
            not fit it; the message names ``path``.
    """
    if config is None:
        checkpoints = _checkpoints()
        try:
            return checkpoints.load_model(path, backend, expected=_EXPECTED)
        except checkpoints.IncompleteCheckpointError as exc:
            raise ValueError(f"{exc} (for a plain state dict pass its model config too: "
                             "--config)") from exc
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no state dict at {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises RuntimeError, EOFError, UnpicklingError, ...
        raise ValueError(
            f"{path}: cannot be loaded ({type(exc).__name__}): truncated, damaged or of "
            "another kind; expected a state dict saved with torch.save"
        ) from exc
    model = model_from_config(_read_config(config), backend)
    if not isinstance(state, dict):
        raise ValueError(f"{path} must hold a state dict, got {type(state).__name__}")
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        raise ValueError(f"the state dict in {path} does not fit the model: {exc}") from exc
    return model.eval(), None
