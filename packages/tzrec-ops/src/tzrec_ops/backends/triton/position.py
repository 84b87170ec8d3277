"""Triton positional and timestamp embeddings for jagged sequences.

Legend: B = batch, L = total tokens, D = embedding dim, K = table rows; x is [L, D] and
``seq_offsets`` [B + 1]. ``high_b = length_b - T_b`` (``- 2 T_b`` with interleaved targets) is
the index of sequence b's first target.

``add_positional_embeddings``: ``out[p] = alpha * x[p] + P[min(p, high_b, K - 1)]``.
  Backward: each table row k gathers ``d_out`` of the tokens that read it. With
  ``h = min(high_b, K - 1)``, row ``k < h`` gets token k of every sequence and row h gets the sum
  of tokens ``h..length_b - 1``. One program per block of table rows walks the batch, so every
  token is read once and ``d_x = alpha * d_out`` is written on the way (no atomics).

``add_timestamp_positional_embeddings``: ``out = alpha * x + P[pos] + T[bucket]`` with the
  position counted back from the history end (contextual tokens p < C keep p) and
  ``bucket = int(clamp(f(max(qt - ts, 1e-6) / increments), 0, K_t - 1))``, f = sqrt or log, in
  float64 like the reference. The forward stores both indices; the backward sorts each index
  array, sums runs of equal keys inside a block of sorted tokens with a segmented scan, and
  adds each run's total to the fp32 table gradient with one atomic per run and block.

The kernels are in :mod:`._position_kernels`; this module holds their launchers, the
``torch.library`` ops with their autograd and the backend functions.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from tzrec_ops.backends.triton import _position_kernels as kernels
from tzrec_ops.backends.triton._eager import launchable, triton_library_op
from tzrec_ops.backends.triton._kernel_utils import tuned
from tzrec_ops.ops.utils import autotune_max_seq_len, cdiv, next_power_of_2


def _block_d(D: int) -> int:
    return min(128, next_power_of_2(max(D, 1)))


def _target_args(num_targets: Optional[torch.Tensor], interleave_targets: bool, like: torch.Tensor):
    return (
        num_targets if num_targets is not None else like,
        2 if interleave_targets else 1,
        num_targets is not None,
    )


@triton_library_op("tzrec_ops::add_positional_embeddings_triton")
def add_positional_embeddings_op(
    alpha: float,
    max_seq_len: int,
    position_embeddings_weight: torch.Tensor,
    seq_offsets: torch.Tensor,
    seq_lengths: torch.Tensor,
    seq_embeddings: torch.Tensor,
    num_targets: Optional[torch.Tensor],
    interleave_targets: bool,
) -> torch.Tensor:
    """x [L, D], table [K, D] -> [L, D]."""
    x = seq_embeddings
    out = torch.empty_like(x)
    L, D = x.shape
    batch = seq_lengths.shape[0]
    if L == 0 or D == 0 or batch == 0:
        return out
    targets, factor, has_targets = _target_args(num_targets, interleave_targets, seq_lengths)
    kernel = tuned(
        "add_position_fwd",
        kernels._add_position_fwd_kernel,
        kernels._configs,
        ["AUTOTUNE_MAX_SEQ_LEN", "D"],
        kernels._INTERPRET,
        x.device,
    )

    def grid(meta):
        return (cdiv(max_seq_len, meta["BLOCK_N"]), batch)

    launchable(kernel)[grid](
        x,
        position_embeddings_weight,
        out,
        seq_offsets,
        seq_lengths,
        targets,
        alpha,
        position_embeddings_weight.shape[0],
        D,
        x.stride(0),
        position_embeddings_weight.stride(0),
        out.stride(0),
        factor,
        autotune_max_seq_len(max_seq_len),
        HAS_TARGETS=has_targets,
        BLOCK_D=_block_d(D),
    )
    return out


@triton_library_op("tzrec_ops::add_positional_embeddings_bwd_triton")
def add_positional_embeddings_bwd_op(
    grad: torch.Tensor,
    alpha: float,
    position_embeddings_weight: torch.Tensor,
    seq_offsets: torch.Tensor,
    seq_lengths: torch.Tensor,
    num_targets: Optional[torch.Tensor],
    interleave_targets: bool,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(d_table [K, D], d_x [L, D]) from grad [L, D]."""
    K, D = position_embeddings_weight.shape
    d_table = torch.empty_like(position_embeddings_weight)
    d_x = torch.empty_like(grad)
    batch = seq_lengths.shape[0]
    if K == 0 or D == 0:
        return d_table, d_x
    targets, factor, has_targets = _target_args(num_targets, interleave_targets, seq_lengths)
    block_k = 16 if grad.device.type == "cpu" else 32
    block_d = _block_d(D)
    launchable(kernels._add_position_bwd_kernel)[(cdiv(K, block_k), cdiv(D, block_d))](
        grad,
        d_x,
        d_table,
        seq_offsets,
        seq_lengths,
        targets,
        alpha,
        batch,
        K,
        D,
        grad.stride(0),
        d_x.stride(0),
        d_table.stride(0),
        factor,
        HAS_TARGETS=has_targets,
        BLOCK_K=block_k,
        BLOCK_D=block_d,
    )
    return d_table, d_x


