"""Jagged 2-D ops: concat and split of two jagged sides, and a per-sequence bmm.

Legend: B = batch, L = total rows of a jagged ``values`` tensor [L, D], offsets [B + 1]
(int32 or int64; cumulative lengths with a leading 0). A side whose offsets are ``None`` is
dense: exactly ``max_len`` rows per sequence, so B = rows / max_len.

Example (B = 2): left lengths [2, 1], right lengths [1, 2]::

    left  = [a0, a1 | b0]        right = [x0 | y0, y1]
    concat_2D_jagged(left, right) = [a0, a1, x0 | b0, y0, y1]
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from tzrec_ops.jagged import lengths_from_offsets
from tzrec_ops.ops.autocast import autocast_inputs
from tzrec_ops.ops.host_copies import host_copy
from tzrec_ops.ops.validation import (
    check_dim,
    check_jagged,
    check_non_negative,
    check_offsets,
    check_once,
    check_same_device,
    check_same_dtype,
    check_tensor,
    first_true,
)
from tzrec_ops.registry import Backend, select_backend

BackendArg = Union[str, Backend, None]
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_side(
    side: str,
    rows: int,
    rows_what: str,
    offsets: Optional[torch.Tensor],
    max_len: Optional[int],
    batch: int,
) -> None:
    """A jagged side's offsets end at ``rows`` with lengths <= max_len (values checked once
    per batch); a dense side has exactly B * max_len rows."""
    if offsets is None:
        if max_len is None:
            raise ValueError(f"max_len_{side} is required when offsets_{side} is None (dense side)")
        if rows != batch * max_len:
            raise ValueError(
                f"{rows_what} ({rows}) must equal B * max_len_{side} = {batch} * {max_len} = "
                f"{batch * max_len} for a dense {side} side"
            )
        return
    check_offsets(f"offsets_{side}", offsets, batch=batch)
    check_jagged(
        f"offsets_{side}",
        offsets,
        total=rows,
        total_what=rows_what,
        max_seq_len=max_len,
        max_name=f"max_len_{side}",
    )


def _batch(
    offsets_left: Optional[torch.Tensor],
    offsets_right: Optional[torch.Tensor],
    rows: Tuple[int, int],
    max_lens: Tuple[Optional[int], Optional[int]],
) -> int:
    """B from the jagged sides' offsets, else from a dense side's rows / max_len."""
    named = [
        (name, o)
        for name, o in (("offsets_left", offsets_left), ("offsets_right", offsets_right))
        if o is not None
    ]
    for name, o in named:
        check_offsets(name, o)
    if len(named) == 2 and offsets_left.numel() != offsets_right.numel():
        raise ValueError(
            f"offsets_left ({offsets_left.numel()} entries) and offsets_right "
            f"({offsets_right.numel()} entries) must describe the same batch"
        )
    if named:
        return named[0][1].numel() - 1
    for r, m in zip(rows, max_lens):
        if m:
            return r // m
    return 0


def concat_2D_jagged(
    values_left: torch.Tensor,
    values_right: torch.Tensor,
    max_len_left: int,
    max_len_right: int,
    offsets_left: Optional[torch.Tensor] = None,
    offsets_right: Optional[torch.Tensor] = None,
    *,
    backend: BackendArg = None,
) -> torch.Tensor:
    """Per sequence, its left rows followed by its right rows.

    Args:
        values_left: [L_l, D].
        values_right: [L_r, D], same dtype.
        max_len_left, max_len_right: upper bounds on the lengths of each side (the exact
            length of a dense side).
        offsets_left, offsets_right: [B + 1] int32/int64, or ``None`` for a dense side.

    Returns:
        [L_l + L_r, D].
    """
    check_tensor("values_left", values_left, ndim=2)
    check_tensor("values_right", values_right, ndim=2)
    check_dim("values_right", values_right, 1, values_left.shape[1], "values_left.shape[1]")
    check_same_dtype(("values_left", values_left), ("values_right", values_right))
    check_same_device(
        ("values_left", values_left),
        ("values_right", values_right),
        ("offsets_left", offsets_left),
        ("offsets_right", offsets_right),
    )
    check_non_negative("max_len_left", max_len_left)
    check_non_negative("max_len_right", max_len_right)
    rows = (values_left.shape[0], values_right.shape[0])
    batch = _batch(offsets_left, offsets_right, rows, (max_len_left, max_len_right))
    _check_side("left", rows[0], "values_left.shape[0]", offsets_left, max_len_left, batch)
    _check_side("right", rows[1], "values_right.shape[0]", offsets_right, max_len_right, batch)
    impl = select_backend(
        "concat_2D_jagged", backend, device=values_left.device, dtype=values_left.dtype
    )
    return impl(
        values_left=values_left,
        values_right=values_right,
        max_len_left=max_len_left,
        max_len_right=max_len_right,
        offsets_left=offsets_left,
        offsets_right=offsets_right,
    )


def split_2D_jagged(
    max_seq_len: int,
    values: torch.Tensor,
    total_len_left: Optional[int] = None,
    total_len_right: Optional[int] = None,
    max_len_left: Optional[int] = None,
    max_len_right: Optional[int] = None,
    offsets_left: Optional[torch.Tensor] = None,
    offsets_right: Optional[torch.Tensor] = None,
    *,
    backend: BackendArg = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`concat_2D_jagged`: split each sequence into a left and right part.

    Args:
        max_seq_len: upper bound on ``length_left + length_right`` per sequence.
        values: [L, D].
        total_len_left, total_len_right: row counts of the two outputs. When both sides are
            jagged and neither is given, ``offsets_left[-1]`` is taken from its host copy
            (one device sync per batch, none for offsets moved with
            :func:`~tzrec_ops.jagged.to_device`; it breaks
            ``torch.compile(fullgraph=True)``): pass one to avoid it.
        max_len_left, max_len_right: required for a dense side (its exact length).
        offsets_left, offsets_right: [B + 1]; at least one side must be jagged.

    Returns:
        ([L_l, D], [L_r, D]).
    """
    check_tensor("values", values, ndim=2)
    check_non_negative("max_seq_len", max_seq_len)
    if offsets_left is None and offsets_right is None:
        raise ValueError(
            "split_2D_jagged needs offsets_left or offsets_right (at most one side may be dense)"
        )
    check_same_device(
        ("values", values), ("offsets_left", offsets_left), ("offsets_right", offsets_right)
    )
    for name, value in (
        ("total_len_left", total_len_left),
        ("total_len_right", total_len_right),
        ("max_len_left", max_len_left),
        ("max_len_right", max_len_right),
    ):
        if value is not None:
            check_non_negative(name, value)
    rows = values.shape[0]
    batch = _batch(offsets_left, offsets_right, (rows, rows), (None, None))
    for side, offsets, max_len in (
        ("left", offsets_left, max_len_left),
        ("right", offsets_right, max_len_right),
    ):
        if offsets is None and max_len is None:
            raise ValueError(f"max_len_{side} is required when offsets_{side} is None (dense side)")
    if offsets_left is None:
        total_len_left = _dense_total("left", total_len_left, batch * max_len_left)
    if offsets_right is None:
        total_len_right = _dense_total("right", total_len_right, batch * max_len_right)
    if total_len_left is None and total_len_right is None:
        # the host copy: read once per batch, or never for offsets moved with to_device
        total_len_left = int(host_copy(offsets_left).values[-1])
    if total_len_left is None:
        total_len_left = rows - total_len_right
    if total_len_right is None:
        total_len_right = rows - total_len_left
    if total_len_left + total_len_right != rows or total_len_left < 0 or total_len_right < 0:
        raise ValueError(
            f"total_len_left ({total_len_left}) + total_len_right ({total_len_right}) "
            f"must equal values.shape[0] ({rows})"
        )
    _check_side("left", total_len_left, "total_len_left", offsets_left, max_len_left, batch)
    _check_side("right", total_len_right, "total_len_right", offsets_right, max_len_right, batch)
    _check_split_lengths(max_seq_len, offsets_left, offsets_right, max_len_left, max_len_right)
    impl = select_backend("split_2D_jagged", backend, device=values.device, dtype=values.dtype)
    return impl(
        max_seq_len=max_seq_len,
        values=values,
        total_len_left=total_len_left,
        total_len_right=total_len_right,
        max_len_left=max_len_left,
        max_len_right=max_len_right,
        offsets_left=offsets_left,
        offsets_right=offsets_right,
    )


