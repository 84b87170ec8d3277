"""Reference jagged ops: concat/split of two jagged (or dense) sides and a jagged bmm.

Legend: B = batch, L = total rows, D = features. A side given without offsets is dense:
exactly ``max_len`` rows per sequence. Concat and split are permutations of rows, computed
with one index_copy / index_select (no padding); the bmm pads to [B, max_seq_len, K].
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from tzrec_ops.backends.pytorch._common import (
    compute_dtype,
    jagged_to_padded,
    padded_to_jagged,
)
from tzrec_ops.jagged import row_positions


def _batch_size(
    offsets: Tuple[Optional[torch.Tensor], Optional[torch.Tensor]],
    rows: Tuple[int, int],
    max_lens: Tuple[Optional[int], Optional[int]],
) -> int:
    for o in offsets:
        if o is not None:
            return o.numel() - 1
    for r, m in zip(rows, max_lens):
        if m:
            return r // m
    return 0


def _offsets_or_dense(
    offsets: Optional[torch.Tensor], max_len: Optional[int], batch: int, device: torch.device
) -> torch.Tensor:
    if offsets is not None:
        return offsets.to(torch.int64)
    return torch.arange(batch + 1, device=device, dtype=torch.int64) * max_len


def _interleave_index(
    off_left: torch.Tensor, off_right: torch.Tensor, total_left: int, total_right: int
) -> torch.Tensor:
    """Row of the concatenated layout for each row of [left; right]: [L_l + L_r] int64.

    Row i of left sequence b lands at ``i + off_right[b]``; row j of right sequence b at
    ``j + off_left[b + 1]`` (after all of sequence b's left rows).
    """
    device = off_left.device
    seg_l = row_positions(off_left, total_left)[0]
    seg_r = row_positions(off_right, total_right)[0]
    dest_l = torch.arange(total_left, device=device) + off_right[seg_l]
    dest_r = torch.arange(total_right, device=device) + off_left[seg_r + 1]
    return torch.cat([dest_l, dest_r])


def concat_2D_jagged(
    values_left: torch.Tensor,
    values_right: torch.Tensor,
    max_len_left: int,
    max_len_right: int,
    offsets_left: Optional[torch.Tensor] = None,
    offsets_right: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """[L_l, D] and [L_r, D] -> [L_l + L_r, D]: per sequence, its left rows then its right rows."""
    rows_l, rows_r = values_left.shape[0], values_right.shape[0]
    batch = _batch_size(
        (offsets_left, offsets_right), (rows_l, rows_r), (max_len_left, max_len_right)
    )
    device = values_left.device
    off_l = _offsets_or_dense(offsets_left, max_len_left, batch, device)
    off_r = _offsets_or_dense(offsets_right, max_len_right, batch, device)
    dest = _interleave_index(off_l, off_r, rows_l, rows_r)
    source = torch.cat([values_left, values_right])
    return source.new_zeros(source.shape).index_copy(0, dest, source)


def split_2D_jagged(
    max_seq_len: int,
    values: torch.Tensor,
    total_len_left: Optional[int] = None,
    total_len_right: Optional[int] = None,
    max_len_left: Optional[int] = None,
    max_len_right: Optional[int] = None,
    offsets_left: Optional[torch.Tensor] = None,
    offsets_right: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`concat_2D_jagged`: [L, D] -> ([L_l, D], [L_r, D]).

    ``total_len_left`` must be given (the public function resolves it); ``max_seq_len`` only
    bounds the lengths and is not needed here.
    """
    rows = values.shape[0]
    if total_len_left is None:
        raise ValueError("total_len_left must be resolved by the caller")
    total_right = rows - total_len_left
    batch = _batch_size(
        (offsets_left, offsets_right), (total_len_left, total_right), (max_len_left, max_len_right)
    )
    device = values.device
    off_l = _offsets_or_dense(offsets_left, max_len_left, batch, device)
    off_r = _offsets_or_dense(offsets_right, max_len_right, batch, device)
    source = _interleave_index(off_l, off_r, total_len_left, total_right)
    gathered = values.index_select(0, source)
    return gathered[:total_len_left], gathered[total_len_left:]


def jagged_dense_bmm_broadcast_add(
    max_seq_len: int,
    seq_offsets: torch.Tensor,
    jagged: torch.Tensor,
    dense: torch.Tensor,
    bias: torch.Tensor,
) -> torch.Tensor:
    """out_b = jagged_b [L_b, K] @ dense_b [K, N] + bias_b [N], for every sequence: [L, N]."""
    cd = compute_dtype(jagged.dtype)
    padded = jagged_to_padded(jagged.to(cd), seq_offsets, max_seq_len)
    out = torch.baddbmm(bias.to(cd).unsqueeze(1), padded, dense.to(cd))
    return padded_to_jagged(out, seq_offsets, jagged.shape[0]).to(jagged.dtype)
