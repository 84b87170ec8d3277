"""``addmm``: a matrix product plus a broadcast bias or a full matrix.

Shapes: mat1 [M, K], mat2 [K, N], input [N] (a bias broadcast over rows) or [M, N].
"""

from __future__ import annotations

from typing import Union

import torch

from tzrec_ops.ops.autocast import autocast_inputs
from tzrec_ops.ops.validation import check_same_device, check_same_dtype, check_tensor
from tzrec_ops.registry import Backend, select_backend

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def addmm(
    input: torch.Tensor,
    mat1: torch.Tensor,
    mat2: torch.Tensor,
    *,
    backend: Union[str, Backend, None] = None,
) -> torch.Tensor:
    """``input + mat1 @ mat2``.

    Args:
        input: [N] or [M, N], same dtype as mat1.
        mat1: [M, K].
        mat2: [K, N].
        backend: backend name or record; ``None`` selects one (see :mod:`tzrec_ops.registry`).

    Returns:
        [M, N] in mat1's dtype (accumulated in float32 or better).
    """
    input, mat1, mat2 = autocast_inputs(input, mat1, mat2)
    check_tensor("mat1", mat1, ndim=2, dtypes=_FLOATS)
    check_tensor("mat2", mat2, ndim=2)
    check_tensor("input", input)
    check_same_dtype(("mat1", mat1), ("mat2", mat2), ("input", input))
    check_same_device(("mat1", mat1), ("mat2", mat2), ("input", input))
    m, k = mat1.shape
    n = mat2.shape[1]
    if mat2.shape[0] != k:
        raise ValueError(f"mat2.shape[0] ({mat2.shape[0]}) must equal mat1.shape[1] ({k})")
    if tuple(input.shape) not in ((n,), (m, n)):
        raise ValueError(
            f"input must have shape [{n}] or [{m}, {n}] (mat1 [M, K] @ mat2 [K, N]), "
            f"got {list(input.shape)}"
        )
    impl = select_backend("addmm", backend, device=mat1.device, dtype=mat1.dtype)
    return impl(input=input, mat1=mat1, mat2=mat2)