def _dense_total(side: str, given: Optional[int], expected: int) -> int:
    if given is not None and given != expected:
        raise ValueError(
            f"total_len_{side} ({given}) must equal B * max_len_{side} ({expected}) "
            f"for a dense {side} side"
        )
    return expected


def _check_split_lengths(
    max_seq_len: int,
    offsets_left: Optional[torch.Tensor],
    offsets_right: Optional[torch.Tensor],
    max_len_left: Optional[int],
    max_len_right: Optional[int],
) -> None:
    """Every ``length_left + length_right`` is at most ``max_seq_len`` (once per batch)."""

    def side(offsets: Optional[torch.Tensor], max_len: Optional[int]) -> torch.Tensor:
        # a dense side's length is its max_len, broadcast over the batch
        return torch.tensor(max_len) if offsets is None else lengths_from_offsets(offsets)

    def check(left: Optional[torch.Tensor], right: Optional[torch.Tensor]) -> None:
        both = side(left, max_len_left) + side(right, max_len_right)
        if bool((both > max_seq_len).any()):
            b = first_true(both > max_seq_len)
            raise ValueError(
                f"left + right lengths must be <= max_seq_len ({max_seq_len}), got "
                f"{int(both[b])} for sequence {b}"
            )

    key = ("split lengths", max_seq_len, max_len_left, max_len_right)
    check_once(key, (offsets_left, offsets_right), check)


