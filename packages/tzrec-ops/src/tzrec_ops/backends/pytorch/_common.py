"""Shared helpers of the pytorch backend: compute dtype and jagged index arithmetic.

Legend: L = total tokens of a jagged batch, B = batch size, N = padded length, D = features.
Every helper is plain torch (differentiable, traceable): sizes come from tensor shapes or
from the caller, never from a device-to-host copy.
"""

from __future__ import annotations

import torch

from tzrec_ops.jagged import lengths_from_offsets, row_positions


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


def jagged_to_padded(
    values: torch.Tensor, offsets: torch.Tensor, max_len: int, use_fbgemm: bool = HAS_FBGEMM
) -> torch.Tensor:
    """``[L, *rest]`` jagged -> ``[B, max_len, *rest]``, zero padded (lengths <= max_len).

    fbgemm's ``jagged_to_padded_dense`` when ``use_fbgemm`` (and the dtype is one it has),
    else one gather that reads an appended zero row for the padded slots.
    """
    rest = values.shape[1:]
    flat = values.flatten(1) if values.dim() > 1 else values[:, None]
    if use_fbgemm and values.dtype in _FBGEMM_DTYPES:
        dense = torch.ops.fbgemm.jagged_to_padded_dense(
            flat, [offsets.to(torch.int64)], [max_len], 0.0
        )
    else:
        batch = offsets.shape[0] - 1
        pos = torch.arange(max_len, device=values.device)
        index = offsets[:-1].to(torch.int64)[:, None] + pos[None, :]
        # padded slots read the appended zero row at index L
        index = torch.where(
            pos[None, :] < lengths_from_offsets(offsets)[:, None], index, values.shape[0]
        )
        extended = torch.cat([flat, flat.new_zeros(1, flat.shape[1])])
        dense = extended[index.reshape(-1)].reshape(batch, max_len, flat.shape[1])
    return dense.reshape(dense.shape[0], max_len, *rest)


def padded_to_jagged(
    dense: torch.Tensor, offsets: torch.Tensor, total: int, use_fbgemm: bool = HAS_FBGEMM
) -> torch.Tensor:
    """``[B, N, *rest]`` padded -> ``[total, *rest]``: the first ``length_b`` rows of each."""
    max_len, rest = dense.shape[1], dense.shape[2:]
    flat = dense.flatten(2) if dense.dim() > 2 else dense[..., None]
    if use_fbgemm and dense.dtype in _FBGEMM_DTYPES:
        values = torch.ops.fbgemm.dense_to_jagged(flat, [offsets.to(torch.int64)], total)[0]
    else:
        sample, pos = row_positions(offsets, total)
        values = flat.flatten(0, 1)[sample * max_len + pos]
    return values.reshape(total, *rest)
