"""Answers ``tzrec_ops_autotune_configs`` with HIP configs on ROCm devices."""

from __future__ import annotations

from typing import Any, List, Optional

import torch

from tzrec_ops.hookspecs import hookimpl


def is_hip(device: torch.device) -> bool:
    return torch.device(device).type == "cuda" and torch.version.hip is not None


@hookimpl
def tzrec_ops_autotune_configs(kernel: str, device: torch.device) -> Optional[List[Any]]:
    if not is_hip(device):
        return None
    from tzrec_ops.backends.rocm import configs

    return configs.for_kernel(kernel)
