"""Triton jagged ops: concat/split of two jagged sides and the per-sequence bmm.

Legend: B = batch, L = total rows, D = features; offsets ``[B + 1]`` int32/int64. A side
without offsets is dense: ``max_len`` rows per sequence.

* concat and split are one copy kernel run in either direction (the backward of each is the
  other): a ``(cdiv(max_len, BLOCK_N), B)`` grid, each program moves a block of one sequence's
  rows. Sequence b's combined rows start at ``offsets_left[b] + offsets_right[b]``.
* ``out_b = jagged_b @ dense_b + bias_b``: a tiled kernel over ``(N tiles, row tiles, B)``;
  ``d_jagged_b = d_out_b @ dense_b^T`` reuses it through strides; ``d_dense_b = jagged_b^T @
  d_out_b`` reduces over the sequence's rows while the same programs sum ``d_bias_b``.

The kernels are in :mod:`._jagged_kernels`; this module holds their launchers, the
``torch.library`` ops with their autograd and the backend functions.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from tzrec_ops.backends.triton import _jagged_kernels as kernels
from tzrec_ops.backends.triton._eager import launchable, triton_library_op
from tzrec_ops.backends.triton._kernel_utils import input_precision, interpreting, tuned
from tzrec_ops.ops.utils import autotune_max_seq_len, cdiv, next_power_of_2


def _copy(
    left: torch.Tensor,
    right: torch.Tensor,
    combined: torch.Tensor,
    offsets_left: Optional[torch.Tensor],
    offsets_right: Optional[torch.Tensor],
    max_len_left: int,
    max_len_right: int,
    batch: int,
    max_len: int,
    split: bool,
) -> None:
    D = combined.shape[1]
    if batch == 0 or max_len == 0 or D == 0 or combined.shape[0] == 0:
        return
    kernel = tuned(
        "jagged_concat_split",
        kernels._concat_split_kernel,
        kernels._copy_configs,
        ["AUTOTUNE_MAX_SEQ_LEN", "D"],
        kernels._COPY_INTERPRET,
        combined.device,
    )

    def grid(meta):
        return (cdiv(max_len, meta["BLOCK_N"]), batch)

    # a dense side's offsets pointer is never read; it must not alias an output (see mm.py)
    unused = offsets_left if offsets_left is not None else offsets_right
    if unused is None:
        unused = torch.zeros(1, dtype=torch.int64, device=combined.device)
    launchable(kernel)[grid](
        left,
        right,
        combined,
        offsets_left if offsets_left is not None else unused,
        offsets_right if offsets_right is not None else unused,
        max_len_left,
        max_len_right,
        D,
        left.stride(0),
        right.stride(0),
        combined.stride(0),
        autotune_max_seq_len(max_len),
        DENSE_LEFT=offsets_left is None,
        DENSE_RIGHT=offsets_right is None,
        SPLIT=split,
        BLOCK_D=min(next_power_of_2(max(D, 1)), 128),
    )


def _batch(offsets_left, offsets_right, rows_left, max_len_left, rows_right, max_len_right):  # type: ignore[no-untyped-def]
    for offsets in (offsets_left, offsets_right):
        if offsets is not None:
            return offsets.shape[0] - 1
    for rows, max_len in ((rows_left, max_len_left), (rows_right, max_len_right)):
        if max_len:
            return rows // max_len
    return 0


@triton_library_op("tzrec_ops::concat_2D_jagged_triton")
def concat_2D_jagged_op(
    values_left: torch.Tensor,
    values_right: torch.Tensor,
    max_len_left: int,
    max_len_right: int,
    offsets_left: Optional[torch.Tensor],
    offsets_right: Optional[torch.Tensor],
) -> torch.Tensor:
    """[L_l, D] and [L_r, D] -> [L_l + L_r, D], each sequence's left rows then its right rows."""
    out = torch.empty(
        (values_left.shape[0] + values_right.shape[0], values_left.shape[1]),
        dtype=values_left.dtype,
        device=values_left.device,
    )
    batch = _batch(
        offsets_left,
        offsets_right,
        values_left.shape[0],
        max_len_left,
        values_right.shape[0],
        max_len_right,
    )
    _copy(
        values_left,
        values_right,
        out,
        offsets_left,
        offsets_right,
        max_len_left,
        max_len_right,
        batch,
        max_len_left + max_len_right,
        split=False,
    )
    return out


