"""Reading a tzrec-bench checkpoint (``best.pt``) into its model, for
:meth:`~tzrec_gr.serving.ServingSession.from_checkpoint`."""

from __future__ import annotations

import pathlib
from typing import Optional, Union

import torch
from torch import nn

__all__ = ["load_model"]


def load_model(
    path: Union[str, pathlib.Path], backend: Optional[str], expected_format: int
) -> nn.Module:
    """The model of the checkpoint at ``path``, its weights loaded (on the CPU).

    Args:
        path: a ``torch.save`` dict with ``format``, ``model_config``
            (``{"model": class name, "kwargs": constructor args}``) and ``model`` (the
            state dict).
        backend (str | None): the ops backend to build the model with; None: the saved one.
        expected_format (int): the ``format`` this reader understands.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: the file is not such a checkpoint, or its state dict does not fit.
    """
    from tzrec_gr.models import build_from_config  # (tzrec_gr.models imports serving)

    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises RuntimeError, EOFError, UnpicklingError...
        raise ValueError(f"{path}: cannot be loaded as a checkpoint ({exc})") from exc
    if not isinstance(payload, dict) or not {"format", "model_config", "model"} <= set(payload):
        raise ValueError(
            f"{path} is not a tzrec-bench checkpoint (a dict with 'format', "
            "'model_config' and 'model')"
        )
    if payload["format"] != expected_format:
        raise ValueError(
            f"{path}: checkpoint format {payload['format']!r}, expected {expected_format}"
        )
    model = build_from_config(payload["model_config"], backend)
    try:
        model.load_state_dict(payload["model"])
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"the state dict in {path} does not fit the model: {exc}") from exc
    return model
