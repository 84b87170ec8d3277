"""Host-side helpers of the serving hot path: index tensors built on the host and moved to
the device in one transfer (their host copies known, so nothing reads them back), joins
that do not copy a single part, and copies of many tensors in one launch."""

from __future__ import annotations

import itertools
from typing import List, Sequence

import torch

from tzrec_ops.jagged import remember_host_copy

__all__ = [
    "copied",
    "host_offsets",
    "joined_rows",
    "lengths_and_offsets",
    "lengths_of",
    "offsets_of",
    "to_device_together",
]


def copied(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """A copy of each tensor, made by one multi-tensor kernel (not one launch each)."""
    out = [torch.empty_like(t) for t in tensors]
    torch._foreach_copy_(out, list(tensors))
    return out


def offsets_of(lengths: Sequence[int]) -> List[int]:
    """The B + 1 offsets of ``lengths``: a leading 0, then the running sum."""
    return [0, *itertools.accumulate(lengths)]


def lengths_of(offsets: Sequence[int]) -> List[int]:
    """The B lengths of B + 1 ``offsets`` (the inverse of :func:`offsets_of`)."""
    return [z - a for a, z in zip(offsets, offsets[1:])]


def host_offsets(lengths: Sequence[int]) -> torch.Tensor:
    """[B + 1] CPU int64 offsets of ``lengths`` (what ``offsets_from_lengths`` gives), in
    one tensor construction."""
    return torch.tensor(offsets_of(lengths), dtype=torch.int64)


def to_device_together(parts: Sequence[List[int]], device: torch.device) -> List[torch.Tensor]:
    """The int lists ``parts`` as int64 tensors on ``device``, moved in one host-to-device
    copy (views of one buffer), each with its host copy remembered. Each view starts a
    multiple of 16 bytes into the buffer, aligned as its own allocation would be: Triton
    specializes its kernels on a pointer's alignment, so a misaligned one would build
    another."""
    starts, flat = [], []
    for values in parts:
        starts.append(len(flat))
        flat += values + [0] * (len(values) % 2)
    host = torch.tensor(flat, dtype=torch.int64)
    moved = host.to(device, non_blocking=True)
    return [
        remember_host_copy(moved[a : a + len(v)], host[a : a + len(v)])
        for a, v in zip(starts, parts)
    ]


def lengths_and_offsets(lengths: List[int], device: torch.device) -> List[torch.Tensor]:
    """``lengths`` [B] and their offsets [B + 1] on ``device``, int64, in one transfer (with
    :func:`to_device_together`: host copies remembered)."""
    return to_device_together([lengths, offsets_of(lengths)], device)


def joined_rows(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)``; a single part as it is (a reader's view, not a copy: rows of
    a user's keys or values, which start at a whole row of the tensor they are a view of)."""
    return parts[0] if len(parts) == 1 else torch.cat(list(parts))
