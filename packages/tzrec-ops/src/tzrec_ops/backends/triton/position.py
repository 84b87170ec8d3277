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

Why over 600 lines: the built-in backends mirror :mod:`tzrec_ops.ops` (an op lives in
``backends/triton/<its OpSpec.module>.py``, :func:`tzrec_ops.contract.mirrored_op_table`), so
this module holds every op of ``tzrec_ops.ops.position``: the positional and the timestamp
embedding kernels, each next to its launcher and autograd. It is only a few lines over, so
nothing is moved out as the norms' kernels were (``_norm_kernels``).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import triton
import triton.language as tl

from tzrec_ops.backends.triton._eager import launchable, triton_library_op
from tzrec_ops.backends.triton._kernel_utils import tuned
from tzrec_ops.ops.utils import autotune_max_seq_len, cdiv, next_power_of_2


def _configs() -> List[triton.Config]:
    return [
        triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s)
        for n in (16, 32, 64)
        for w, s in ((4, 2), (8, 3))
    ]


_INTERPRET = triton.Config({"BLOCK_N": 8}, num_warps=1)


@triton.jit
def _history_end(LENGTHS, NUM_TARGETS, b, target_factor, HAS_TARGETS: tl.constexpr):
    high = tl.load(LENGTHS + b).to(tl.int32)
    if HAS_TARGETS:
        high = high - target_factor * tl.load(NUM_TARGETS + b).to(tl.int32)
    return high


