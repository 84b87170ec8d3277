"""SiLU backward on strided 2-D views: ``dx = dy * s * (1 + x * (1 - s))``, ``s = sigmoid(x)``.

The fused STU backward writes the gradient of ``u`` straight into its column view of the
``duvqk`` buffer, a view with a row stride wider than its row; torch's ``silu_backward`` runs a
slow generic strided kernel there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tzrec_ops.backends.triton._eager import launchable
from tzrec_ops.ops.utils import cdiv, next_power_of_2

_TILE_ELEMENTS = 4096


@triton.jit(do_not_specialize=["M"])
def _silu_bwd_kernel(
    DY,
    X,
    DX,
    M,
    N,
    stride_dy,
    stride_x,
    stride_dx,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    s = tl.sigmoid(x)
    dx = dy.to(tl.float32) * s * (1.0 + x * (1.0 - s))
    tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)


def silu_backward(dy: torch.Tensor, x: torch.Tensor, dx: torch.Tensor) -> None:
    """Write the gradient of ``silu(x)`` for upstream ``dy`` into ``dx``; all three are
    ``[M, N]`` with unit column stride (any row stride)."""
    for name, t in (("dy", dy), ("x", x), ("dx", dx)):
        if t.shape != x.shape or t.stride(1) != 1:
            raise ValueError(
                f"silu_backward: {name} must be [M, N] = {list(x.shape)} with unit column "
                f"stride, got shape {list(t.shape)} and strides {list(t.stride())}"
            )
    M, N = x.shape
    if M == 0 or N == 0:
        return
    block_n = min(256, next_power_of_2(N))
    block_m = max(1, _TILE_ELEMENTS // block_n)
    launchable(_silu_bwd_kernel)[(cdiv(M, block_m), cdiv(N, block_n))](
        dy,
        x,
        dx,
        M,
        N,
        dy.stride(0),
        x.stride(0),
        dx.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
    )
