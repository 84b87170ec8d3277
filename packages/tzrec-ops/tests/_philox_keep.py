"""The dropout mask of the Triton norm kernels, drawn independently of them (tests only).

The kernels keep element ``(row, col)`` of an output ``[L, W]`` where
``tl.rand(seed, row * W + col) >= p`` (int64 offsets, fp32 ``p``). Before the seed became a
device tensor they took it as a scalar kernel argument; :func:`philox_keep` draws the mask
that way, so a test can show that a seed still gives the mask it gave then.
"""

from __future__ import annotations

from typing import Sequence, Union

import torch
import triton
import triton.language as tl


@triton.jit
def _keep_kernel(KEEP, seed, n, p, BLOCK: tl.constexpr):
    offs = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    keep = tl.rand(seed, offs) >= p
    tl.store(KEEP + offs, keep.to(tl.int8), mask=offs < n)


def philox_keep(
    seed: int, shape: Sequence[int], p: float, device: Union[str, torch.device]
) -> torch.Tensor:
    """``[L, W]`` bool, True where the draw of the int ``seed`` keeps the element."""
    rows, width = shape
    n = rows * width
    keep = torch.empty(n, dtype=torch.int8, device=device)
    if n:
        _keep_kernel[(triton.cdiv(n, 128),)](keep, seed, n, p, BLOCK=128)
    return keep.view(rows, width).bool()
