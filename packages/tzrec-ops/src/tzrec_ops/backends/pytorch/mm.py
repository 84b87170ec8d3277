"""Reference ``addmm``: ``input + mat1 @ mat2`` in float32 (float64 for float64)."""

from __future__ import annotations

import torch

from tzrec_ops.backends.pytorch._common import upcast


def addmm(input: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor) -> torch.Tensor:
    """[M, N] = input ([N] or [M, N]) + mat1 [M, K] @ mat2 [K, N], in mat1's dtype."""
    return torch.addmm(upcast(input), upcast(mat1), upcast(mat2)).to(mat1.dtype)