@triton.jit(do_not_specialize=["AUTOTUNE_MAX_SEQ_LEN"])
def _add_position_fwd_kernel(
    X,
    P,
    OUT,
    OFFSETS,
    LENGTHS,
    NUM_TARGETS,
    alpha,
    K,
    D,
    stride_x,
    stride_p,
    stride_o,
    target_factor,
    AUTOTUNE_MAX_SEQ_LEN,
    HAS_TARGETS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    b = tl.program_id(1)
    start = tl.load(OFFSETS + b).to(tl.int64)
    length = (tl.load(OFFSETS + b + 1) - start).to(tl.int32)
    if tl.program_id(0) * BLOCK_N >= length:
        return
    high = tl.minimum(_history_end(LENGTHS, NUM_TARGETS, b, target_factor, HAS_TARGETS), K - 1)
    t = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = t < length
    index = tl.minimum(t, high).to(tl.int64)
    rows = start + t
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        mask = rmask[:, None] & (cols[None, :] < D)
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        p = tl.load(P + index[:, None] * stride_p + cols[None, :], mask=mask, other=0.0)
        out = x.to(tl.float32) * alpha + p.to(tl.float32)
        tl.store(
            OUT + rows[:, None] * stride_o + cols[None, :], out.to(OUT.dtype.element_ty), mask=mask
        )


@triton.jit(do_not_specialize=["B"])
def _add_position_bwd_kernel(
    DOUT,
    DX,
    DP,
    OFFSETS,
    LENGTHS,
    NUM_TARGETS,
    alpha,
    B,
    K,
    D,
    stride_do,
    stride_dx,
    stride_dp,
    target_factor,
    HAS_TARGETS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    k0 = tl.program_id(0) * BLOCK_K
    ks = k0 + tl.arange(0, BLOCK_K)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols[None, :] < D
    acc = tl.zeros((BLOCK_K, BLOCK_D), dtype=tl.float32)
    for b in range(0, B):
        start = tl.load(OFFSETS + b).to(tl.int64)
        length = (tl.load(OFFSETS + b + 1) - start).to(tl.int32)
        high = tl.minimum(_history_end(LENGTHS, NUM_TARGETS, b, target_factor, HAS_TARGETS), K - 1)
        # tokens before the first target read their own row
        mask = ((ks < high) & (ks < length))[:, None] & cmask
        rows = start + ks
        g = tl.load(DOUT + rows[:, None] * stride_do + cols[None, :], mask=mask, other=0.0).to(
            tl.float32
        )
        acc += g
        tl.store(
            DX + rows[:, None] * stride_dx + cols[None, :],
            (g * alpha).to(DX.dtype.element_ty),
            mask=mask,
        )
        # tokens from the first target on all read row `high`
        if (high >= k0) & (high < k0 + BLOCK_K) & (high < length):
            tail = tl.zeros((BLOCK_D,), dtype=tl.float32)
            for p0 in range(high, length, BLOCK_K):
                ps = p0 + tl.arange(0, BLOCK_K)
                pmask = (ps < length)[:, None] & cmask
                prow = start + ps
                gt = tl.load(
                    DOUT + prow[:, None] * stride_do + cols[None, :], mask=pmask, other=0.0
                ).to(tl.float32)
                tail += tl.sum(gt, axis=0)
                tl.store(
                    DX + prow[:, None] * stride_dx + cols[None, :],
                    (gt * alpha).to(DX.dtype.element_ty),
                    mask=pmask,
                )
            acc += tl.where(ks[:, None] == high, tail[None, :], 0.0)
    tl.store(
        DP + ks[:, None].to(tl.int64) * stride_dp + cols[None, :],
        acc.to(DP.dtype.element_ty),
        mask=(ks[:, None] < K) & cmask,
    )


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
        _add_position_fwd_kernel,
        _configs,
        ["AUTOTUNE_MAX_SEQ_LEN", "D"],
        _INTERPRET,
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
    launchable(_add_position_bwd_kernel)[(cdiv(K, block_k), cdiv(D, block_d))](
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


@triton.jit(do_not_specialize=["AUTOTUNE_MAX_SEQ_LEN"])
def _add_timestamp_fwd_kernel(
    X,
    P,
    T,
    TS,
    QUERY_TIME,
    INCREMENTS,
    OUT,
    POS_INDEX,
    TS_INDEX,
    OFFSETS,
    LENGTHS,
    NUM_TARGETS,
    alpha,
    Kp,
    num_buckets,
    contextual,
    D,
    stride_x,
    stride_p,
    stride_t,
    stride_o,
    target_factor,
    AUTOTUNE_MAX_SEQ_LEN,
    HAS_TARGETS: tl.constexpr,
    HAS_QUERY_TIME: tl.constexpr,
    LOG_BUCKETS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    b = tl.program_id(1)
    start = tl.load(OFFSETS + b).to(tl.int64)
    length = (tl.load(OFFSETS + b + 1) - start).to(tl.int32)
    if tl.program_id(0) * BLOCK_N >= length:
        return
    high = _history_end(LENGTHS, NUM_TARGETS, b, target_factor, HAS_TARGETS)
    t = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = t < length
    rows = start + t
    from_end = high - tl.minimum(t, high) + contextual
    pos = tl.minimum(tl.where(t < contextual, t, from_end), Kp - 1)
    ts = tl.load(TS + rows, mask=rmask, other=0)
    if HAS_QUERY_TIME:
        qt = tl.load(QUERY_TIME + b)
    else:
        qt = tl.load(TS + start + length - 1)
    delta = tl.maximum((qt - ts).to(tl.float64), 1e-6) / tl.load(INCREMENTS)
    if LOG_BUCKETS:
        scaled = tl.log(delta)
    else:
        scaled = tl.sqrt(delta)
    # tl.cast, not .to: Inductor traces user kernels with constant ints as plain Python ints
    bucket = tl.minimum(tl.maximum(scaled, 0.0), tl.cast(num_buckets, tl.float64)).to(tl.int32)
    tl.store(POS_INDEX + rows, pos, mask=rmask)
    tl.store(TS_INDEX + rows, bucket, mask=rmask)
    pos64 = pos.to(tl.int64)
    bucket64 = bucket.to(tl.int64)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        mask = rmask[:, None] & (cols[None, :] < D)
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        p = tl.load(P + pos64[:, None] * stride_p + cols[None, :], mask=mask, other=0.0)
        te = tl.load(T + bucket64[:, None] * stride_t + cols[None, :], mask=mask, other=0.0)
        out = x.to(tl.float32) * alpha + p.to(tl.float32) + te.to(tl.float32)
        tl.store(
            OUT + rows[:, None] * stride_o + cols[None, :], out.to(OUT.dtype.element_ty), mask=mask
        )


@triton.jit
def _segmented_add(v1, k1, v2, k2):
    """Combine of a segmented sum over sorted keys: restart at each new key."""
    return tl.where(k1 == k2, v1 + v2, v2), k2


@triton.jit(do_not_specialize=["L"])
def _scatter_sorted_rows_kernel(
    GRAD,
    KEYS,
    PERM,
    D_TABLE,
    DX,
    alpha,
    L,
    D,
    stride_g,
    stride_t,
    stride_dx,
    WRITE_DX: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """``D_TABLE[KEYS[e]] += GRAD[PERM[e]]`` for sorted KEYS; one atomic add per run of equal
    keys inside this block of entries. With WRITE_DX also ``DX[PERM[e]] = alpha * GRAD``."""
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    emask = e < L
    cmask = cols[None, :] < D
    keys = tl.load(KEYS + e, mask=emask, other=-1)
    next_keys = tl.load(KEYS + e + 1, mask=e + 1 < L, other=-1)
    rows = tl.load(PERM + e, mask=emask, other=0).to(tl.int64)
    mask = emask[:, None] & cmask
    g = tl.load(GRAD + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(
        tl.float32
    )
    if WRITE_DX:
        tl.store(
            DX + rows[:, None] * stride_dx + cols[None, :],
            (g * alpha).to(DX.dtype.element_ty),
            mask=mask,
        )
    keys2 = tl.broadcast_to(keys[:, None], (BLOCK_E, BLOCK_D))
    sums, _ = tl.associative_scan((g, keys2), 0, _segmented_add)
    run_end = (keys != next_keys) | (tl.arange(0, BLOCK_E) == BLOCK_E - 1)
    tl.atomic_add(
        D_TABLE + keys[:, None].to(tl.int64) * stride_t + cols[None, :],
        sums,
        mask=(run_end & emask)[:, None] & cmask,
        sem="relaxed",
    )


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
        _add_timestamp_fwd_kernel,
        _configs,
        ["AUTOTUNE_MAX_SEQ_LEN", "D"],
        _INTERPRET,
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
    launchable(_scatter_sorted_rows_kernel)[(cdiv(L, block_e), cdiv(D, block_d))](
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
