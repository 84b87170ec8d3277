"""The one reading of a ``--device`` option that every tzrec command shares."""

from __future__ import annotations

import torch

__all__ = ["DeviceError", "resolve_device"]


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
