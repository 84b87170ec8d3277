"""The example backend's implementations; each takes the public op's arguments minus ``backend``."""

from __future__ import annotations

import torch


def addmm(input: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor) -> torch.Tensor:
    """[M, N] = input ([N] or [M, N]) + mat1 [M, K] @ mat2 [K, N], in mat1's dtype.

    Accumulates in float32 (float64 for float64 input). tzrec-ops has validated shapes,
    dtypes and devices before this is called.
    """
    acc = torch.promote_types(mat1.dtype, torch.float32)
    out = torch.matmul(mat1.to(acc), mat2.to(acc)) + input.to(acc)
    return out.to(mat1.dtype)