@triton_library_op("tzrec_ops::split_2D_jagged_triton")
def split_2D_jagged_op(
    values: torch.Tensor,
    max_seq_len: int,
    total_len_left: int,
    total_len_right: int,
    max_len_left: int,
    max_len_right: int,
    offsets_left: Optional[torch.Tensor],
    offsets_right: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor]:
    """[L, D] -> ([L_l, D], [L_r, D]), the inverse of concat (max_len_* is 0 if unknown)."""
    D = values.shape[1]
    left = torch.empty((total_len_left, D), dtype=values.dtype, device=values.device)
    right = torch.empty((total_len_right, D), dtype=values.dtype, device=values.device)
    batch = _batch(
        offsets_left, offsets_right, total_len_left, max_len_left, total_len_right, max_len_right
    )
    _copy(
        left,
        right,
        values,
        offsets_left,
        offsets_right,
        max_len_left,
        max_len_right,
        batch,
        max_seq_len,
        split=True,
    )
    return left, right


def _setup_concat(ctx, inputs, output):  # type: ignore[no-untyped-def]
    values_left, values_right, max_len_left, max_len_right, offsets_left, offsets_right = inputs
    ctx.save_for_backward(offsets_left, offsets_right)
    ctx.sizes = (values_left.shape[0], values_right.shape[0], max_len_left, max_len_right)


def _concat_backward(ctx, grad):  # type: ignore[no-untyped-def]
    offsets_left, offsets_right = ctx.saved_tensors
    rows_left, rows_right, max_len_left, max_len_right = ctx.sizes
    d_left, d_right = split_2D_jagged_op(
        grad.contiguous(),
        max_len_left + max_len_right,
        rows_left,
        rows_right,
        max_len_left,
        max_len_right,
        offsets_left,
        offsets_right,
    )
    return d_left, d_right, None, None, None, None


concat_2D_jagged_op.register_autograd(_concat_backward, setup_context=_setup_concat)


def _setup_split(ctx, inputs, output):  # type: ignore[no-untyped-def]
    _, max_seq_len, _, _, max_len_left, max_len_right, offsets_left, offsets_right = inputs
    ctx.save_for_backward(offsets_left, offsets_right)
    ctx.max_lens = (max_seq_len, max_len_left, max_len_right)


def _split_backward(ctx, d_left, d_right):  # type: ignore[no-untyped-def]
    offsets_left, offsets_right = ctx.saved_tensors
    max_seq_len, max_len_left, max_len_right = ctx.max_lens
    # a jagged side's length is bounded by max_seq_len; a dense side's is exactly its max_len
    d_values = concat_2D_jagged_op(
        d_left.contiguous(),
        d_right.contiguous(),
        max_seq_len if offsets_left is not None else max_len_left,
        max_seq_len if offsets_right is not None else max_len_right,
        offsets_left,
        offsets_right,
    )
    return d_values, None, None, None, None, None, None, None


split_2D_jagged_op.register_autograd(_split_backward, setup_context=_setup_split)


