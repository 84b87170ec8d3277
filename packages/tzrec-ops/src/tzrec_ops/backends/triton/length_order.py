"""Sequences ordered by descending length, in one kernel launch (``sort_by_length``).

The attention kernels schedule the longest sequences first through this order. Each
sequence's place is its rank, counted directly: the number of sequences that are longer, or
as long with a smaller index (so ties keep index order and the result is deterministic).
That is O(B^2) comparisons, so batches above :data:`MAX_RANKED_BATCH` use ``torch.argsort``;
up to there the one launch is several times faster than ``argsort`` of the lengths. Wide
tiles keep the loop short.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tzrec_ops.backends.triton._eager import launchable
from tzrec_ops.ops.utils import cdiv

MAX_RANKED_BATCH = 1024
# sequences ranked per program and compared per step: an [8, 512] int32 tile over 4 warps
# is 32 values per thread, so nothing spills, and B <= 1024 takes at most two steps
_BLOCK_I = 8
_BLOCK_J = 512
_NUM_WARPS = 4


@triton.jit
def _lengths(lo, hi, mask):
    """int32 lengths from offsets ``lo``/``hi`` (loaded by the caller: see the note on helpers
    in ``_kernel_utils``); -1 where masked off, never ahead of a real sequence."""
    return tl.where(mask, hi - lo, -1).to(tl.int32)


@triton.jit(do_not_specialize=["B"])
def _length_order_kernel(seq_offsets, order, B, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr):
    """``order[rank(i)] = i`` for the sequences ``i`` of this program's block."""
    i = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
    len_i = _lengths(
        tl.load(seq_offsets + i, mask=i < B, other=0),
        tl.load(seq_offsets + i + 1, mask=i < B, other=0),
        i < B,
    )
    rank = tl.zeros([BLOCK_I], dtype=tl.int32)
    for j0 in range(0, B, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        len_j = _lengths(
            tl.load(seq_offsets + j, mask=j < B, other=0),
            tl.load(seq_offsets + j + 1, mask=j < B, other=0),
            j < B,
        )
        ahead = (len_j[None, :] > len_i[:, None]) | (
            (len_j[None, :] == len_i[:, None]) & (j[None, :] < i[:, None])
        )
        rank += tl.sum(ahead.to(tl.int32), axis=1)
    tl.store(order + rank, i, mask=i < B)


def length_order(seq_offsets: torch.Tensor) -> torch.Tensor:
    """int32 ``[B]``: sequence indices by descending length (``seq_offsets``: ``[B + 1]``)."""
    batch = seq_offsets.shape[0] - 1
    if batch > MAX_RANKED_BATCH:
        lengths = seq_offsets[1:] - seq_offsets[:-1]
        return torch.argsort(lengths, descending=True, stable=True).to(torch.int32)
    order = torch.empty(batch, dtype=torch.int32, device=seq_offsets.device)
    if batch > 0:
        launchable(_length_order_kernel)[(cdiv(batch, _BLOCK_I),)](
            seq_offsets, order, batch, BLOCK_I=_BLOCK_I, BLOCK_J=_BLOCK_J, num_warps=_NUM_WARPS
        )
    return order
