"""The checkpoint format of tzrec: tzrec-bench's trainer writes it, tzrec-gr's serving and
tzrec-acc read it, all through this module.

A checkpoint is a ``torch.save`` dict, read back with ``weights_only=True``:

* ``format``: :data:`FORMAT`, the version of this schema;
* ``model_config``: ``{"model": class name, "kwargs": constructor arguments}``, from which
  :func:`tzrec_gr.models.build_from_config` rebuilds the model;
* ``model``: the model's state dict;
* ``vocabulary`` (optional): the training data's raw ids,
  :meth:`IdVocabularies.state <tzrec_gr.vocabulary.IdVocabularies.state>`.

A trainer adds its own entries (its settings, step, metrics, and in :data:`CHECKPOINT` what
a resumed run restores); readers of the model ignore them. A run's folder holds
:data:`BEST` (the model at the best validation metric) and :data:`CHECKPOINT` (the latest
state); :func:`resolve_checkpoint` is the one rule from a folder to its file.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from tzrec_gr.models import build_from_config
from tzrec_gr.vocabulary import IdVocabularies, VocabularyError

__all__ = [
    "BEST",
    "CHECKPOINT",
    "FORMAT",
    "MODEL_KEYS",
    "CheckpointError",
    "IncompleteCheckpointError",
    "load_model",
    "read_payload",
    "resolve_checkpoint",
    "write_payload",
]

#: the version of the schema above; a reader refuses any other
FORMAT = 1
#: the best model of a run (what serving loads from a run's folder first)
BEST = "best.pt"
#: the run's latest state (what a resumed run restores)
CHECKPOINT = "checkpoint.pt"
#: what every checkpoint holds for the readers of its model
MODEL_KEYS = ("format", "model_config", "model")

PathLike = Union[str, pathlib.Path]


class CheckpointError(ValueError):
    """A file that is not a readable checkpoint: truncated or damaged, of another kind or
    format, or inconsistent; the message names the file."""


class IncompleteCheckpointError(CheckpointError):
    """A file torch loads but that lacks entries the caller needs (e.g. a plain state dict):
    the message names them."""


def resolve_checkpoint(path: PathLike) -> pathlib.Path:
    """A checkpoint file as given, or a run's folder: its :data:`BEST`, else its
    :data:`CHECKPOINT` (which then may not exist: the caller says so)."""
    path = pathlib.Path(path)
    if path.is_dir():
        best = path / BEST
        return best if best.exists() else path / CHECKPOINT
    return path


def write_payload(path: PathLike, payload: Dict[str, Any]) -> None:
    """Writes ``payload`` with ``format`` set to ``path``, atomically: to a temporary name,
    then renamed, so an interrupted write never leaves a truncated checkpoint."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    torch.save({**payload, "format": FORMAT}, partial)
    os.replace(partial, path)


def _first_sentence(exc: BaseException) -> str:
    """``Type: first sentence of the message``, on one line (torch's run to paragraphs)."""
    lines = str(exc).strip().splitlines()
    text = lines[0].split(". ")[0] if lines else ""
    text = text if len(text) <= 120 else text[:117] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def read_payload(
    path: PathLike, expected: str = "a tzrec checkpoint", required: Sequence[str] = MODEL_KEYS
) -> Dict[str, Any]:
    """The dict of the checkpoint file ``path``, tensors on the CPU.

    Args:
        path: the file (see :func:`resolve_checkpoint` for a run's folder).
        expected: what the caller wanted, for the messages (e.g. "a checkpoint.pt or
            best.pt written by `tzrec-bench train`").
        required: the entries the caller needs besides ``format``. Default:
            :data:`MODEL_KEYS`.

    Raises:
        FileNotFoundError: no file at ``path``.
        CheckpointError: a file torch cannot load, not a dict, without ``format`` or a
            ``required`` entry (all missing ones are named), or not of :data:`FORMAT`.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises RuntimeError, EOFError, UnpicklingError, ...
        raise CheckpointError(
            f"{path}: cannot be loaded ({_first_sentence(exc)}): truncated, damaged or of "
            f"another kind; expected {expected}"
        ) from exc
    if not isinstance(payload, dict):
        raise CheckpointError(
            f"{path}: holds a {type(payload).__name__}, not a checkpoint; expected {expected}"
        )
    missing = [key for key in dict.fromkeys(("format", *required)) if key not in payload]
    if missing:
        raise IncompleteCheckpointError(
            f"{path}: no {', '.join(missing)} in the file; expected {expected}"
        )
    if payload["format"] != FORMAT:
        raise CheckpointError(
            f"{path}: checkpoint format {payload['format']!r}, expected {FORMAT} ({expected})"
        )
    return payload


def load_model(
    path: PathLike, backend: Optional[str] = None, expected: str = "a tzrec checkpoint"
) -> Tuple[nn.Module, Optional[IdVocabularies]]:
    """The model of the checkpoint at ``path`` (a file or a run's folder), its weights
    loaded, in eval mode on the CPU, and the id vocabularies it carries (None when it
    carries none).

    Args:
        path: a checkpoint file or a run's folder.
        backend: the ops backend to build the model with (e.g. ``"pytorch"`` to serve on a
            CPU a model trained with ``"triton"``). Default: the saved one.
        expected: what the caller wanted, for the messages about other files.

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
        CheckpointError: the file is not a checkpoint of the model (:func:`read_payload`),
            its state dict does not fit its model, or its vocabulary is
            unreadable or of another size than the model's catalogue.
        ValueError: its model config names no model this version builds, or an unknown or
            unavailable backend.
    """
    file = resolve_checkpoint(path)
    payload = read_payload(file, expected)
    try:
        vocabularies = IdVocabularies.from_payload(payload, str(file))
    except VocabularyError as exc:
        raise CheckpointError(str(exc)) from exc
    model = build_from_config(payload["model_config"], backend)
    if not isinstance(payload["model"], dict):
        raise CheckpointError(f"{file}: its model is a {type(payload['model']).__name__}, "
                              "not a state dict")
    try:
        model.load_state_dict(payload["model"])
    except (RuntimeError, TypeError) as exc:
        raise CheckpointError(f"the state dict in {file} does not fit the model: {exc}") from exc
    if vocabularies is not None:
        try:
            vocabularies.check_catalogue(int(model.num_items), str(file))
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None
    return model.eval(), vocabularies
