"""The one reading of a ``--device`` option that every tzrec command shares."""

from __future__ import annotations

import argparse
from typing import Any

import torch

__all__ = ["DEVICE_HELP", "DeviceError", "add_device_option", "device_option", "resolve_device"]

#: what every ``--device`` help says (a command may add what its own default means)
DEVICE_HELP = ("auto: the GPU when CUDA is available, else the CPU; cpu; cuda: the first GPU; "
               "cuda:N: GPU N")


class DeviceError(ValueError):
    """A device name that is not a device, or one this machine does not have; the message
    starts with the name, so a command prefixes its option: ``--device cuda: no CUDA...``."""


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """The torch device a ``--device`` value names.

    Args:
        name (str): ``auto`` (the GPU when CUDA is available, else the CPU), ``cpu``,
            ``cuda`` (this process's GPU), ``cuda:N`` or any other torch device name.
        local_rank (int): the process's rank on its host: the GPU that ``auto`` and a bare
            ``cuda`` pick. Default: 0.

    Raises:
        DeviceError: ``name`` is not a device, or names CUDA where none is visible.
    """
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as exc:
        raise DeviceError(f"{name!r} is not a device ({exc})") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"{name}: no CUDA device is visible to this process")
        if device.index is None:
            device = torch.device("cuda", local_rank)
    return device


def device_option(text: str) -> torch.device:
    """The argparse ``type`` of every ``--device``: :func:`resolve_device` of the value, so a
    command reads it once, as its command line is parsed, and uses that device thereafter;
    a name that is no device, or CUDA on a machine without it, is the option's error."""
    try:
        return resolve_device(text)
    except DeviceError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_device_option(parser: Any, default: str = "auto", help: str = "") -> argparse.Action:
    """Adds ``--device`` to ``parser`` (a parser or an argument group) the one way every
    command takes it: :func:`device_option` over ``default``, the shared help, then ``help``.
    """
    text = f"{DEVICE_HELP}. {help}".strip() if help else f"{DEVICE_HELP}."
    return parser.add_argument("--device", type=device_option, default=default,
                               metavar="{auto,cpu,cuda,cuda:N}",
                               help=f"{text} Default: {default}")
