"""The Triton kernels of :mod:`.position` (positional and timestamp embeddings) and their
autotune candidates; the module docstring there states what each computes, and its launchers
set the grids.
"""

from __future__ import annotations

from typing import List

import triton
import triton.language as tl


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