def concat_2D_jagged(
    values_left: torch.Tensor,
    values_right: torch.Tensor,
    max_len_left: int,
    max_len_right: int,
    offsets_left: Optional[torch.Tensor] = None,
    offsets_right: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Triton backend of :func:`tzrec_ops.ops.jagged_2d.concat_2D_jagged`."""
    return concat_2D_jagged_op(
        _rows_contiguous(values_left),
        _rows_contiguous(values_right),
        max_len_left,
        max_len_right,
        offsets_left,
        offsets_right,
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
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Triton backend of :func:`tzrec_ops.ops.jagged_2d.split_2D_jagged` (totals resolved)."""
    if total_len_left is None:
        total_len_left = values.shape[0] - total_len_right
    if total_len_right is None:
        total_len_right = values.shape[0] - total_len_left
    return split_2D_jagged_op(
        _rows_contiguous(values),
        max_seq_len,
        total_len_left,
        total_len_right,
        max_len_left or 0,
        max_len_right or 0,
        offsets_left,
        offsets_right,
    )


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


# --------------------------------------------------------------------------------------------
# jagged_dense_bmm_broadcast_add


def _jagged_dense(
    max_seq_len: int,
    seq_offsets: torch.Tensor,
    jagged: torch.Tensor,
    dense: torch.Tensor,
    bias: Optional[torch.Tensor],
    out: torch.Tensor,
) -> None:
    """``out_b = jagged_b @ dense[b] (+ bias[b])``; dense is any strided [B, K, N] view."""
    batch, K, N = dense.shape
    if batch == 0 or max_seq_len == 0 or N == 0 or jagged.shape[0] == 0:
        return
    kernel = tuned(
        "jagged_dense_bmm",
        kernels._jagged_dense_bmm_kernel,
        kernels._bmm_configs,
        ["AUTOTUNE_MAX_SEQ_LEN", "N", "K"],
        kernels._BMM_INTERPRET,
        jagged.device,
    )

    def grid(meta):
        return (cdiv(N, meta["BLOCK_N"]), cdiv(max_seq_len, meta["BLOCK_M"]), batch)

    launchable(kernel)[grid](
        jagged,
        dense,
        bias if bias is not None else jagged,  # never alias an output (see mm.py)
        out,
        seq_offsets,
        N,
        K,
        jagged.stride(0),
        dense.stride(0),
        dense.stride(1),
        dense.stride(2),
        bias.stride(0) if bias is not None else 0,
        out.stride(0),
        autotune_max_seq_len(max_seq_len),
        HAS_BIAS=bias is not None,
        UPCAST=interpreting(),
        INPUT_PRECISION=input_precision(jagged.dtype),
    )


@triton_library_op("tzrec_ops::jagged_dense_bmm_broadcast_add_triton")
def jagged_dense_bmm_broadcast_add_op(
    max_seq_len: int,
    seq_offsets: torch.Tensor,
    jagged: torch.Tensor,
    dense: torch.Tensor,
    bias: torch.Tensor,
) -> torch.Tensor:
    """jagged [L, K], dense [B, K, N], bias [B, N] -> [L, N]."""
    out = torch.empty((jagged.shape[0], dense.shape[2]), dtype=jagged.dtype, device=jagged.device)
    if dense.shape[1] == 0:
        out.copy_(
            torch.repeat_interleave(bias, seq_offsets.diff(), dim=0, output_size=jagged.shape[0])
        )
        return out
    _jagged_dense(max_seq_len, seq_offsets, jagged, dense, bias, out)
    return out


@triton_library_op("tzrec_ops::jagged_dense_bmm_broadcast_add_bwd_triton")
def jagged_dense_bmm_broadcast_add_bwd_op(
    max_seq_len: int,
    seq_offsets: torch.Tensor,
    jagged: torch.Tensor,
    dense: torch.Tensor,
    grad: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d_jagged [L, K], d_dense [B, K, N], d_bias [B, N]) from grad [L, N]."""
    batch, K, N = dense.shape
    d_jagged = torch.empty_like(jagged)
    d_dense = torch.empty((batch, K, N), dtype=dense.dtype, device=dense.device)
    d_bias = torch.empty((batch, N), dtype=dense.dtype, device=dense.device)
    if N == 0:
        d_jagged.zero_()
    else:
        _jagged_dense(max_seq_len, seq_offsets, grad, dense.transpose(1, 2), None, d_jagged)
    if batch > 0 and N > 0:
        kernel = tuned(
            "jagged_jagged_bmm",
            kernels._jagged_jagged_bmm_kernel,
            kernels._bmm_configs,
            ["AUTOTUNE_MAX_SEQ_LEN", "M", "N"],
            kernels._BMM_INTERPRET,
            jagged.device,
        )
        k_blocks = max(K, 1)

        def grid(meta):
            return (cdiv(k_blocks, meta["BLOCK_M"]), cdiv(N, meta["BLOCK_N"]), batch)

        launchable(kernel)[grid](
            jagged,
            grad,
            d_dense,
            d_bias,
            seq_offsets,
            K,
            N,
            jagged.stride(0),
            grad.stride(0),
            d_dense.stride(0),
            d_dense.stride(1),
            d_bias.stride(0),
            autotune_max_seq_len(max_seq_len),
            HAS_BIAS=True,
            UPCAST=interpreting(),
            INPUT_PRECISION=input_precision(jagged.dtype),
        )
    return d_jagged, d_dense, d_bias


def _setup_bmm(ctx, inputs, output):  # type: ignore[no-untyped-def]
    max_seq_len, seq_offsets, jagged, dense, _ = inputs
    ctx.save_for_backward(seq_offsets, jagged, dense)
    ctx.max_seq_len = max_seq_len


def _bmm_backward(ctx, grad):  # type: ignore[no-untyped-def]
    seq_offsets, jagged, dense = ctx.saved_tensors
    d_jagged, d_dense, d_bias = jagged_dense_bmm_broadcast_add_bwd_op(
        ctx.max_seq_len, seq_offsets, jagged, dense, grad.contiguous()
    )
    return None, None, d_jagged, d_dense, d_bias


jagged_dense_bmm_broadcast_add_op.register_autograd(_bmm_backward, setup_context=_setup_bmm)


def jagged_dense_bmm_broadcast_add(
    max_seq_len: int,
    seq_offsets: torch.Tensor,
    jagged: torch.Tensor,
    dense: torch.Tensor,
    bias: torch.Tensor,
) -> torch.Tensor:
    """Triton backend of :func:`tzrec_ops.ops.jagged_2d.jagged_dense_bmm_broadcast_add`."""
    return jagged_dense_bmm_broadcast_add_op(
        max_seq_len, seq_offsets, _rows_contiguous(jagged), dense, _rows_contiguous(bias)
    )
