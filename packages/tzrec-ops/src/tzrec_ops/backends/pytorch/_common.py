"""Shared helpers of the pytorch backend: compute dtype and jagged index arithmetic.

Legend: L = total tokens of a jagged batch, B = batch size, N = padded length, D = features.
Every helper is plain torch (differentiable, traceable): sizes come from tensor shapes or
from the caller, never from a device-to-host copy.
"""

from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 input, float32 for every other dtype."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def upcast(t: torch.Tensor) -> torch.Tensor:
    """``t`` in its compute dtype (no copy when it already is)."""
    return t.to(compute_dtype(t.dtype))


def _import_fbgemm() -> bool:
    try:
        import fbgemm_gpu  # noqa: F401
    except Exception:  # not installed, or a build that does not load with this torch
        return False
    return hasattr(torch.ops.fbgemm, "jagged_to_padded_dense")


# Decided once, when the backend is first used (this module is imported lazily), so that
# torch.compile never traces an import.
HAS_FBGEMM: bool = _import_fbgemm()
# fbgemm's jagged<->padded kernels have no float64 version: float64 takes the index path.
_FBGEMM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def segment_ids(offsets: torch.Tensor, total: int) -> torch.Tensor:
    """The sequence index of every token: [L] int64 for ``offsets`` [B + 1]."""
    offsets = offsets.to(torch.int64)
    lengths = offsets[1:] - offsets[:-1]
    batch = torch.arange(lengths.numel(), device=offsets.device)
    return torch.repeat_interleave(batch, lengths, output_size=total)


def positions(offsets: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
    """The position of every token inside its sequence: [L] int64."""
    token = torch.arange(seg.numel(), device=seg.device)
    return token - offsets.to(torch.int64)[seg]


def jagged_to_padded(values: torch.Tensor, offsets: torch.Tensor, max_len: int) -> torch.Tensor:
    """[L, D] jagged values -> [B, max_len, D], zero padded (lengths must be <= max_len)."""
    batch = offsets.numel() - 1
    if HAS_FBGEMM and values.dtype in _FBGEMM_DTYPES:
        return torch.ops.fbgemm.jagged_to_padded_dense(
            values, [offsets.to(torch.int64)], [max_len], 0.0
        )
    seg = segment_ids(offsets, values.shape[0])
    pos = positions(offsets, seg)
    padded = values.new_zeros(batch, max_len, values.shape[1])
    return padded.index_put((seg, pos), values)


def padded_to_jagged(padded: torch.Tensor, offsets: torch.Tensor, total: int) -> torch.Tensor:
    """[B, N, D] padded -> [L, D]: the first ``length_b`` rows of every sequence."""
    if HAS_FBGEMM and padded.dtype in _FBGEMM_DTYPES:
        return torch.ops.fbgemm.dense_to_jagged(padded, [offsets.to(torch.int64)], total)[0]
    seg = segment_ids(offsets, total)
    return padded[seg, positions(offsets, seg)]