def jagged_dense_bmm_broadcast_add(
    max_seq_len: int,
    seq_offsets: torch.Tensor,
    jagged: torch.Tensor,
    dense: torch.Tensor,
    bias: torch.Tensor,
    *,
    backend: BackendArg = None,
) -> torch.Tensor:
    """Per sequence b: ``out_b = jagged_b @ dense[b] + bias[b]``.

    Args:
        max_seq_len: upper bound on the sequence lengths.
        seq_offsets: [B + 1] int32/int64.
        jagged: [L, K].
        dense: [B, K, N], same dtype as jagged (any strides).
        bias: [B, N], same dtype.

    Returns:
        [L, N] in jagged's dtype.
    """
    jagged, dense, bias = autocast_inputs(jagged, dense, bias)
    check_non_negative("max_seq_len", max_seq_len)
    check_tensor("jagged", jagged, ndim=2, dtypes=_FLOATS)
    check_tensor("dense", dense, ndim=3)
    check_tensor("bias", bias, ndim=2)
    check_same_dtype(("jagged", jagged), ("dense", dense), ("bias", bias))
    check_same_device(
        ("jagged", jagged), ("dense", dense), ("bias", bias), ("seq_offsets", seq_offsets)
    )
    batch = dense.shape[0]
    check_offsets("seq_offsets", seq_offsets, batch=batch)
    check_dim("dense", dense, 1, jagged.shape[1], "jagged.shape[1]")
    check_dim("bias", bias, 0, batch, "dense.shape[0]")
    check_dim("bias", bias, 1, dense.shape[2], "dense.shape[2]")
    check_jagged(
        "seq_offsets",
        seq_offsets,
        total=jagged.shape[0],
        total_what="the token count jagged.shape[0]",
        max_seq_len=max_seq_len,
    )
    impl = select_backend(
        "jagged_dense_bmm_broadcast_add", backend, device=jagged.device, dtype=jagged.dtype
    )
    return impl(
        max_seq_len=max_seq_len, seq_offsets=seq_offsets, jagged=jagged, dense=dense, bias=bias
    )
