"""Rebuild a tzrec-gr model from a saved file, without importing tzrec-bench.

Two sources:

* a checkpoint of tzrec-bench's trainer (``checkpoint.pt`` or ``best.pt``, or a run's folder:
  its ``best.pt``, else ``checkpoint.pt``, :func:`tzrec_gr.serving.resolve_checkpoint`): a
  ``torch.save`` dict with ``format`` 1, ``model_config`` (the model's class and constructor
  arguments, as the trainer built it), ``model`` (the state dict) and ``vocabulary`` (the
  training data's raw ids, :class:`tzrec_gr.vocabulary.IdVocabularies`; absent from older
  files);
* a state dict file plus a model config file (JSON or TOML) of the same form::

      {"model": "HSTURanking", "kwargs": {"num_items": 1000, "item_embedding_dim": 32, ...}}

  with ``kwargs`` the model's constructor arguments.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import torch
from torch import nn

from tzrec_ops.extras import require

__all__ = [
    "CHECKPOINT_FORMAT",
    "load_checkpoint",
    "load_model",
    "model_from_config",
    "resolve_path",
]

CHECKPOINT_FORMAT = 1
CLASSES = ("HSTURanking", "HSTURetrieval")

PathLike = Union[str, pathlib.Path]


def _build(name: str, kwargs: Mapping[str, Any]) -> nn.Module:
    if name not in CLASSES:
        raise ValueError(f"model must be one of {', '.join(CLASSES)}, got {name!r}")
    models = require("tzrec_gr.models", "tzrec-acc[gr]", "rebuilding tzrec-gr models")
    return models.build_from_config({"model": name, "kwargs": kwargs})


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
            f"{path} must hold 'model' (one of {', '.join(CLASSES)}) and 'kwargs' (a table "
            f"of constructor arguments), got keys {sorted(config)}"
        )
    return config


def model_from_config(config: Mapping[str, Any], backend: Optional[str] = None) -> nn.Module:
    """A fresh model from ``{"model": class name, "kwargs": {...}}`` (``backend`` overrides)."""
    kwargs = dict(config["kwargs"])
    if backend is not None:
        kwargs["backend"] = backend
    return _build(config["model"], kwargs)


def _first_sentence(exc: BaseException) -> str:
    """``Type: first sentence of the message``, on one line (torch's run to paragraphs)."""
    lines = str(exc).strip().splitlines()
    text = lines[0].split(". ")[0] if lines else ""
    text = text if len(text) <= 120 else text[:117] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def resolve_path(path: PathLike) -> pathlib.Path:
    """``path``, or for a tzrec-bench run's folder its ``best.pt``, else ``checkpoint.pt``
    (tzrec-gr's rule, :func:`tzrec_gr.serving.resolve_checkpoint`)."""
    path = pathlib.Path(path)
    if not path.is_dir():
        return path
    serving = require("tzrec_gr.serving", "tzrec-acc[gr]", "reading a tzrec-bench run folder")
    return serving.resolve_checkpoint(path)


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
    path = resolve_path(path) if config is None else pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint or state dict at {path}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises RuntimeError, EOFError, UnpicklingError, ...
        what = "a state dict saved with torch.save" if config is not None else (
            "a checkpoint.pt or best.pt written by `tzrec-bench train`"
        )
        raise ValueError(
            f"{path}: cannot be loaded ({_first_sentence(exc)}): truncated, damaged or of "
            f"another kind; expected {what}"
        ) from exc
    vocabularies = None
    if config is not None:
        spec = _read_config(config)
        state = payload
        model = model_from_config(spec, backend)
    else:
        if not isinstance(payload, dict) or "format" not in payload or "model" not in payload:
            raise ValueError(
                f"{path} is not a tzrec-bench checkpoint (a dict with 'format', 'model_config' "
                "and 'model'); for a plain state dict pass a model config too (--config)"
            )
        if payload.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(
                f"{path}: checkpoint format {payload.get('format')!r}, expected {CHECKPOINT_FORMAT}"
            )
        spec = payload.get("model_config")
        if not isinstance(spec, dict):
            raise ValueError(
                f"{path} has no model_config: save its 'model' state dict and pass a model "
                "config (--config)"
            )
        state = payload["model"]
        model = model_from_config(spec, backend)
        vocabulary = require("tzrec_gr.vocabulary", "tzrec-acc[gr]", "reading id vocabularies")
        try:
            vocabularies = vocabulary.IdVocabularies.from_payload(payload, str(path))
        except vocabulary.VocabularyError as exc:
            raise ValueError(str(exc)) from exc
        if vocabularies is not None and len(vocabularies.items) != int(model.num_items):
            raise ValueError(
                f"{path}: its item vocabulary has {len(vocabularies.items)} ids but the "
                f"model {int(model.num_items)} items; the file is inconsistent"
            )
    if not isinstance(state, dict):
        raise ValueError(f"{path} must hold a state dict, got {type(state).__name__}")
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        raise ValueError(f"the state dict in {path} does not fit the model: {exc}") from exc
    return model.eval(), vocabularies
