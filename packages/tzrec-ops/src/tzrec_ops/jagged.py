"""Jagged index primitives: the one place every package takes them from.

A jagged batch packs ``B`` sequences of different lengths into ``L`` rows; ``offsets``
``[B + 1]`` start at 0 and end at ``L``, ``lengths`` ``[B]`` are their differences. This module
holds the index arithmetic on them (offsets <-> lengths, each row's sample and position,
gathers of whole rows) and the tools that keep a host copy of such small index tensors, so
that value checks and host-side sizes need no device-to-host sync:

* :func:`to_device` moves a CPU index tensor and remembers its values;
* :func:`mirror` runs an index computation on the device tensors and on their host copies;
* :func:`check_once` runs a value check on the host copies, once per batch;
* :func:`host_copy` / :func:`host_copies` read (or reuse) a tensor's host copy.

Every index helper is plain torch (traceable, no ``.item()``, no host copies of its own):
totals come from tensor shapes or from the caller. Where a derived index tensor will be checked
later, derive it through :func:`mirror` (``mirror(offsets_from_lengths, lengths)``) so it has a
host copy whenever its inputs have one; kernels and backends call the helpers directly.
"""

from __future__ import annotations

from typing import Sequence, Tuple, Union

import torch

from tzrec_ops.ops.host_copies import (
    HostCopy,
    host_copies,
    host_copy,
    known_host_copy,
    mirror,
    remember_host_copy,
    to_device,
)
from tzrec_ops.ops.utils import tracing
from tzrec_ops.ops.validation import check_once, first_true, value_checks_enabled

__all__ = [
    "HostCopy",
    "as_int64",
    "check_once",
    "concat_jagged_rows",
    "first_true",
    "host_copies",
    "host_copy",
    "known_host_copy",
    "lengths_from_offsets",
    "mirror",
    "offsets_from_lengths",
    "remember_host_copy",
    "row_positions",
    "select_jagged_rows",
    "to_device",
    "tracing",
    "value_checks_enabled",
]


def offsets_from_lengths(
    lengths: Union[torch.Tensor, Sequence[int]], dtype: torch.dtype = torch.int64
) -> torch.Tensor:
    """``[B]`` lengths -> ``[B + 1]`` offsets (a leading 0, then the running sum).

    ``lengths`` may be a tensor (the offsets are on its device) or a sequence of Python ints
    (CPU offsets). ``mirror(offsets_from_lengths, lengths)`` also gives the offsets a host
    copy when ``lengths`` has one.
    """
    if not isinstance(lengths, torch.Tensor):
        lengths = torch.as_tensor(lengths, dtype=torch.int64).reshape(-1)
    zero = torch.zeros(1, dtype=torch.int64, device=lengths.device)
    return torch.cat([zero, torch.cumsum(lengths.to(torch.int64), dim=0)]).to(dtype)


def lengths_from_offsets(offsets: torch.Tensor) -> torch.Tensor:
    """``[B + 1]`` offsets -> ``[B]`` lengths, in the offsets' dtype
    (``mirror(lengths_from_offsets, offsets)`` keeps a host copy)."""
    return offsets[1:] - offsets[:-1]


def _int64(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int64)


def as_int64(t: torch.Tensor) -> torch.Tensor:
    """``t`` as int64; an int64 ``t`` itself (so its host copy and passed checks are kept)."""
    return t if t.dtype == torch.int64 else mirror(_int64, t)


def row_positions(offsets: torch.Tensor, total: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """For each of ``total`` jagged rows: its sample index and its position in the sample.

    Returns:
        (sample ``[total]`` int64, position ``[total]`` int64).
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
    """Per-sample ``[left_b ; right_b]`` of any dtype (rows along dim 0), by one gather.

    ``left_offsets``/``right_offsets`` are ``[B + 1]``; the totals are the inputs' row counts.
    """
    total = left.shape[0] + right.shape[0]
    left_offsets = left_offsets.to(torch.int64)
    right_offsets = right_offsets.to(torch.int64)
    sample, pos = row_positions(left_offsets + right_offsets, total)
    left_len = lengths_from_offsets(left_offsets)[sample]
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
        values: ``[L, ...]`` rows of the jagged batch.
        offsets: ``[B + 1]`` offsets of ``values``.
        keep_offsets: ``[B + 1]`` offsets of the kept rows.
        start: ``[B]`` first kept position of each sample.
        total_kept: number of kept rows (``keep_offsets[-1]``, from the caller).

    Returns:
        ``[total_kept, ...]``.
    """
    sample, pos = row_positions(keep_offsets, total_kept)
    index = offsets.to(torch.int64)[sample] + start.to(torch.int64)[sample] + pos
    return values.index_select(0, index)
