"""Sync-free jagged index helpers (plain torch; used for integer side data like timestamps).

Legend: B = batch, L = total tokens of a jagged batch, offsets ``[B + 1]`` start at 0.
Every total is taken from a tensor shape or from the caller, never from ``.item()``.

Index tensors derived from others (offsets from lengths, lengths from offsets, ...) go
through :func:`~tzrec_ops.ops.host_copies.mirror`, so that they have a host copy whenever
their inputs have one and the ops can check them without reading the device.
"""

from __future__ import annotations

from typing import Tuple

import torch

from tzrec_ops.ops.host_copies import mirror


def offsets_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """``[B]`` lengths -> ``[B + 1]`` int64 offsets (plain torch, for ``mirror``)."""
    zero = torch.zeros(1, dtype=torch.int64, device=lengths.device)
    return torch.cat([zero, torch.cumsum(lengths.to(torch.int64), dim=0)])


def lengths_to_offsets(lengths: torch.Tensor) -> torch.Tensor:
    """``[B]`` lengths -> ``[B + 1]`` int64 offsets with a leading 0 (no host sync)."""
    return mirror(offsets_from_lengths, lengths)


def _lengths_from_offsets(offsets: torch.Tensor) -> torch.Tensor:
    return offsets[1:] - offsets[:-1]


def offsets_to_lengths(offsets: torch.Tensor) -> torch.Tensor:
    """``[B + 1]`` offsets -> ``[B]`` lengths (no host sync)."""
    return mirror(_lengths_from_offsets, offsets)


def _int64(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int64)


def as_int64(t: torch.Tensor) -> torch.Tensor:
    """``t`` as int64; an int64 ``t`` itself (so its host copy and checks are kept)."""
    return t if t.dtype == torch.int64 else mirror(_int64, t)


def row_positions(offsets: torch.Tensor, total: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """For each of ``total`` jagged rows: its sample index and position in the sample.

    Returns:
        (sample [total] int64, position [total] int64).
    """
    rows = torch.arange(total, device=offsets.device, dtype=torch.int64)
    offsets = offsets.to(torch.int64)
    # offsets[0] == 0 <= every row, so counting all offsets <= row counts one extra; searching
    # the whole tensor rather than offsets[1:] keeps AOTInductor off a slice view, whose
    # searchsorted lowering it does not implement (torch 2.11)
    sample = torch.searchsorted(offsets, rows, right=True) - 1
    return sample, rows - offsets[sample]


def concat_jagged_rows(
    left: torch.Tensor,
    right: torch.Tensor,
    left_offsets: torch.Tensor,
    right_offsets: torch.Tensor,
) -> torch.Tensor:
    """Per-sample ``[left_b ; right_b]`` of any dtype (rows along dim 0), by a gather.

    ``left_offsets``/``right_offsets`` are ``[B + 1]``; the totals are the inputs' row counts.
    """
    total = left.shape[0] + right.shape[0]
    left_offsets = left_offsets.to(torch.int64)
    right_offsets = right_offsets.to(torch.int64)
    sample, pos = row_positions(left_offsets + right_offsets, total)
    left_len = (left_offsets[1:] - left_offsets[:-1])[sample]
    from_left = pos < left_len
    index = torch.where(
        from_left,
        left_offsets[sample] + pos,
        left.shape[0] + right_offsets[sample] + pos - left_len,
    )
    return torch.cat([left, right], dim=0).index_select(0, index)


def select_jagged_rows(
    values: torch.Tensor,
    offsets: torch.Tensor,
    keep_offsets: torch.Tensor,
    start: torch.Tensor,
    total_kept: int,
) -> torch.Tensor:
    """Keep rows ``[start_b, start_b + kept_b)`` of each sample (kept from ``keep_offsets``).

    Args:
        values: [L, ...] rows of the jagged batch.
        offsets: [B + 1] offsets of ``values``.
        keep_offsets: [B + 1] offsets of the kept rows.
        start: [B] first kept position of each sample.
        total_kept: number of kept rows (``keep_offsets[-1]``, from the caller).

    Returns:
        [total_kept, ...].
    """
    sample, pos = row_positions(keep_offsets, total_kept)
    index = offsets.to(torch.int64)[sample] + start.to(torch.int64)[sample] + pos
    return values.index_select(0, index)