def _setup_position(ctx, inputs, output):  # type: ignore[no-untyped-def]
    alpha, _, table, seq_offsets, seq_lengths, _, num_targets, interleave = inputs
    ctx.save_for_backward(table, seq_offsets, seq_lengths, num_targets)
    ctx.alpha, ctx.interleave = alpha, interleave


def _position_backward(ctx, grad):  # type: ignore[no-untyped-def]
    table, seq_offsets, seq_lengths, num_targets = ctx.saved_tensors
    d_table, d_x = add_positional_embeddings_bwd_op(
        grad.contiguous(), ctx.alpha, table, seq_offsets, seq_lengths, num_targets, ctx.interleave
    )
    return None, None, d_table, None, None, d_x, None, None


add_positional_embeddings_op.register_autograd(_position_backward, setup_context=_setup_position)


# --------------------------------------------------------------------------------------------
# timestamp + position embeddings



@triton_library_op("tzrec_ops::add_timestamp_positional_embeddings_triton")
def add_timestamp_positional_embeddings_op(
    alpha: float,
    max_seq_len: int,
    max_contextual_seq_len: int,
    position_embeddings_weight: torch.Tensor,
    timestamp_embeddings_weight: torch.Tensor,
    seq_offsets: torch.Tensor,
    seq_lengths: torch.Tensor,
    seq_embeddings: torch.Tensor,
    timestamps: torch.Tensor,
    num_targets: Optional[torch.Tensor],
    interleave_targets: bool,
    time_bucket_fn: str,
    time_bucket_increments: float,
    query_time: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out [L, D], position index [L] int32, time bucket [L] int32)."""
    x = seq_embeddings
    L, D = x.shape
    out = torch.empty_like(x)
    pos_index = torch.empty(L, dtype=torch.int32, device=x.device)
    ts_index = torch.empty(L, dtype=torch.int32, device=x.device)
    batch = seq_lengths.shape[0]
    if L == 0 or batch == 0:
        return out, pos_index, ts_index
    targets, factor, has_targets = _target_args(num_targets, interleave_targets, seq_lengths)
    increments = torch.full((1,), time_bucket_increments, dtype=torch.float64, device=x.device)
    kernel = tuned(
        "add_timestamp_fwd",
        kernels._add_timestamp_fwd_kernel,
        kernels._configs,
        ["AUTOTUNE_MAX_SEQ_LEN", "D"],
        kernels._INTERPRET,
        x.device,
    )

    def grid(meta):
        return (cdiv(max_seq_len, meta["BLOCK_N"]), batch)

    launchable(kernel)[grid](
        x,
        position_embeddings_weight,
        timestamp_embeddings_weight,
        timestamps,
        query_time.reshape(-1) if query_time is not None else timestamps,
        increments,
        out,
        pos_index,
        ts_index,
        seq_offsets,
        seq_lengths,
        targets,
        alpha,
        position_embeddings_weight.shape[0],
        timestamp_embeddings_weight.shape[0] - 1,
        max_contextual_seq_len,
        D,
        x.stride(0),
        position_embeddings_weight.stride(0),
        timestamp_embeddings_weight.stride(0),
        out.stride(0),
        factor,
        autotune_max_seq_len(max_seq_len),
        HAS_TARGETS=has_targets,
        HAS_QUERY_TIME=query_time is not None,
        LOG_BUCKETS=time_bucket_fn == "log",
        BLOCK_D=max(_block_d(D), 16),
    )
    return out, pos_index, ts_index


def _scatter_sorted(
    grad: torch.Tensor,
    index: torch.Tensor,
    table: torch.Tensor,
    alpha: float,
    d_x: Optional[torch.Tensor],
) -> torch.Tensor:
    """fp32 ``d_table[index[p]] += grad[p]`` for every token p (and d_x = alpha * grad)."""
    L, D = grad.shape
    d_table = torch.zeros(table.shape, dtype=torch.float32, device=grad.device)
    if L == 0 or D == 0:
        return d_table
    keys, perm = torch.sort(index, stable=True)
    block_e = 16 if grad.device.type == "cpu" else 64
    block_d = _block_d(D)
    launchable(kernels._scatter_sorted_rows_kernel)[(cdiv(L, block_e), cdiv(D, block_d))](
        grad,
        keys,
        perm,
        d_table,
        d_x if d_x is not None else grad,
        alpha,
        L,
        D,
        grad.stride(0),
        d_table.stride(0),
        d_x.stride(0) if d_x is not None else 0,
        WRITE_DX=d_x is not None,
        BLOCK_E=block_e,
        BLOCK_D=block_d,
    )
    return d_table


@triton_library_op("tzrec_ops::add_timestamp_positional_embeddings_bwd_triton")
def add_timestamp_positional_embeddings_bwd_op(
    grad: torch.Tensor,
    alpha: float,
    pos_index: torch.Tensor,
    ts_index: torch.Tensor,
    position_embeddings_weight: torch.Tensor,
    timestamp_embeddings_weight: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d_position_table, d_timestamp_table, d_x) from grad [L, D]."""
    d_x = torch.empty_like(grad)
    d_pos = _scatter_sorted(grad, pos_index, position_embeddings_weight, alpha, d_x)
    d_ts = _scatter_sorted(grad, ts_index, timestamp_embeddings_weight, alpha, None)
    return (
        d_pos.to(position_embeddings_weight.dtype),
        d_ts.to(timestamp_embeddings_weight.dtype),
        d_x,
    )


