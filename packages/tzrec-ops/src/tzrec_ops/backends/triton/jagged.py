"""Triton jagged ops: concat/split of two jagged sides and the per-sequence bmm.

Legend: B = batch, L = total rows, D = features; offsets ``[B + 1]`` int32/int64. A side
without offsets is dense: ``max_len`` rows per sequence.

* concat and split are one copy kernel run in either direction (the backward of each is the
  other): a ``(cdiv(max_len, BLOCK_N), B)`` grid, each program moves a block of one sequence's
  rows. Sequence b's combined rows start at ``offsets_left[b] + offsets_right[b]``.
* ``out_b = jagged_b @ dense_b + bias_b``: a tiled kernel over ``(N tiles, row tiles, B)``;
  ``d_jagged_b = d_out_b @ dense_b^T`` reuses it through strides; ``d_dense_b = jagged_b^T @
  d_out_b`` reduces over the sequence's rows while the same programs sum ``d_bias_b``.

Why over 600 lines: the built-in backends mirror :mod:`tzrec_ops.ops` (an op lives in
``backends/triton/<its OpSpec.module>.py``, :func:`tzrec_ops.contract.mirrored_op_table`), so
this module holds every op of ``tzrec_ops.ops.jagged``: the concat/split copy kernel and the
jagged-dense bmm kernels, each next to its launcher and autograd. It is only a few lines over,
so nothing is moved out as the norms' kernels were (``_norm_kernels``).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import triton
import triton.language as tl

from tzrec_ops.backends.triton._eager import launchable, triton_library_op
from tzrec_ops.backends.triton._kernel_utils import input_precision, interpreting, tuned
from tzrec_ops.ops.utils import autotune_max_seq_len, cdiv, next_power_of_2


def _copy_configs() -> List[triton.Config]:
    return [triton.Config({"BLOCK_N": n}, num_warps=w) for n, w in ((16, 4), (32, 4), (64, 8))]


_COPY_INTERPRET = triton.Config({"BLOCK_N": 8}, num_warps=1)


@triton.jit(do_not_specialize=["max_len_left", "max_len_right", "AUTOTUNE_MAX_SEQ_LEN"])
def _concat_split_kernel(
    LEFT,
    RIGHT,
    COMBINED,
    OFFSETS_LEFT,
    OFFSETS_RIGHT,
    max_len_left,
    max_len_right,
    D,
    stride_left,
    stride_right,
    stride_combined,
    AUTOTUNE_MAX_SEQ_LEN,
    DENSE_LEFT: tl.constexpr,
    DENSE_RIGHT: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    b = tl.program_id(1)
    # (first row, length) of sequence b on each side, loaded here rather than in a helper
    # (see the note on helpers in _kernel_utils)
    if DENSE_LEFT:
        start_l = b.to(tl.int64) * max_len_left
        len_l = max_len_left
    else:
        start_l = tl.load(OFFSETS_LEFT + b).to(tl.int64)
        len_l = (tl.load(OFFSETS_LEFT + b + 1) - start_l).to(tl.int32)
    if DENSE_RIGHT:
        start_r = b.to(tl.int64) * max_len_right
        len_r = max_len_right
    else:
        start_r = tl.load(OFFSETS_RIGHT + b).to(tl.int64)
        len_r = (tl.load(OFFSETS_RIGHT + b + 1) - start_r).to(tl.int32)
    t = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    if tl.program_id(0) * BLOCK_N >= len_l + len_r:
        return
    from_left = t < len_l
    from_right = (t >= len_l) & (t < len_l + len_r)
    row_c = start_l + start_r + t
    row_l = start_l + t
    row_r = start_r + t - len_l
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        cmask = cols[None, :] < D
        ml = from_left[:, None] & cmask
        mr = from_right[:, None] & cmask
        pl = LEFT + row_l[:, None] * stride_left + cols[None, :]
        pr = RIGHT + row_r[:, None] * stride_right + cols[None, :]
        pc = COMBINED + row_c[:, None] * stride_combined + cols[None, :]
        if SPLIT:
            v = tl.load(pc, mask=ml | mr)
            tl.store(pl, v, mask=ml)
            tl.store(pr, v, mask=mr)
        else:
            vl = tl.load(pl, mask=ml)
            vr = tl.load(pr, mask=mr)
            tl.store(pc, tl.where(ml, vl, vr), mask=ml | mr)


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
        _concat_split_kernel,
        _copy_configs,
        ["AUTOTUNE_MAX_SEQ_LEN", "D"],
        _COPY_INTERPRET,
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
    """Triton backend of :func:`tzrec_ops.ops.jagged.concat_2D_jagged`."""
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
    """Triton backend of :func:`tzrec_ops.ops.jagged.split_2D_jagged` (totals resolved)."""
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


def _bmm_configs() -> List[triton.Config]:
    shapes = [
        (64, 64, 32, 3, 4),
        (64, 128, 32, 3, 4),
        (128, 64, 32, 3, 4),
        (128, 128, 32, 3, 8),
        (64, 64, 64, 2, 4),
        (128, 128, 64, 2, 8),
    ]
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}, num_stages=s, num_warps=w)
        for m, n, k, s, w in shapes
    ]


_BMM_INTERPRET = triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}, num_warps=1)


@triton.jit(do_not_specialize=["AUTOTUNE_MAX_SEQ_LEN"])
def _jagged_dense_bmm_kernel(
    JAGGED,
    DENSE,
    BIAS,
    OUT,
    OFFSETS,
    N,
    K,
    stride_jm,
    stride_db,
    stride_dk,
    stride_dn,
    stride_bias_b,
    stride_om,
    AUTOTUNE_MAX_SEQ_LEN,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``OUT[rows of b] = JAGGED[rows of b] @ DENSE[b] (+ BIAS[b])``."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    b = tl.program_id(2)
    start = tl.load(OFFSETS + b).to(tl.int64)
    length = (tl.load(OFFSETS + b + 1) - start).to(tl.int32)
    if pid_m * BLOCK_M >= length:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < length
    mask_n = offs_n < N
    rows = start + offs_m
    a_ptrs = JAGGED + rows[:, None] * stride_jm + offs_k[None, :]
    b_ptrs = (
        DENSE
        + b.to(tl.int64) * stride_db
        + offs_k[:, None] * stride_dk
        + offs_n[None, :] * stride_dn
    )
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k + k0 < K
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_dk
    if HAS_BIAS:
        bias = tl.load(BIAS + b.to(tl.int64) * stride_bias_b + offs_n, mask=mask_n, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    tl.store(
        OUT + rows[:, None] * stride_om + offs_n[None, :],
        acc.to(OUT.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )


@triton.jit(do_not_specialize=["AUTOTUNE_MAX_SEQ_LEN"])
def _jagged_jagged_bmm_kernel(
    JAGGED,
    GRAD,
    D_DENSE,
    D_BIAS,
    OFFSETS,
    M,
    N,
    stride_jm,
    stride_gm,
    stride_ddb,
    stride_ddm,
    stride_dbb,
    AUTOTUNE_MAX_SEQ_LEN,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``D_DENSE[b] = JAGGED_b^T @ GRAD_b`` ([M, N], summed over b's rows) and, from the
    programs of the first M block, ``D_BIAS[b] = sum_rows GRAD_b``."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    b = tl.program_id(2)
    start = tl.load(OFFSETS + b).to(tl.int64)
    length = (tl.load(OFFSETS + b + 1) - start).to(tl.int32)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    at_ptrs = JAGGED + (start + offs_k[None, :]) * stride_jm + offs_m[:, None]
    g_ptrs = GRAD + (start + offs_k[:, None]) * stride_gm + offs_n[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    bias_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, length, BLOCK_K):
        mask_k = offs_k + k0 < length
        at = tl.load(at_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        g = tl.load(g_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if UPCAST:
            at = at.to(tl.float32)
            g = g.to(tl.float32)
        acc = tl.dot(at, g, acc, input_precision=INPUT_PRECISION)
        if HAS_BIAS:
            if pid_m == 0:
                bias_acc += tl.sum(g.to(tl.float32), axis=0)
        at_ptrs += BLOCK_K * stride_jm
        g_ptrs += BLOCK_K * stride_gm
    tl.store(
        D_DENSE + b.to(tl.int64) * stride_ddb + offs_m[:, None] * stride_ddm + offs_n[None, :],
        acc.to(D_DENSE.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )
    if HAS_BIAS:
        if pid_m == 0:
            tl.store(
                D_BIAS + b.to(tl.int64) * stride_dbb + offs_n,
                bias_acc.to(D_BIAS.dtype.element_ty),
                mask=mask_n,
            )


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
        _jagged_dense_bmm_kernel,
        _bmm_configs,
        ["AUTOTUNE_MAX_SEQ_LEN", "N", "K"],
        _BMM_INTERPRET,
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
            _jagged_jagged_bmm_kernel,
            _bmm_configs,
            ["AUTOTUNE_MAX_SEQ_LEN", "M", "N"],
            _BMM_INTERPRET,
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
    """Triton backend of :func:`tzrec_ops.ops.jagged.jagged_dense_bmm_broadcast_add`."""
    return jagged_dense_bmm_broadcast_add_op(
        max_seq_len, seq_offsets, _rows_contiguous(jagged), dense, _rows_contiguous(bias)
    )
