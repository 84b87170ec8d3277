# Over 600 lines on purpose: the three kernels inline the same @triton.jit mask/load helpers.
"""Triton kernels of jagged HSTU attention: forward (full and delta), backward dK/dV and dQ.

Maths (reference-spec §1.2), per sequence b of length n and head h, with S the scaling length:

    s_ij = alpha * <q_i, k_j>
    a_ij = silu(s_ij) * valid(i, j) / S              silu(x) = x * sigmoid(x)
    out_i = sum_j a_ij v_j

Backward, with sigma = sigmoid(s) and dO the output gradient:

    dV = a^T dO
    dA = dO V^T
    dS = valid * dA * sigma * (1 + s * (1 - sigma)) / S
    dQ = alpha * dS K            dK = alpha * dS^T Q

Mask. Raw positions p in [0, n); ``shift = C - 1`` when a contextual prefix of C > 0 tokens
exists, else 0. Position ids ``id(p) = max(p - shift, 0)`` (contextual tokens share id 0),
capped at the history end ``M = n - shift - T`` when targets are given (targets share id M).
With ``dist = id(i) - id(j)`` (``|dist|`` when not causal):

    valid = (i == j) | (dist > 0)
    valid &= dist <= w                       (window w = max_attn_len > 0)
    valid |= (id(i) == 0) & (id(j) < M)      (contextual prefix, C > 0)

Ids never decrease along the sequence, so "how many positions have an id below x" is a closed
form (:func:`_count_below`). The loop bounds use it to skip key blocks (forward, dQ) or query
blocks (dK/dV) that are entirely invalid, and to run blocks that are entirely valid without
computing the mask.

Scheduling: one program per (query block | key block, sequence * head). Programs of the
longest sequences come first when ``SORT_BY_LENGTH`` (``sort_idx`` maps program to sequence),
and within a sequence the query blocks run last-first, the costliest first under a causal
mask. Nothing N x N is stored; every accumulator is fp32 in registers. dQ has its own pass
(no atomics), so the backward is deterministic.

Loads use pointers, or per-sequence tensor descriptors (TMA) when ``ENABLE_TMA``: a
descriptor of shape ``[H, n, D]`` with the tensor's real strides, so views into a fused
buffer are read correctly and rows past the sequence end come back as zeros.

Split cached form (``SPLIT_KV``, delta forward only): sequence b is ``[cache_b ; new_b]``
with the c_b cached keys/values read in place from K/V (offsets ``seq_offsets``) and the D new
ones from DK/DV (rows ``b * D + j``), so nothing concatenates them in memory. Key positions
below c_b come from the cache, the others from the new rows; the masks are those of the full
sequence of length ``c_b + D``.

One file: the three kernels are built from the ``@triton.jit`` helpers above them (ids, mask,
key ranges, tile and descriptor loads, SiLU and its derivative), and the mask maths must be
the same in the forward and both backward passes; the helpers and the kernels that inline
them are read and changed together.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tanh_approx(x):
    """The hardware tanh (``tanh.approx.f32``: one special-function op, relative error
    ~2^-11; used for bf16 inputs only, whose tiles are rounded to 8 bits anyway)."""
    return tl.inline_asm_elementwise(
        "tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
    )


@triton.jit
def _silu_and_twice_grad(qk, alpha, FAST_SILU: tl.constexpr):
    """``(silu(s), 2 silu'(s))`` for ``s = alpha qk``, where ``silu'(s) = sig (1 + s (1 - sig))``;
    the forward uses the first, dQ the second, dK/dV both (the compiler drops the unused one).

    With ``FAST_SILU``, in ``h = s / 2`` and ``t = tanh(h)`` on the hardware tanh:
    ``silu = h (1 + t)``, one multiply, one tanh and one FMA per element, and
    ``2 silu' = (1 + t)(1 + h - h t)``, six ALU ops and the tanh for both, fewer than
    ``sig (1 + s - s sig)`` with an exact sigmoid. The backward passes carry ``2 silu'`` and
    halve dQ and dK once, in their final scale."""
    if FAST_SILU:
        h = qk * (alpha * 0.5)
        t = _tanh_approx(h)
        return h + h * t, (1.0 + t) * (1.0 + h - h * t)
    else:
        s = qk * alpha
        sig = tl.sigmoid(s)
        a = s * sig
        return a, 2.0 * sig * (1.0 + s - a)


@triton.jit
def _ids(pos, shift, hist, HAS_CONTEXTUAL: tl.constexpr, HAS_TARGETS: tl.constexpr):
    """Position ids of raw positions ``pos`` (contextual tokens share 0, targets share hist)."""
    ids = pos
    if HAS_CONTEXTUAL:
        ids = tl.maximum(pos - shift, 0)
    if HAS_TARGETS:
        ids = tl.minimum(ids, hist)
    return ids


@triton.jit
def _count_below(x, n, shift, hist, HAS_TARGETS: tl.constexpr):
    """How many positions of ``[0, n)`` have an id ``< x`` (ids are non-decreasing)."""
    cnt = tl.minimum(tl.maximum(x + shift, 0), n)
    cnt = tl.where(x <= 0, 0, cnt)
    if HAS_TARGETS:
        cnt = tl.where(x > hist, n, cnt)
    return cnt


@triton.jit
def _valid(
    rows,
    cols,
    n,
    shift,
    hist,
    max_attn_len,
    CAUSAL: tl.constexpr,
    HAS_CONTEXTUAL: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    HAS_MAX_ATTN_LEN: tl.constexpr,
):
    """The mask ``valid(i, j)`` for broadcastable positions ``rows`` (i) and ``cols`` (j)."""
    id_r = _ids(rows, shift, hist, HAS_CONTEXTUAL, HAS_TARGETS)
    id_c = _ids(cols, shift, hist, HAS_CONTEXTUAL, HAS_TARGETS)
    dist = id_r - id_c
    if not CAUSAL:
        dist = tl.abs(dist)
    valid = (rows == cols) | (dist > 0)
    if HAS_MAX_ATTN_LEN:
        valid = valid & (dist <= max_attn_len)
    if HAS_CONTEXTUAL:
        valid = valid | ((id_r == 0) & (id_c < hist))
    return valid & (rows < n) & (cols < n) & (rows >= 0)


@triton.jit
def _load_tile(
    base,
    desc,
    off_h,
    row0,
    nrows,
    stride_m,
    DIM: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CHECK_ROWS: tl.constexpr,
    ENABLE_TMA: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Rows ``[row0, row0 + BLOCK_ROWS)`` x ``[0, BLOCK_D)`` of one head, zero past the ends."""
    if ENABLE_TMA:
        tile = desc.load([off_h, row0, 0]).reshape(BLOCK_ROWS, BLOCK_D)
    else:
        rows = row0 + tl.arange(0, BLOCK_ROWS)
        offs_d = tl.arange(0, BLOCK_D)
        ptrs = base + rows[:, None] * stride_m + offs_d[None, :]
        if BLOCK_D != DIM:
            if CHECK_ROWS:
                mask = (rows[:, None] < nrows) & (offs_d[None, :] < DIM)
            else:
                mask = offs_d[None, :] < DIM
            tile = tl.load(ptrs, mask=mask, other=0.0)
        elif CHECK_ROWS:
            tile = tl.load(ptrs, mask=rows[:, None] < nrows, other=0.0)
        else:
            tile = tl.load(ptrs)
    if UPCAST:
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def _descriptor(base, nrows, H, stride_m, stride_h, DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                BLOCK_D: tl.constexpr, ENABLE_TMA: tl.constexpr):
    """A ``[H, nrows, DIM]`` tensor descriptor over ``base`` (``base`` itself, unused,
    without TMA: triton 3.6 cannot return None from a helper)."""
    if ENABLE_TMA:
        return tl.make_tensor_descriptor(
            base,
            shape=[H, nrows, DIM],
            strides=[stride_h, stride_m, 1],
            block_shape=[1, BLOCK_ROWS, BLOCK_D],
        )
    else:
        return base


@triton.jit
def _history(num_targets, off_z, n, contextual_seq_len, HAS_CONTEXTUAL: tl.constexpr,
             HAS_TARGETS: tl.constexpr):
    """(shift, M): the contextual id shift and the history-end id of sequence ``off_z``."""
    shift = 0
    if HAS_CONTEXTUAL:
        shift = contextual_seq_len - 1
    hist = n - shift
    if HAS_TARGETS:
        hist = hist - tl.load(num_targets + off_z).to(tl.int32)
    return shift, hist


@triton.jit
def _query_block_key_ranges(
    m0,
    n,
    shift,
    hist,
    max_attn_len,
    CAUSAL: tl.constexpr,
    HAS_CONTEXTUAL: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    HAS_MAX_ATTN_LEN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Key ranges for query rows ``[m0, m0 + BLOCK_M)``: full blocks ``[lo, full_end)``
    (every pair valid), masked blocks ``[full_end, main_end)``, then the diagonal blocks
    ``[diag_start, diag_end)`` of target rows (masked). Keys outside are never valid."""
    c0 = _ids(m0, shift, hist, HAS_CONTEXTUAL, HAS_TARGETS)
    lo = 0
    if HAS_MAX_ATTN_LEN:
        lo = _count_below(c0 - max_attn_len, n, shift, hist, HAS_TARGETS)
        lo = (lo // BLOCK_N) * BLOCK_N
    if CAUSAL:
        hi = tl.minimum(m0 + BLOCK_M, n)
        if HAS_CONTEXTUAL:
            hi = tl.where(c0 == 0, n, hi)
        main_end = hi
        diag_start = hi
        diag_end = hi
        if HAS_TARGETS:
            main_end = tl.minimum(hi, _count_below(hist, n, shift, hist, HAS_TARGETS))
            main_end = tl.maximum(main_end, lo)
            main_blocks_end = lo + tl.cdiv(main_end - lo, BLOCK_N) * BLOCK_N
            diag_start = tl.maximum(main_blocks_end, (tl.maximum(m0, 0) // BLOCK_N) * BLOCK_N)
            diag_end = tl.minimum(m0 + BLOCK_M, n)
        full_end = lo
        if not HAS_MAX_ATTN_LEN:
            full_end = _count_below(c0, n, shift, hist, HAS_TARGETS)
            full_end = (tl.minimum(full_end, main_end) // BLOCK_N) * BLOCK_N
    else:
        full_end = lo
        main_end = n
        diag_start = n
        diag_end = n
    return lo, full_end, main_end, diag_start, diag_end


@triton.jit
def _fwd_block(
    acc,
    q,
    K_base,
    V_base,
    k_desc,
    v_desc,
    off_h,
    start_n,
    row_shift,
    load_rows,
    rows,
    n,
    shift,
    hist,
    max_attn_len,
    stride_km,
    stride_vm,
    alpha,
    MASKED: tl.constexpr,
    CHECK_ROWS: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_CONTEXTUAL: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    HAS_MAX_ATTN_LEN: tl.constexpr,
    DIM_Q: tl.constexpr,
    DIM_V: tl.constexpr,
    BLOCK_D_Q: tl.constexpr,
    BLOCK_D_V: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    ENABLE_TMA: tl.constexpr,
    UPCAST: tl.constexpr,
    FAST_SILU: tl.constexpr,
):
    """Keys at positions ``[start_n, start_n + BLOCK_N)``, read from rows ``position -
    row_shift`` of K_base/V_base; with ``CHECK_ROWS`` rows ``>= load_rows`` read as zeros."""
    k = _load_tile(K_base, k_desc, off_h, start_n - row_shift, load_rows, stride_km, DIM_Q,
                   BLOCK_N, BLOCK_D_Q, CHECK_ROWS, ENABLE_TMA, UPCAST)
    v = _load_tile(V_base, v_desc, off_h, start_n - row_shift, load_rows, stride_vm, DIM_V,
                   BLOCK_N, BLOCK_D_V, CHECK_ROWS, ENABLE_TMA, UPCAST)
    p = _fwd_weights(tl.dot(q, tl.trans(k), input_precision=PRECISION), rows, start_n, n,
                     shift, hist, max_attn_len, alpha, MASKED, CAUSAL, HAS_CONTEXTUAL,
                     HAS_TARGETS, HAS_MAX_ATTN_LEN, BLOCK_N, FAST_SILU)
    return tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)


@triton.jit
def _fwd_weights(
    qk,
    rows,
    start_n,
    n,
    shift,
    hist,
    max_attn_len,
    alpha,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_CONTEXTUAL: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    HAS_MAX_ATTN_LEN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FAST_SILU: tl.constexpr,
):
    """``silu(alpha qk)`` of query rows ``rows`` against keys ``[start_n, start_n + BLOCK_N)``,
    zero where the mask is off (``MASKED`` blocks only)."""
    p, _ = _silu_and_twice_grad(qk, alpha, FAST_SILU)
    if MASKED:
        cols = start_n + tl.arange(0, BLOCK_N)
        valid = _valid(rows[:, None], cols[None, :], n, shift, hist, max_attn_len, CAUSAL,
                       HAS_CONTEXTUAL, HAS_TARGETS, HAS_MAX_ATTN_LEN)
        p = tl.where(valid, p, 0.0)
    return p


@triton.jit
def _fwd_block_halves(
    acc_a,
    acc_b,
    q_a,
    q_b,
    K_base,
    V_base,
    k_desc,
    v_desc,
    off_h,
    start_n,
    rows_a,
    rows_b,
    n,
    shift,
    hist,
    max_attn_len,
    stride_km,
    stride_vm,
    alpha,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_CONTEXTUAL: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    HAS_MAX_ATTN_LEN: tl.constexpr,
    DIM_Q: tl.constexpr,
    DIM_V: tl.constexpr,
    BLOCK_D_Q: tl.constexpr,
    BLOCK_D_V: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    ENABLE_TMA: tl.constexpr,
    UPCAST: tl.constexpr,
    FAST_SILU: tl.constexpr,
):
    """:func:`_fwd_block` for a query tile held as two row halves ``a`` and ``b``, in the
    order both ``q k^T``, then ``a``'s SiLU and value product, then ``b``'s. Triton waits for
    each ``q k^T`` product right after issuing it but leaves the value products in flight, so
    ``b``'s SiLU runs while ``a``'s value product is on the tensor cores. Keys past ``n`` read
    as zeros in ``MASKED`` blocks only (unmasked blocks lie inside the sequence)."""
    k = _load_tile(K_base, k_desc, off_h, start_n, n, stride_km, DIM_Q, BLOCK_N, BLOCK_D_Q,
                   MASKED, ENABLE_TMA, UPCAST)
    v = _load_tile(V_base, v_desc, off_h, start_n, n, stride_vm, DIM_V, BLOCK_N, BLOCK_D_V,
                   MASKED, ENABLE_TMA, UPCAST)
    k_t = tl.trans(k)
    qk_a = tl.dot(q_a, k_t, input_precision=PRECISION)
    qk_b = tl.dot(q_b, k_t, input_precision=PRECISION)
    p_a = _fwd_weights(qk_a, rows_a, start_n, n, shift, hist, max_attn_len, alpha, MASKED,
                       CAUSAL, HAS_CONTEXTUAL, HAS_TARGETS, HAS_MAX_ATTN_LEN, BLOCK_N, FAST_SILU)
    acc_a = tl.dot(p_a.to(v.dtype), v, acc_a, input_precision=PRECISION)
    p_b = _fwd_weights(qk_b, rows_b, start_n, n, shift, hist, max_attn_len, alpha, MASKED,
                       CAUSAL, HAS_CONTEXTUAL, HAS_TARGETS, HAS_MAX_ATTN_LEN, BLOCK_N, FAST_SILU)
    acc_b = tl.dot(p_b.to(v.dtype), v, acc_b, input_precision=PRECISION)
    return acc_a, acc_b


@triton.jit
def _stack_rows(a, b):
    """``[a; b]``: two ``[R, C]`` tiles as one ``[2R, C]`` tile."""
    return tl.join(a, b).permute(2, 0, 1).reshape(2 * a.shape[0], a.shape[1])


@triton.jit(do_not_specialize=["AUTOTUNE_Z", "AUTOTUNE_MAX_SEQ_LEN"])
def _hstu_attn_fwd_kernel(
    Q,
    K,
    V,
    DK,
    DV,
    Out,
    seq_offsets,
    num_targets,
    sort_idx,
    stride_qm,
    stride_qh,
    stride_km,
    stride_kh,
    stride_vm,
    stride_vh,
    stride_dkm,
    stride_dkh,
    stride_dvm,
    stride_dvh,
    stride_om,
    stride_oh,
    alpha,
    inv_scale,
    max_attn_len,
    contextual_seq_len,
    H,
    delta_size,
    AUTOTUNE_Z,
    AUTOTUNE_MAX_SEQ_LEN,
    DIM_Q: tl.constexpr,
    DIM_V: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    HAS_CONTEXTUAL: tl.constexpr,
    HAS_MAX_ATTN_LEN: tl.constexpr,
    SORT_BY_LENGTH: tl.constexpr,
    IS_DELTA: tl.constexpr,
    SPLIT_KV: tl.constexpr,
    PRECISION: tl.constexpr,
    ENABLE_TMA: tl.constexpr,
    UPCAST: tl.constexpr,
    FAST_SILU: tl.constexpr,
    BLOCK_D_Q: tl.constexpr,
    BLOCK_D_V: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    Q_SPLITS: tl.constexpr = 1,
):
    """Forward: one program per (query block, sequence * head); out ``[L, H, V]``
    (``[B * delta_size, H, V]`` when ``IS_DELTA``, queries being each sequence's last rows).

    ``Q_SPLITS = 2`` runs the query block as two row halves (:func:`_fwd_block_halves`);
    the split form stacks them back into one block.

    ``SPLIT_KV`` (with ``IS_DELTA``): seq_offsets describe the cached prefixes in K/V and the
    ``delta_size`` new keys/values of sequence z are rows ``z * delta_size + j`` of DK/DV
    (unused, any input tensor, otherwise)."""
    # Inductor passes Python floats as fp64; the maths here is fp32.
    alpha = tl.cast(alpha, tl.float32)
    inv_scale = tl.cast(inv_scale, tl.float32)
    # (inlined rather than a helper: torch.compile's mutation analysis of user kernels marks
    # every pointer passed to a helper whose results address a store as written)
    off_z = tl.program_id(1) // H
    off_h = tl.program_id(1) % H
    if SORT_BY_LENGTH:
        off_z = tl.load(sort_idx + off_z).to(tl.int32)
    start = tl.load(seq_offsets + off_z).to(tl.int64)
    n = (tl.load(seq_offsets + off_z + 1) - start).to(tl.int32)
    # cached keys of the split form; n becomes the full length, which every mask uses
    n_cache = n
    if SPLIT_KV:
        n = n + delta_size
    r0 = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    if IS_DELTA:
        q_start = off_z.to(tl.int64) * delta_size
        q_rows = delta_size
        m0 = n - delta_size + r0
    else:
        q_start = start
        q_rows = n
        m0 = r0
    if r0 < q_rows:
        shift, hist = _history(num_targets, off_z, n, contextual_seq_len, HAS_CONTEXTUAL,
                               HAS_TARGETS)
        Q_base = Q + q_start * stride_qm + off_h * stride_qh
        K_base = K + start * stride_km + off_h * stride_kh
        V_base = V + start * stride_vm + off_h * stride_vh
        QUERY_ROWS: tl.constexpr = BLOCK_M // Q_SPLITS
        q_desc = _descriptor(Q + q_start * stride_qm, q_rows, H, stride_qm, stride_qh, DIM_Q,
                             QUERY_ROWS, BLOCK_D_Q, ENABLE_TMA)
        k_desc = _descriptor(K + start * stride_km, n, H, stride_km, stride_kh, DIM_Q, BLOCK_N,
                             BLOCK_D_Q, ENABLE_TMA)
        v_desc = _descriptor(V + start * stride_vm, n, H, stride_vm, stride_vh, DIM_V, BLOCK_N,
                             BLOCK_D_V, ENABLE_TMA)
        q = _load_tile(Q_base, q_desc, off_h, r0, q_rows, stride_qm, DIM_Q, QUERY_ROWS,
                       BLOCK_D_Q, True, ENABLE_TMA, UPCAST)
        if Q_SPLITS == 2:
            q_b = _load_tile(Q_base, q_desc, off_h, r0 + QUERY_ROWS, q_rows, stride_qm, DIM_Q,
                             QUERY_ROWS, BLOCK_D_Q, True, ENABLE_TMA, UPCAST)
        rows = m0 + tl.arange(0, BLOCK_M)
        lo, full_end, main_end, diag_start, diag_end = _query_block_key_ranges(m0, n, shift, hist,
            max_attn_len, CAUSAL, HAS_CONTEXTUAL, HAS_TARGETS, HAS_MAX_ATTN_LEN, BLOCK_M, BLOCK_N)
        if SPLIT_KV:
            if Q_SPLITS == 2:
                q = _stack_rows(q, q_b)
            acc = tl.zeros([BLOCK_M, BLOCK_D_V], dtype=tl.float32)
            # The same key ranges, cut at n_cache: cached keys are read in place (rows past
            # n_cache load as zeros, so s = 0 and silu(0) = 0 adds nothing), then the new keys
            # [n_cache, n) come from DK/DV, always masked (they hold the diagonal).
            cache_end = tl.minimum(full_end, n_cache)
            for start_n in range(lo, cache_end, BLOCK_N):
                acc = _fwd_block(acc, q, K_base, V_base, k_desc, v_desc, off_h, start_n, 0,
                                 n_cache, rows, n, shift, hist, max_attn_len, stride_km,
                                 stride_vm, alpha, False, True, CAUSAL, HAS_CONTEXTUAL,
                                 HAS_TARGETS, HAS_MAX_ATTN_LEN, DIM_Q, DIM_V, BLOCK_D_Q,
                                 BLOCK_D_V, BLOCK_N, PRECISION, ENABLE_TMA, UPCAST, FAST_SILU)
            for start_n in range(full_end, tl.minimum(main_end, n_cache), BLOCK_N):
                acc = _fwd_block(acc, q, K_base, V_base, k_desc, v_desc, off_h, start_n, 0,
                                 n_cache, rows, n, shift, hist, max_attn_len, stride_km,
                                 stride_vm, alpha, True, True, CAUSAL, HAS_CONTEXTUAL,
                                 HAS_TARGETS, HAS_MAX_ATTN_LEN, DIM_Q, DIM_V, BLOCK_D_Q,
                                 BLOCK_D_V, BLOCK_N, PRECISION, ENABLE_TMA, UPCAST, FAST_SILU)
            key_end = main_end
            if HAS_TARGETS:
                for start_n in range(diag_start, tl.minimum(diag_end, n_cache), BLOCK_N):
                    acc = _fwd_block(acc, q, K_base, V_base, k_desc, v_desc, off_h, start_n, 0,
                                     n_cache, rows, n, shift, hist, max_attn_len, stride_km,
                                     stride_vm, alpha, True, True, CAUSAL, HAS_CONTEXTUAL,
                                     HAS_TARGETS, HAS_MAX_ATTN_LEN, DIM_Q, DIM_V, BLOCK_D_Q,
                                     BLOCK_D_V, BLOCK_N, PRECISION, ENABLE_TMA, UPCAST,
                                     FAST_SILU)
                key_end = tl.maximum(main_end, diag_end)
            DK_base = DK + q_start * stride_dkm + off_h * stride_dkh
            DV_base = DV + q_start * stride_dvm + off_h * stride_dvh
            for start_n in range(tl.maximum(lo, n_cache), key_end, BLOCK_N):
                acc = _fwd_block(acc, q, DK_base, DV_base, k_desc, v_desc, off_h, start_n,
                                 n_cache, delta_size, rows, n, shift, hist, max_attn_len,
                                 stride_dkm, stride_dvm, alpha, True, True, CAUSAL,
                                 HAS_CONTEXTUAL, HAS_TARGETS, HAS_MAX_ATTN_LEN, DIM_Q, DIM_V,
                                 BLOCK_D_Q, BLOCK_D_V, BLOCK_N, PRECISION, ENABLE_TMA, UPCAST,
                                 FAST_SILU)
        elif Q_SPLITS == 2:
            rows_a = m0 + tl.arange(0, QUERY_ROWS)
            rows_b = rows_a + QUERY_ROWS
            acc_a = tl.zeros([QUERY_ROWS, BLOCK_D_V], dtype=tl.float32)
            acc_b = tl.zeros([QUERY_ROWS, BLOCK_D_V], dtype=tl.float32)
            for start_n in range(lo, full_end, BLOCK_N):
                acc_a, acc_b = _fwd_block_halves(acc_a, acc_b, q, q_b, K_base, V_base, k_desc,
                    v_desc, off_h, start_n, rows_a, rows_b, n, shift, hist, max_attn_len,
                    stride_km, stride_vm, alpha, False, CAUSAL, HAS_CONTEXTUAL, HAS_TARGETS,
                    HAS_MAX_ATTN_LEN, DIM_Q, DIM_V, BLOCK_D_Q, BLOCK_D_V, BLOCK_N, PRECISION,
                    ENABLE_TMA, UPCAST, FAST_SILU)
            for start_n in range(full_end, main_end, BLOCK_N):
                acc_a, acc_b = _fwd_block_halves(acc_a, acc_b, q, q_b, K_base, V_base, k_desc,
                    v_desc, off_h, start_n, rows_a, rows_b, n, shift, hist, max_attn_len,
                    stride_km, stride_vm, alpha, True, CAUSAL, HAS_CONTEXTUAL, HAS_TARGETS,
                    HAS_MAX_ATTN_LEN, DIM_Q, DIM_V, BLOCK_D_Q, BLOCK_D_V, BLOCK_N, PRECISION,
                    ENABLE_TMA, UPCAST, FAST_SILU)
            if HAS_TARGETS:
                for start_n in range(diag_start, diag_end, BLOCK_N):
                    acc_a, acc_b = _fwd_block_halves(acc_a, acc_b, q, q_b, K_base, V_base,
                        k_desc, v_desc, off_h, start_n, rows_a, rows_b, n, shift, hist,
                        max_attn_len, stride_km, stride_vm, alpha, True, CAUSAL, HAS_CONTEXTUAL,
                        HAS_TARGETS, HAS_MAX_ATTN_LEN, DIM_Q, DIM_V, BLOCK_D_Q, BLOCK_D_V,
                        BLOCK_N, PRECISION, ENABLE_TMA, UPCAST, FAST_SILU)
            acc = _stack_rows(acc_a, acc_b)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_D_V], dtype=tl.float32)
            for start_n in range(lo, full_end, BLOCK_N):
                acc = _fwd_block(acc, q, K_base, V_base, k_desc, v_desc, off_h, start_n, 0, n,
                                 rows, n, shift, hist, max_attn_len, stride_km, stride_vm, alpha,
                                 False, False, CAUSAL, HAS_CONTEXTUAL, HAS_TARGETS,
                                 HAS_MAX_ATTN_LEN, DIM_Q, DIM_V, BLOCK_D_Q, BLOCK_D_V, BLOCK_N,
                                 PRECISION, ENABLE_TMA, UPCAST, FAST_SILU)
            for start_n in range(full_end, main_end, BLOCK_N):
                acc = _fwd_block(acc, q, K_base, V_base, k_desc, v_desc, off_h, start_n, 0, n,
                                 rows, n, shift, hist, max_attn_len, stride_km, stride_vm, alpha,
                                 True, True, CAUSAL, HAS_CONTEXTUAL, HAS_TARGETS,
                                 HAS_MAX_ATTN_LEN, DIM_Q, DIM_V, BLOCK_D_Q, BLOCK_D_V, BLOCK_N,
                                 PRECISION, ENABLE_TMA, UPCAST, FAST_SILU)
            if HAS_TARGETS:
                for start_n in range(diag_start, diag_end, BLOCK_N):
                    acc = _fwd_block(acc, q, K_base, V_base, k_desc, v_desc, off_h, start_n, 0,
                                     n, rows, n, shift, hist, max_attn_len, stride_km, stride_vm,
                                     alpha, True, True, CAUSAL, HAS_CONTEXTUAL, HAS_TARGETS,
                                     HAS_MAX_ATTN_LEN, DIM_Q, DIM_V, BLOCK_D_Q, BLOCK_D_V,
                                     BLOCK_N, PRECISION, ENABLE_TMA, UPCAST, FAST_SILU)
        O_base = Out + q_start * stride_om + off_h * stride_oh
        # stores stay in the kernel body (not a helper) so torch.compile's mutation
        # analysis of user kernels sees them on every torch version
        o_rows = r0 + tl.arange(0, BLOCK_M)
        o_cols = tl.arange(0, BLOCK_D_V)
        o_mask = o_rows[:, None] < q_rows
        if BLOCK_D_V != DIM_V:
            o_mask = o_mask & (o_cols[None, :] < DIM_V)
        tl.store(O_base + o_rows[:, None] * stride_om + o_cols[None, :],
                 (acc * inv_scale).to(O_base.dtype.element_ty), mask=o_mask)


@triton.jit
def _dq_block(
    dq,
    q,
    do,
    K_base,
    V_base,
    k_desc,
    v_desc,
    off_h,
    start_n,
    rows,
    n,
    shift,
    hist,
    max_attn_len,
    stride_km,
    stride_vm,
    alpha,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_CONTEXTUAL: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    HAS_MAX_ATTN_LEN: tl.constexpr,
    DIM_Q: tl.constexpr,
    DIM_V: tl.constexpr,
    BLOCK_D_Q: tl.constexpr,
    BLOCK_D_V: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    ENABLE_TMA: tl.constexpr,
    UPCAST: tl.constexpr,
    FAST_SILU: tl.constexpr,
):
    k = _load_tile(K_base, k_desc, off_h, start_n, n, stride_km, DIM_Q, BLOCK_N, BLOCK_D_Q, MASKED,
                   ENABLE_TMA, UPCAST)
    v = _load_tile(V_base, v_desc, off_h, start_n, n, stride_vm, DIM_V, BLOCK_N, BLOCK_D_V, MASKED,
                   ENABLE_TMA, UPCAST)
    _, g2 = _silu_and_twice_grad(tl.dot(q, tl.trans(k), input_precision=PRECISION), alpha,
                                 FAST_SILU)
    da = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    ds = da * g2
    if MASKED:
        cols = start_n + tl.arange(0, BLOCK_N)
        valid = _valid(rows[:, None], cols[None, :], n, shift, hist, max_attn_len, CAUSAL,
                       HAS_CONTEXTUAL, HAS_TARGETS, HAS_MAX_ATTN_LEN)
        ds = tl.where(valid, ds, 0.0)
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)


@triton.jit(do_not_specialize=["AUTOTUNE_Z", "AUTOTUNE_MAX_SEQ_LEN"])
def _hstu_attn_bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    DQ,
    seq_offsets,
    num_targets,
    sort_idx,
    stride_qm,
    stride_qh,
    stride_km,
    stride_kh,
    stride_vm,
    stride_vh,
    stride_dom,
    stride_doh,
    stride_dqm,
    stride_dqh,
    alpha,
    inv_scale,
    max_attn_len,
    contextual_seq_len,
    H,
    AUTOTUNE_Z,
    AUTOTUNE_MAX_SEQ_LEN,
    DIM_Q: tl.constexpr,
    DIM_V: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    HAS_CONTEXTUAL: tl.constexpr,
    HAS_MAX_ATTN_LEN: tl.constexpr,
    SORT_BY_LENGTH: tl.constexpr,
    PRECISION: tl.constexpr,
    ENABLE_TMA: tl.constexpr,
    UPCAST: tl.constexpr,
    FAST_SILU: tl.constexpr,
    BLOCK_D_Q: tl.constexpr,
    BLOCK_D_V: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """dQ: one program per (query block, sequence * head), accumulating in fp32 registers."""
    # Inductor passes Python floats as fp64; the maths here is fp32.
    alpha = tl.cast(alpha, tl.float32)
    inv_scale = tl.cast(inv_scale, tl.float32)
    # (inlined rather than a helper: torch.compile's mutation analysis of user kernels marks
    # every pointer passed to a helper whose results address a store as written)
    off_z = tl.program_id(1) // H
    off_h = tl.program_id(1) % H
    if SORT_BY_LENGTH:
        off_z = tl.load(sort_idx + off_z).to(tl.int32)
    start = tl.load(seq_offsets + off_z).to(tl.int64)
    n = (tl.load(seq_offsets + off_z + 1) - start).to(tl.int32)
    m0 = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    if m0 < n:
        shift, hist = _history(num_targets, off_z, n, contextual_seq_len, HAS_CONTEXTUAL,
                               HAS_TARGETS)
        Q_base = Q + start * stride_qm + off_h * stride_qh
        DO_base = DO + start * stride_dom + off_h * stride_doh
        K_base = K + start * stride_km + off_h * stride_kh
        V_base = V + start * stride_vm + off_h * stride_vh
        q_desc = _descriptor(Q + start * stride_qm, n, H, stride_qm, stride_qh, DIM_Q, BLOCK_M,
                             BLOCK_D_Q, ENABLE_TMA)
        do_desc = _descriptor(DO + start * stride_dom, n, H, stride_dom, stride_doh, DIM_V, BLOCK_M,
                              BLOCK_D_V, ENABLE_TMA)
        k_desc = _descriptor(K + start * stride_km, n, H, stride_km, stride_kh, DIM_Q, BLOCK_N,
                             BLOCK_D_Q, ENABLE_TMA)
        v_desc = _descriptor(V + start * stride_vm, n, H, stride_vm, stride_vh, DIM_V, BLOCK_N,
                             BLOCK_D_V, ENABLE_TMA)
        q = _load_tile(Q_base, q_desc, off_h, m0, n, stride_qm, DIM_Q, BLOCK_M, BLOCK_D_Q, True,
                       ENABLE_TMA, UPCAST)
        do = _load_tile(DO_base, do_desc, off_h, m0, n, stride_dom, DIM_V, BLOCK_M, BLOCK_D_V, True,
                        ENABLE_TMA, UPCAST)
        rows = m0 + tl.arange(0, BLOCK_M)
        lo, full_end, main_end, diag_start, diag_end = _query_block_key_ranges(m0, n, shift, hist,
            max_attn_len, CAUSAL, HAS_CONTEXTUAL, HAS_TARGETS, HAS_MAX_ATTN_LEN, BLOCK_M, BLOCK_N)
        dq = tl.zeros([BLOCK_M, BLOCK_D_Q], dtype=tl.float32)
        for start_n in range(lo, full_end, BLOCK_N):
            dq = _dq_block(dq, q, do, K_base, V_base, k_desc, v_desc, off_h, start_n, rows, n,
                           shift, hist, max_attn_len, stride_km, stride_vm, alpha, False, CAUSAL,
                           HAS_CONTEXTUAL, HAS_TARGETS, HAS_MAX_ATTN_LEN, DIM_Q, DIM_V, BLOCK_D_Q,
                           BLOCK_D_V, BLOCK_N, PRECISION, ENABLE_TMA, UPCAST, FAST_SILU)
        for start_n in range(full_end, main_end, BLOCK_N):
            dq = _dq_block(dq, q, do, K_base, V_base, k_desc, v_desc, off_h, start_n, rows, n,
                           shift, hist, max_attn_len, stride_km, stride_vm, alpha, True, CAUSAL,
                           HAS_CONTEXTUAL, HAS_TARGETS, HAS_MAX_ATTN_LEN, DIM_Q, DIM_V, BLOCK_D_Q,
                           BLOCK_D_V, BLOCK_N, PRECISION, ENABLE_TMA, UPCAST, FAST_SILU)
        if HAS_TARGETS:
            for start_n in range(diag_start, diag_end, BLOCK_N):
                dq = _dq_block(dq, q, do, K_base, V_base, k_desc, v_desc, off_h, start_n, rows, n,
                               shift, hist, max_attn_len, stride_km, stride_vm, alpha, True, CAUSAL,
                               HAS_CONTEXTUAL, HAS_TARGETS, HAS_MAX_ATTN_LEN, DIM_Q, DIM_V,
                               BLOCK_D_Q, BLOCK_D_V, BLOCK_N, PRECISION, ENABLE_TMA, UPCAST,
                               FAST_SILU)
        DQ_base = DQ + start * stride_dqm + off_h * stride_dqh
        dq_rows = m0 + tl.arange(0, BLOCK_M)
        dq_cols = tl.arange(0, BLOCK_D_Q)
        dq_mask = dq_rows[:, None] < n
        if BLOCK_D_Q != DIM_Q:
            dq_mask = dq_mask & (dq_cols[None, :] < DIM_Q)
        tl.store(DQ_base + dq_rows[:, None] * stride_dqm + dq_cols[None, :],
                 (dq * (0.5 * alpha * inv_scale)).to(DQ_base.dtype.element_ty), mask=dq_mask)


@triton.jit
def _dkdv_block(
    dk,
    dv,
    k,
    v,
    Q_base,
    DO_base,
    q_desc,
    do_desc,
    off_h,
    start_m,
    cols,
    n,
    shift,
    hist,
    max_attn_len,
    stride_qm,
    stride_dom,
    alpha,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_CONTEXTUAL: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    HAS_MAX_ATTN_LEN: tl.constexpr,
    DIM_Q: tl.constexpr,
    DIM_V: tl.constexpr,
    BLOCK_D_Q: tl.constexpr,
    BLOCK_D_V: tl.constexpr,
    BLOCK_M: tl.constexpr,
    PRECISION: tl.constexpr,
    ENABLE_TMA: tl.constexpr,
    UPCAST: tl.constexpr,
    FAST_SILU: tl.constexpr,
):
    """One query block's contribution to dK, dV of a key block, in transposed form [BN, BM]."""
    q = _load_tile(Q_base, q_desc, off_h, start_m, n, stride_qm, DIM_Q, BLOCK_M, BLOCK_D_Q, True,
                   ENABLE_TMA, UPCAST)
    do = _load_tile(DO_base, do_desc, off_h, start_m, n, stride_dom, DIM_V, BLOCK_M, BLOCK_D_V,
                    True, ENABLE_TMA, UPCAST)
    a_t, g2_t = _silu_and_twice_grad(tl.dot(k, tl.trans(q), input_precision=PRECISION), alpha,
                                     FAST_SILU)
    da_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
    ds_t = da_t * g2_t
    if MASKED:
        rows = start_m + tl.arange(0, BLOCK_M)
        valid = _valid(rows[None, :], cols[:, None], n, shift, hist, max_attn_len, CAUSAL,
                       HAS_CONTEXTUAL, HAS_TARGETS, HAS_MAX_ATTN_LEN)
        a_t = tl.where(valid, a_t, 0.0)
        ds_t = tl.where(valid, ds_t, 0.0)
    dv = tl.dot(a_t.to(do.dtype), do, dv, input_precision=PRECISION)
    dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=PRECISION)
    return dk, dv


@triton.jit(do_not_specialize=["AUTOTUNE_Z", "AUTOTUNE_MAX_SEQ_LEN"])
def _hstu_attn_bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    DK,
    DV,
    seq_offsets,
    num_targets,
    sort_idx,
    stride_qm,
    stride_qh,
    stride_km,
    stride_kh,
    stride_vm,
    stride_vh,
    stride_dom,
    stride_doh,
    stride_dkm,
    stride_dkh,
    stride_dvm,
    stride_dvh,
    alpha,
    inv_scale,
    max_attn_len,
    contextual_seq_len,
    H,
    AUTOTUNE_Z,
    AUTOTUNE_MAX_SEQ_LEN,
    DIM_Q: tl.constexpr,
    DIM_V: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    HAS_CONTEXTUAL: tl.constexpr,
    HAS_MAX_ATTN_LEN: tl.constexpr,
    SORT_BY_LENGTH: tl.constexpr,
    PRECISION: tl.constexpr,
    ENABLE_TMA: tl.constexpr,
    UPCAST: tl.constexpr,
    FAST_SILU: tl.constexpr,
    BLOCK_D_Q: tl.constexpr,
    BLOCK_D_V: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """dK, dV: one program per (key block, sequence * head), looping over query blocks.

    Query ranges for keys ``[n0, n0 + BLOCK_N)``: the contextual rows ``[0, C)`` (masked);
    then from ``n0`` (causal: later rows only) to the last row that can see the block, the
    rows whose id exceeds every key id of the block running without the mask.
    """
    # Inductor passes Python floats as fp64; the maths here is fp32.
    alpha = tl.cast(alpha, tl.float32)
    inv_scale = tl.cast(inv_scale, tl.float32)
    # (inlined rather than a helper: torch.compile's mutation analysis of user kernels marks
    # every pointer passed to a helper whose results address a store as written)
    off_z = tl.program_id(1) // H
    off_h = tl.program_id(1) % H
    if SORT_BY_LENGTH:
        off_z = tl.load(sort_idx + off_z).to(tl.int32)
    start = tl.load(seq_offsets + off_z).to(tl.int64)
    n = (tl.load(seq_offsets + off_z + 1) - start).to(tl.int32)
    n0 = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_N
    if n0 < n:
        shift, hist = _history(num_targets, off_z, n, contextual_seq_len, HAS_CONTEXTUAL,
                               HAS_TARGETS)
        Q_base = Q + start * stride_qm + off_h * stride_qh
        DO_base = DO + start * stride_dom + off_h * stride_doh
        K_base = K + start * stride_km + off_h * stride_kh
        V_base = V + start * stride_vm + off_h * stride_vh
        q_desc = _descriptor(Q + start * stride_qm, n, H, stride_qm, stride_qh, DIM_Q, BLOCK_M,
                             BLOCK_D_Q, ENABLE_TMA)
        do_desc = _descriptor(DO + start * stride_dom, n, H, stride_dom, stride_doh, DIM_V, BLOCK_M,
                              BLOCK_D_V, ENABLE_TMA)
        k_desc = _descriptor(K + start * stride_km, n, H, stride_km, stride_kh, DIM_Q, BLOCK_N,
                             BLOCK_D_Q, ENABLE_TMA)
        v_desc = _descriptor(V + start * stride_vm, n, H, stride_vm, stride_vh, DIM_V, BLOCK_N,
                             BLOCK_D_V, ENABLE_TMA)
        k = _load_tile(K_base, k_desc, off_h, n0, n, stride_km, DIM_Q, BLOCK_N, BLOCK_D_Q, True,
                       ENABLE_TMA, UPCAST)
        v = _load_tile(V_base, v_desc, off_h, n0, n, stride_vm, DIM_V, BLOCK_N, BLOCK_D_V, True,
                       ENABLE_TMA, UPCAST)
        cols = n0 + tl.arange(0, BLOCK_N)
        n1 = tl.minimum(n0 + BLOCK_N, n)
        id_last = _ids(n1 - 1, shift, hist, HAS_CONTEXTUAL, HAS_TARGETS)
        ctx_end = 0
        if HAS_CONTEXTUAL:
            ctx_end = tl.minimum(contextual_seq_len, n)
        rows_start = tl.cdiv(ctx_end, BLOCK_M) * BLOCK_M
        if CAUSAL:
            rows_start = tl.maximum(rows_start, (n0 // BLOCK_M) * BLOCK_M)
        elif HAS_MAX_ATTN_LEN:
            id_first = _ids(n0, shift, hist, HAS_CONTEXTUAL, HAS_TARGETS)
            below = _count_below(id_first - max_attn_len, n, shift, hist, HAS_TARGETS)
            rows_start = tl.maximum(rows_start, (below // BLOCK_M) * BLOCK_M)
        rows_end = n
        if HAS_MAX_ATTN_LEN:
            rows_end = _count_below(id_last + max_attn_len + 1, n, shift, hist, HAS_TARGETS)
        full_start = rows_end
        if CAUSAL:
            if HAS_TARGETS:
                # keys of target tokens are seen from their own row only
                key_targets = n1 > _count_below(hist, n, shift, hist, HAS_TARGETS)
                rows_end = tl.where(n0 >= _count_below(hist, n, shift, hist, HAS_TARGETS),
                                    tl.minimum(rows_end, n1), rows_end)
            else:
                key_targets = False
            if not HAS_MAX_ATTN_LEN:
                above = _count_below(id_last + 1, n, shift, hist, HAS_TARGETS)
                full_start = tl.cdiv(above, BLOCK_M) * BLOCK_M
                full_start = tl.where(key_targets, rows_end, full_start)
        rows_end = tl.maximum(rows_end, rows_start)
        full_start = tl.minimum(tl.maximum(full_start, rows_start), rows_end)
        dk = tl.zeros([BLOCK_N, BLOCK_D_Q], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D_V], dtype=tl.float32)
        if HAS_CONTEXTUAL:
            for start_m in range(0, ctx_end, BLOCK_M):
                dk, dv = _dkdv_block(dk, dv, k, v, Q_base, DO_base, q_desc, do_desc, off_h, start_m,
                                     cols, n, shift, hist, max_attn_len, stride_qm, stride_dom,
                                     alpha, True, CAUSAL, HAS_CONTEXTUAL, HAS_TARGETS,
                                     HAS_MAX_ATTN_LEN, DIM_Q, DIM_V, BLOCK_D_Q, BLOCK_D_V, BLOCK_M,
                                     PRECISION, ENABLE_TMA, UPCAST, FAST_SILU)
        for start_m in range(rows_start, full_start, BLOCK_M):
            dk, dv = _dkdv_block(dk, dv, k, v, Q_base, DO_base, q_desc, do_desc, off_h, start_m,
                                 cols, n, shift, hist, max_attn_len, stride_qm, stride_dom, alpha,
                                 True, CAUSAL, HAS_CONTEXTUAL, HAS_TARGETS, HAS_MAX_ATTN_LEN, DIM_Q,
                                 DIM_V, BLOCK_D_Q, BLOCK_D_V, BLOCK_M, PRECISION, ENABLE_TMA,
                                 UPCAST, FAST_SILU)
        for start_m in range(full_start, rows_end, BLOCK_M):
            dk, dv = _dkdv_block(dk, dv, k, v, Q_base, DO_base, q_desc, do_desc, off_h, start_m,
                                 cols, n, shift, hist, max_attn_len, stride_qm, stride_dom, alpha,
                                 False, CAUSAL, HAS_CONTEXTUAL, HAS_TARGETS, HAS_MAX_ATTN_LEN,
                                 DIM_Q, DIM_V, BLOCK_D_Q, BLOCK_D_V, BLOCK_M, PRECISION, ENABLE_TMA,
                                 UPCAST, FAST_SILU)
        DK_base = DK + start * stride_dkm + off_h * stride_dkh
        DV_base = DV + start * stride_dvm + off_h * stride_dvh
        dk_rows = n0 + tl.arange(0, BLOCK_N)
        dk_cols = tl.arange(0, BLOCK_D_Q)
        dk_mask = dk_rows[:, None] < n
        if BLOCK_D_Q != DIM_Q:
            dk_mask = dk_mask & (dk_cols[None, :] < DIM_Q)
        tl.store(DK_base + dk_rows[:, None] * stride_dkm + dk_cols[None, :],
                 (dk * (0.5 * alpha * inv_scale)).to(DK_base.dtype.element_ty), mask=dk_mask)
        dv_rows = n0 + tl.arange(0, BLOCK_N)
        dv_cols = tl.arange(0, BLOCK_D_V)
        dv_mask = dv_rows[:, None] < n
        if BLOCK_D_V != DIM_V:
            dv_mask = dv_mask & (dv_cols[None, :] < DIM_V)
        tl.store(DV_base + dv_rows[:, None] * stride_dvm + dv_cols[None, :],
                 (dv * inv_scale).to(DV_base.dtype.element_ty), mask=dv_mask)
