"""The Triton kernels of :mod:`.jagged_2d` (the concat/split copy and the jagged-dense bmm and
its weight-gradient product) and their autotune candidates; the module docstring there
states what each computes, and its launchers set the grids.
"""

from __future__ import annotations

from typing import List

import triton
import triton.language as tl


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
