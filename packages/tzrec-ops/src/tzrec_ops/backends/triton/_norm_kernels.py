"""The row-normalisation kernels behind every norm op of :mod:`.layer_norm` (and the STU
blocks of :mod:`.hstu_compute`), with their launchers :func:`norm_forward` and
:func:`norm_backward`.

Every norm is one row-wise normalisation, written once as a pair of kernels that see a row of
``D = G * V`` features as ``G`` groups of ``V`` (``G = 1`` for a layer norm; ``G = H`` heads for
the group norm of the STU output). A program owns a ``[BLOCK_M, BLOCK_G, BLOCK_V]`` tile of rows;
masks cover feature dims that are not powers of two. Statistics are fp32.

Forward, per group (``n = V``), with ``mu = mean(x)`` (0 for RMS) and ``r = 1/sqrt(var + eps)``
(``var = mean(x^2)`` for RMS)::

    xhat = (x - mu) * r;  a = xhat * w + b          (w, b per feature, or per group)
    plain: y = a;  swish: y = x * sigmoid(a);  mul: y = a * u
    mul + concat_ux: y = [u | x | a * u];  dropout (training): y *= keep / (1 - p)

Dropout draws ``tl.rand(seed, row * W + col)`` (``W`` the output width, 3D with concat_ux), so a
seed replays the same mask in the backward and on every call. The seed is a one-element int64
tensor on the device (:func:`~._kernel_utils.dropout_seed`) that the kernels load, not a scalar
argument: a host value would break a ``torch.compile`` graph. With dropout off the launchers
pass an input in its place, which the kernels never read (``DROPOUT`` is a constexpr).

Backward, with ``da`` the gradient reaching ``a`` and ``g = da * w``::

    dx = r * (g - mean(g) - xhat * mean(g * xhat))   (RMS: no mean(g) term) + direct terms
    swish: da = dy * x * s * (1 - s), direct dy * s;   mul: da = dy * u, du = dy * a
    dw = sum_rows da * xhat,  db = sum_rows da

``dw``/``db`` are reduced deterministically: a fixed grid of programs each owns a contiguous
block of rows and writes one fp32 partial row; a second kernel sums the partials.

Shapes: x, u ``[L, D]``; weight, bias ``[D]`` (``[G]`` for the group norm); mean, rstd ``[L*G]``.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import triton
import triton.language as tl

from tzrec_ops.backends.triton._eager import launchable
from tzrec_ops.backends.triton._kernel_utils import (
    dropout_scale,
    interpreting,
    num_sms,
    quantize_rows,
    tuned,
)
from tzrec_ops.ops.utils import cdiv, next_power_of_2

PLAIN, SWISH, MUL = 0, 1, 2
_MAX_TILE_BYTES = 65536
# Tile sizes (elements per program tile) and the backward's persistent grid (programs per SM):
# other tile sizes, programs per SM and software pipelining of the backward's row loop were no
# faster (docs/tzrec-ops-measurements.md).
_FWD_TILE_ELEMENTS = 4096
_BWD_TILE_ELEMENTS = 2048
_BWD_PROGRAMS_PER_SM = 4
# sum_partials tile: partial rows x columns per program; narrow columns give enough programs
# for the few hundred partial rows of a norm backward
_SUM_BLOCK_P, _SUM_BLOCK_D = 128, 32


def _warp_configs() -> List[triton.Config]:
    return [triton.Config({}, num_warps=w) for w in (2, 4, 8)]


_INTERPRET_CONFIG = triton.Config({}, num_warps=1)
_KEY = ["AUTOTUNE_L", "G", "V", "MODE", "RMS"]


@triton.jit(do_not_specialize=["L", "AUTOTUNE_L"])
def _norm_fwd_kernel(
    X,
    U,
    W,
    B,
    Y,
    MEAN,
    RSTD,
    L,
    G,
    V,
    stride_x,
    stride_u,
    stride_y,
    eps,
    dropout_p,
    dropout_inv_keep,
    SEED,
    AUTOTUNE_L,
    RMS: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    GROUP_AFFINE: tl.constexpr,
    MODE: tl.constexpr,
    CONCAT_UX: tl.constexpr,
    DROPOUT: tl.constexpr,
    COMPUTE_STATS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = (pid * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    gs = tl.arange(0, BLOCK_G)
    vs = tl.arange(0, BLOCK_V)
    cols = (gs[:, None] * V + vs[None, :])[None, :, :]
    cmask = ((gs[:, None] < G) & (vs[None, :] < V))[None, :, :]
    rmask = rows < L
    mask = rmask[:, None, None] & cmask
    x = tl.load(X + rows[:, None, None] * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if DROPOUT:
        seed = tl.load(SEED)
    stat_offs = rows[:, None] * G + gs[None, :]
    stat_mask = rmask[:, None] & (gs[None, :] < G)
    if COMPUTE_STATS:
        if RMS:
            mean = tl.zeros((BLOCK_M, BLOCK_G), dtype=tl.float32)
            var = tl.sum(x * x, axis=2) / V
        else:
            mean = tl.sum(x, axis=2) / V
            xc = tl.where(mask, x - mean[:, :, None], 0.0)
            var = tl.sum(xc * xc, axis=2) / V
            tl.store(MEAN + stat_offs, mean, mask=stat_mask)
        # eps arrives as fp64 from Inductor, fp32 from eager launches: add it in fp32 both ways
        rstd = 1.0 / tl.sqrt(var + tl.cast(eps, tl.float32))
        tl.store(RSTD + stat_offs, rstd, mask=stat_mask)
    else:
        if RMS:
            mean = tl.zeros((BLOCK_M, BLOCK_G), dtype=tl.float32)
        else:
            mean = tl.load(MEAN + stat_offs, mask=stat_mask, other=0.0)
        rstd = tl.load(RSTD + stat_offs, mask=stat_mask, other=0.0)
    a = tl.where(mask, (x - mean[:, :, None]) * rstd[:, :, None], 0.0)
    if HAS_W:
        if GROUP_AFFINE:
            w = tl.load(W + gs, mask=gs < G, other=0.0).to(tl.float32)[None, :, None]
        else:
            w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
        a = a * w
    if HAS_B:
        if GROUP_AFFINE:
            b = tl.load(B + gs, mask=gs < G, other=0.0).to(tl.float32)[None, :, None]
        else:
            b = tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)
        a = a + b
    y_ptrs = Y + rows[:, None, None] * stride_y + cols
    if MODE == 1:
        y = x * tl.sigmoid(a)
        tl.store(y_ptrs, y.to(Y.dtype.element_ty), mask=mask)
    elif MODE == 2:
        u = tl.load(U + rows[:, None, None] * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
        y = a * u
        if CONCAT_UX:
            D = G * V
            if DROPOUT:
                base = rows[:, None, None] * (3 * D) + cols
                u = u * dropout_scale(seed, base, dropout_p, dropout_inv_keep)
                x = x * dropout_scale(seed, base + D, dropout_p, dropout_inv_keep)
                y = y * dropout_scale(seed, base + 2 * D, dropout_p, dropout_inv_keep)
            tl.store(y_ptrs, u.to(Y.dtype.element_ty), mask=mask)
            tl.store(y_ptrs + D, x.to(Y.dtype.element_ty), mask=mask)
            tl.store(y_ptrs + 2 * D, y.to(Y.dtype.element_ty), mask=mask)
        else:
            if DROPOUT:
                offs = rows[:, None, None] * (G * V) + cols
                y = y * dropout_scale(seed, offs, dropout_p, dropout_inv_keep)
            tl.store(y_ptrs, y.to(Y.dtype.element_ty), mask=mask)
    else:
        tl.store(y_ptrs, a.to(Y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["L", "tiles_per_program", "AUTOTUNE_L"])
def _norm_bwd_kernel(
    DY,
    X,
    U,
    W,
    B,
    MEAN,
    RSTD,
    DX,
    DU,
    Y,
    PARTIAL_DW,
    PARTIAL_DB,
    L,
    G,
    V,
    stride_dy,
    stride_x,
    stride_u,
    stride_dx,
    stride_du,
    stride_y,
    dropout_p,
    dropout_inv_keep,
    SEED,
    tiles_per_program,
    AUTOTUNE_L,
    RMS: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    GROUP_AFFINE: tl.constexpr,
    MODE: tl.constexpr,
    CONCAT_UX: tl.constexpr,
    DROPOUT: tl.constexpr,
    COMPUTE_Y: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    pid = tl.program_id(0)
    gs = tl.arange(0, BLOCK_G)
    vs = tl.arange(0, BLOCK_V)
    cols = (gs[:, None] * V + vs[None, :])[None, :, :]
    cmask = ((gs[:, None] < G) & (vs[None, :] < V))[None, :, :]
    D = G * V
    if HAS_W:
        if GROUP_AFFINE:
            w = tl.load(W + gs, mask=gs < G, other=0.0).to(tl.float32)[None, :, None]
        else:
            w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    if HAS_B:
        if GROUP_AFFINE:
            b = tl.load(B + gs, mask=gs < G, other=0.0).to(tl.float32)[None, :, None]
        else:
            b = tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)
    if DROPOUT:
        seed = tl.load(SEED)
    dw_acc = tl.zeros((BLOCK_G, BLOCK_V), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_G, BLOCK_V), dtype=tl.float32)
    for t in range(0, tiles_per_program):
        rows = ((pid * tiles_per_program + t) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        rmask = rows < L
        mask = rmask[:, None, None] & cmask
        stat_offs = rows[:, None] * G + gs[None, :]
        stat_mask = rmask[:, None] & (gs[None, :] < G)
        x = tl.load(X + rows[:, None, None] * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + stat_offs, mask=stat_mask, other=0.0)[:, :, None]
        if RMS:
            xhat = tl.where(mask, x * rstd, 0.0)
        else:
            mean = tl.load(MEAN + stat_offs, mask=stat_mask, other=0.0)[:, :, None]
            xhat = tl.where(mask, (x - mean) * rstd, 0.0)
        a = xhat
        if HAS_W:
            a = a * w
        if HAS_B:
            a = a + b
        dy_ptrs = DY + rows[:, None, None] * stride_dy + cols
        if MODE == 0:
            da = tl.load(dy_ptrs, mask=mask, other=0.0).to(tl.float32)
        elif MODE == 1:
            dy = tl.load(dy_ptrs, mask=mask, other=0.0).to(tl.float32)
            s = tl.sigmoid(a)
            da = dy * x * s * (1.0 - s)
            dx_direct = dy * s
        else:
            u = tl.load(U + rows[:, None, None] * stride_u + cols, mask=mask, other=0.0).to(
                tl.float32
            )
            if CONCAT_UX:
                dyu = tl.load(dy_ptrs, mask=mask, other=0.0).to(tl.float32)
                dyx = tl.load(dy_ptrs + D, mask=mask, other=0.0).to(tl.float32)
                dya = tl.load(dy_ptrs + 2 * D, mask=mask, other=0.0).to(tl.float32)
                if DROPOUT:
                    base = rows[:, None, None] * (3 * D) + cols
                    keep_u = dropout_scale(seed, base, dropout_p, dropout_inv_keep)
                    keep_x = dropout_scale(seed, base + D, dropout_p, dropout_inv_keep)
                    keep_a = dropout_scale(seed, base + 2 * D, dropout_p, dropout_inv_keep)
                    dyu = dyu * keep_u
                    dyx = dyx * keep_x
                    dya = dya * keep_a
                du = dya * a + dyu
                dx_direct = dyx
                if COMPUTE_Y:
                    y_ptrs = Y + rows[:, None, None] * stride_y + cols
                    y_u = u
                    y_x = x
                    y_a = a * u
                    if DROPOUT:
                        y_u = y_u * keep_u
                        y_x = y_x * keep_x
                        y_a = y_a * keep_a
                    tl.store(y_ptrs, y_u.to(Y.dtype.element_ty), mask=mask)
                    tl.store(y_ptrs + D, y_x.to(Y.dtype.element_ty), mask=mask)
                    tl.store(y_ptrs + 2 * D, y_a.to(Y.dtype.element_ty), mask=mask)
            else:
                dya = tl.load(dy_ptrs, mask=mask, other=0.0).to(tl.float32)
                if DROPOUT:
                    keep = dropout_scale(
                        seed, rows[:, None, None] * D + cols, dropout_p, dropout_inv_keep
                    )
                    dya = dya * keep
                du = dya * a
                if COMPUTE_Y:
                    y_a = a * u
                    if DROPOUT:
                        y_a = y_a * keep
                    tl.store(
                        Y + rows[:, None, None] * stride_y + cols,
                        y_a.to(Y.dtype.element_ty),
                        mask=mask,
                    )
            da = dya * u
            tl.store(
                DU + rows[:, None, None] * stride_du + cols, du.to(DU.dtype.element_ty), mask=mask
            )
        dw_acc += tl.sum(da * xhat, axis=0)
        db_acc += tl.sum(da, axis=0)
        g = da
        if HAS_W:
            g = g * w
        c1 = (tl.sum(g * xhat, axis=2) / V)[:, :, None]
        if RMS:
            dx = (g - xhat * c1) * rstd
        else:
            c2 = (tl.sum(g, axis=2) / V)[:, :, None]
            dx = (g - xhat * c1 - c2) * rstd
        if MODE == 1:
            dx += dx_direct
        if MODE == 2:
            if CONCAT_UX:
                dx += dx_direct
        tl.store(DX + rows[:, None, None] * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
    part = pid.to(tl.int64) * D + gs[:, None] * V + vs[None, :]
    part_mask = (gs[:, None] < G) & (vs[None, :] < V)
    if HAS_W:
        tl.store(PARTIAL_DW + part, dw_acc, mask=part_mask)
    if HAS_B:
        tl.store(PARTIAL_DB + part, db_acc, mask=part_mask)


@triton.jit(do_not_specialize=["P"])
def _sum_partials_kernel(
    PARTIAL,
    OUT0,
    OUT1,
    P,
    D,
    TWO: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """``OUT_i[d] = sum_p PARTIAL[i, p, d]`` in a fixed order (deterministic), rounded to the
    outputs' dtype; ``i = program_id(1)`` (the weight's and the bias's partials)."""
    PARTIAL += tl.program_id(1).to(tl.int64) * P * D
    OUT = OUT0
    if TWO:
        if tl.program_id(1) == 1:
            OUT = OUT1
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    acc = tl.zeros((BLOCK_P, BLOCK_D), dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        ps = p0 + tl.arange(0, BLOCK_P)
        acc += tl.load(
            PARTIAL + ps[:, None].to(tl.int64) * D + cols[None, :],
            mask=(ps[:, None] < P) & (cols[None, :] < D),
            other=0.0,
        )
    tl.store(OUT + cols, tl.sum(acc, axis=0).to(OUT.dtype.element_ty), mask=cols < D)


def _blocks(groups: int, group_size: int, itemsize: int) -> Tuple[int, int]:
    block_g = next_power_of_2(groups)
    block_v = next_power_of_2(group_size)
    if block_g * block_v * itemsize > _MAX_TILE_BYTES:
        raise ValueError(
            f"feature dim {groups * group_size} is too large for the Triton norm kernels "
            f"(padded row of {block_g * block_v} elements exceeds {_MAX_TILE_BYTES} bytes)"
        )
    return block_g, block_v


def _rows_per_tile(block_g: int, block_v: int, elements: int) -> int:
    return max(1, min(64, elements // (block_g * block_v)))


def sum_partials(partial: torch.Tensor, dtype: torch.dtype = torch.float32) -> List[torch.Tensor]:
    """Column sums of fp32 partials ``[N, P, D]`` (N <= 2) -> N tensors ``[D]`` in ``dtype``,
    in one launch."""
    N, P, D = partial.shape
    outs = [torch.empty(D, dtype=dtype, device=partial.device) for _ in range(N)]
    block_d = min(_SUM_BLOCK_D, next_power_of_2(max(D, 1)))
    block_p = 1 if interpreting() else _SUM_BLOCK_P
    launchable(_sum_partials_kernel)[(cdiv(D, block_d), N)](
        partial,
        outs[0],
        outs[1] if N == 2 else partial,  # an input as placeholder, never an output twice
        P,
        D,
        TWO=N == 2,
        BLOCK_P=block_p,
        BLOCK_D=block_d,
    )
    return outs


def _check_seed(dropout_p: float, seed: Optional[torch.Tensor]) -> bool:
    """Whether dropout is on; then ``seed`` must be the [1] int64 seed tensor."""
    if dropout_p <= 0.0:
        return False
    if seed is None or seed.dtype != torch.int64 or seed.numel() != 1:
        got = None if seed is None else f"{seed.dtype} of {seed.numel()} elements"
        raise ValueError(f"dropout_p={dropout_p} needs a [1] int64 seed tensor, got {got}")
    return True


def norm_forward(
    x: torch.Tensor,
    u: Optional[torch.Tensor],
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    eps: float,
    groups: int,
    group_affine: bool,
    rms: bool,
    mode: int,
    concat_ux: bool,
    dropout_p: float,
    seed: Optional[torch.Tensor],
    mean: Optional[torch.Tensor] = None,
    rstd: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the forward on 2-D ``x`` ([L, D], last dim contiguous): (y, mean, rstd).

    With ``mean``/``rstd`` given the statistics are not recomputed (and not returned anew).
    ``y`` is ``[L, 3D]`` with ``concat_ux``, else ``[L, D]``, in x's dtype. ``seed`` ([1],
    int64, on x's device) is read only when ``dropout_p > 0``; None without dropout.
    """
    L, D = x.shape
    V = D // groups
    block_g, block_v = _blocks(groups, V, x.element_size())
    y = torch.empty((L, 3 * D if concat_ux else D), dtype=x.dtype, device=x.device)
    compute_stats = rstd is None
    if compute_stats:
        mean = torch.empty(0 if rms else L * groups, dtype=torch.float32, device=x.device)
        rstd = torch.empty(L * groups, dtype=torch.float32, device=x.device)
    if L == 0:
        return y, mean, rstd
    block_m = 1 if interpreting() else _rows_per_tile(block_g, block_v, _FWD_TILE_ELEMENTS)
    kernel = tuned("norm_fwd", _norm_fwd_kernel, _warp_configs, _KEY, _INTERPRET_CONFIG, x.device)
    dropout = _check_seed(dropout_p, seed)
    launchable(kernel)[(cdiv(L, block_m),)](
        x,
        u if u is not None else x,
        weight if weight is not None else x,
        bias if bias is not None else x,
        y,
        mean if mean.numel() > 0 else x,  # never alias an output (see mm.py)
        rstd,
        L,
        groups,
        V,
        x.stride(0),
        u.stride(0) if u is not None else 0,
        y.stride(0),
        eps,
        dropout_p,
        1.0 / (1.0 - dropout_p) if dropout else 1.0,
        seed if dropout else x,  # unread without dropout: no seed tensor, no launch for one
        quantize_rows(L),
        RMS=rms,
        HAS_W=weight is not None,
        HAS_B=bias is not None,
        GROUP_AFFINE=group_affine,
        MODE=mode,
        CONCAT_UX=concat_ux,
        DROPOUT=dropout,
        COMPUTE_STATS=compute_stats,
        BLOCK_M=block_m,
        BLOCK_G=block_g,
        BLOCK_V=block_v,
    )
    return y, mean, rstd


def norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    u: Optional[torch.Tensor],
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    mean: torch.Tensor,
    rstd: torch.Tensor,
    groups: int,
    group_affine: bool,
    rms: bool,
    mode: int,
    concat_ux: bool,
    dropout_p: float,
    seed: Optional[torch.Tensor],
    compute_y: bool,
    dx: Optional[torch.Tensor] = None,
    du: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward: (dx, du, dweight, dbias, y); absent ones are empty tensors.

    ``dx``/``du`` may be given as output buffers (any row stride). ``y`` is recomputed only
    with ``compute_y`` (mul mode). ``seed`` is the forward's (see :func:`norm_forward`).
    """
    L, D = x.shape
    V = D // groups
    block_g, block_v = _blocks(groups, V, x.element_size())
    device = x.device
    dx = torch.empty_like(x) if dx is None else dx
    if mode == MUL:
        du = torch.empty_like(u) if du is None else du
    else:
        du = torch.empty(0, dtype=x.dtype, device=device)
    y = torch.empty(
        (L, 3 * D if concat_ux else D) if compute_y else (0,), dtype=x.dtype, device=device
    )
    has_w, has_b = weight is not None, bias is not None
    block_m = 1 if interpreting() else _rows_per_tile(block_g, block_v, _BWD_TILE_ELEMENTS)
    tiles = cdiv(L, block_m)
    programs = max(1, min(tiles, num_sms(device) * _BWD_PROGRAMS_PER_SM))
    tiles_per_program = cdiv(tiles, programs) if tiles > 0 else 0
    programs = cdiv(tiles, tiles_per_program) if tiles > 0 else 1
    # every program writes its whole partial row, so only an empty batch needs zeros
    alloc = torch.empty if L > 0 else torch.zeros
    partials = alloc((has_w + has_b, programs, D), dtype=torch.float32, device=device)
    partial_dw = partials[0] if has_w else rstd
    partial_db = partials[int(has_w)] if has_b else rstd
    if L > 0:
        kernel = tuned("norm_bwd", _norm_bwd_kernel, _warp_configs, _KEY, _INTERPRET_CONFIG, device)
        dropout = _check_seed(dropout_p, seed)
        launchable(kernel)[(programs,)](
            dy,
            x,
            u if u is not None else x,
            weight if has_w else x,
            bias if has_b else x,
            mean if mean.numel() > 0 else rstd,
            rstd,
            dx,
            du if du.numel() > 0 else x,  # never alias an output (see mm.py)
            y if compute_y else x,
            partial_dw,
            partial_db,
            L,
            groups,
            V,
            dy.stride(0),
            x.stride(0),
            u.stride(0) if u is not None else 0,
            dx.stride(0),
            du.stride(0) if du.dim() == 2 else 0,
            y.stride(0) if compute_y else 0,
            dropout_p,
            1.0 / (1.0 - dropout_p) if dropout else 1.0,
            seed if dropout else x,  # unread without dropout
            tiles_per_program,
            quantize_rows(L),
            RMS=rms,
            HAS_W=has_w,
            HAS_B=has_b,
            GROUP_AFFINE=group_affine,
            MODE=mode,
            CONCAT_UX=concat_ux,
            DROPOUT=dropout,
            COMPUTE_Y=compute_y,
            BLOCK_M=block_m,
            BLOCK_G=block_g,
            BLOCK_V=block_v,
        )
    dweight, dbias = _reduce_affine_grads(partials, weight, bias, groups if group_affine else 1)
    return dx, du, dweight, dbias, y


def _reduce_affine_grads(
    partials: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    affine_groups: int,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(dweight, dbias) from the per-program partials ``[#params, P, D]``, one launch (empty
    tensors for absent parameters)."""
    params = [t for t in (weight, bias) if t is not None]
    none = torch.empty(0, dtype=partials.dtype, device=partials.device)
    if not params:
        return none, none
    D = partials.shape[2]
    per_param = affine_groups > 1 or any(t.numel() != D for t in params)
    direct = not per_param and all(t.dtype == params[0].dtype for t in params)
    sums = sum_partials(partials, params[0].dtype if direct else torch.float32)
    if per_param:  # per-group affine: one value per group of D / G features
        sums = [t.view(affine_groups, D // affine_groups).sum(dim=1) for t in sums]
    grads = iter(total.to(t.dtype) for total, t in zip(sums, params))
    return (next(grads) if weight is not None else none, next(grads) if bias is not None else none)
