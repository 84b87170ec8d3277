"""Reading a tzrec-bench checkpoint (``best.pt``, or a run's folder) into its model and its
id vocabularies, for :meth:`~tzrec_gr.serving.ServingSession.from_checkpoint`; and
:func:`resolve_checkpoint`, the one rule from a run's folder to its file (tzrec-bench and
tzrec-acc import it from :mod:`tzrec_gr.serving`)."""

from __future__ import annotations

import pathlib
from typing import Any, Dict, Optional, Tuple, Union

import torch
from torch import nn

from tzrec_gr.models import build_from_config
from tzrec_gr.vocabulary import IdVocabularies

__all__ = ["BEST", "CHECKPOINT", "load_model", "read_checkpoint", "resolve_checkpoint"]

#: the best model of a run (what ``predict`` serves first)
BEST = "best.pt"
#: the run's last checkpoint (what ``--resume`` restores)
CHECKPOINT = "checkpoint.pt"


def resolve_checkpoint(path: Union[str, pathlib.Path]) -> pathlib.Path:
    """A checkpoint file as given, or a run's folder: its ``best.pt``, else its
    ``checkpoint.pt`` (which then may not exist: the caller says so)."""
    path = pathlib.Path(path)
    if path.is_dir():
        best = path / BEST
        return best if best.exists() else path / CHECKPOINT
    return path


def read_checkpoint(
    path: Union[str, pathlib.Path], expected_format: int
) -> Tuple[pathlib.Path, Dict[str, Any]]:
    """(the file, its payload) of the checkpoint at ``path`` (a file or a run's folder),
    tensors on the CPU, read with ``weights_only=True``.

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
        ValueError: the file is not a checkpoint of ``expected_format``.
    """
    file = resolve_checkpoint(path)
    if not file.is_file():
        raise FileNotFoundError(f"no checkpoint at {file}")
    try:
        payload = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises RuntimeError, EOFError, UnpicklingError...
        raise ValueError(f"{file}: cannot be loaded as a checkpoint ({exc})") from exc
    if not isinstance(payload, dict) or not {"format", "model_config", "model"} <= set(payload):
        raise ValueError(
            f"{file} is not a tzrec-bench checkpoint (a dict with 'format', "
            "'model_config' and 'model')"
        )
    if payload["format"] != expected_format:
        raise ValueError(
            f"{file}: checkpoint format {payload['format']!r}, expected {expected_format}"
        )
    return file, payload


def load_model(
    path: Union[str, pathlib.Path], backend: Optional[str], expected_format: int
) -> Tuple[nn.Module, Optional[IdVocabularies]]:
    """The model of the checkpoint at ``path`` (a file or a run's folder), its weights
    loaded (on the CPU), and the id vocabularies it carries (None for a file without
    them).

    Args:
        path: a ``torch.save`` dict with ``format``, ``model_config``
            (``{"model": class name, "kwargs": constructor args}``), ``model`` (the
            state dict) and, optionally, ``vocabulary``
            (:meth:`IdVocabularies.state <tzrec_gr.vocabulary.IdVocabularies.state>`).
        backend (str | None): the ops backend to build the model with; None: the saved one.
        expected_format (int): the ``format`` this reader understands.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: the file is not such a checkpoint, its state dict does not fit, or its
            vocabulary cannot be read (a :class:`~tzrec_gr.vocabulary.VocabularyError`).
    """
    file, payload = read_checkpoint(path, expected_format)
    vocabularies = IdVocabularies.from_payload(payload, str(file))
    model = build_from_config(payload["model_config"], backend)
    try:
        model.load_state_dict(payload["model"])
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"the state dict in {file} does not fit the model: {exc}") from exc
    check_vocabulary_fits(vocabularies, model, str(file))
    return model, vocabularies


def check_vocabulary_fits(vocabularies: Optional[IdVocabularies], model: Any, what: str) -> None:
    """A vocabulary of as many items as the model's catalogue, or a ValueError naming
    ``what``."""
    if vocabularies is None:
        return
    num_items = int(getattr(model, "num_items", len(vocabularies.items)))
    if len(vocabularies.items) != num_items:
        raise ValueError(
            f"{what}: its item vocabulary has {len(vocabularies.items)} ids but the model "
            f"{num_items} items; the file is inconsistent"
        )