def _setup_timestamp(ctx, inputs, output):  # type: ignore[no-untyped-def]
    alpha = inputs[0]
    _, pos_index, ts_index = output
    ctx.save_for_backward(pos_index, ts_index, inputs[3], inputs[4])
    ctx.alpha = alpha


def _timestamp_backward(ctx, grad, d_pos_index, d_ts_index):  # type: ignore[no-untyped-def]
    pos_index, ts_index, pos_table, ts_table = ctx.saved_tensors
    d_pos, d_ts, d_x = add_timestamp_positional_embeddings_bwd_op(
        grad.contiguous(), ctx.alpha, pos_index, ts_index, pos_table, ts_table
    )
    return (None, None, None, d_pos, d_ts, None, None, d_x) + (None,) * 6


add_timestamp_positional_embeddings_op.register_autograd(
    _timestamp_backward, setup_context=_setup_timestamp, grad_outputs=1
)


def add_positional_embeddings(
    alpha: float,
    max_seq_len: int,
    position_embeddings_weight: torch.Tensor,
    seq_offsets: torch.Tensor,
    seq_lengths: torch.Tensor,
    seq_embeddings: torch.Tensor,
    num_targets: Optional[torch.Tensor],
    interleave_targets: bool,
) -> torch.Tensor:
    """Triton backend of :func:`tzrec_ops.ops.position.add_positional_embeddings`."""
    return add_positional_embeddings_op(
        float(alpha),
        max_seq_len,
        _last_dim_contiguous(position_embeddings_weight),
        seq_offsets,
        seq_lengths,
        _last_dim_contiguous(seq_embeddings),
        num_targets,
        interleave_targets,
    )


def add_timestamp_positional_embeddings(
    alpha: float,
    max_seq_len: int,
    max_contextual_seq_len: int,
    position_embeddings_weight: torch.Tensor,
    timestamp_embeddings_weight: torch.Tensor,
    seq_offsets: torch.Tensor,
    seq_lengths: torch.Tensor,
    seq_embeddings: torch.Tensor,
    timestamps: torch.Tensor,
    num_targets: Optional[torch.Tensor],
    interleave_targets: bool,
    time_bucket_fn: str = "sqrt",
    time_bucket_increments: float = 60.0,
    query_time: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Triton backend of :func:`tzrec_ops.ops.position.add_timestamp_positional_embeddings`."""
    return add_timestamp_positional_embeddings_op(
        float(alpha),
        max_seq_len,
        max_contextual_seq_len,
        _last_dim_contiguous(position_embeddings_weight),
        _last_dim_contiguous(timestamp_embeddings_weight),
        seq_offsets,
        seq_lengths,
        _last_dim_contiguous(seq_embeddings),
        timestamps.contiguous(),
        num_targets,
        interleave_targets,
        time_bucket_fn,
        float(time_bucket_increments),
        query_time.contiguous() if query_time is not None else None,
    )[0]


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
