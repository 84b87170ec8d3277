"""Triton layer norm, RMS norm, swish layer norm and the fused norm-multiply-dropout ops.

Each op is a ``torch.library`` op over the kernels of :mod:`._norm_kernels` (maths and
layout in its docstring), which one set of flags (:class:`_Variant`) turns into that norm;
the flags are written once per op and serve its forward and its backward.

The dropout seed travels as a tensor (``seed: Tensor?`` in the op schemas: ``[1]`` int64 on
x's device, None without dropout), drawn or filled by the backend functions at the bottom
(:func:`~._kernel_utils.dropout_seed`); the forward saves it for the backward, which replays
the forward's mask from it.

Shapes: x, u ``[L, D]``; weight, bias ``[D]`` (``[H]`` for the group norm).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch

from tzrec_ops.backends.triton._eager import triton_library_op
from tzrec_ops.backends.triton._kernel_utils import dropout_seed
from tzrec_ops.backends.triton._norm_kernels import (
    MUL,
    PLAIN,
    SWISH,
    norm_backward,
    norm_forward,
)
from tzrec_ops.ops.utils import switch_to_contiguous_if_needed


class _Variant(NamedTuple):
    """The flags that make the kernels one norm: :func:`norm_forward`'s and
    :func:`norm_backward`'s arguments after the tensors and eps, in their order (the last,
    the dropout seed tensor, is saved for the backward as a tensor, not set on ctx)."""

    groups: int
    group_affine: bool
    rms: bool
    mode: int
    concat_ux: bool
    dropout_p: float
    seed: Optional[torch.Tensor]


_LAYER_NORM = _Variant(1, False, False, PLAIN, False, 0.0, None)
_RMS_NORM = _LAYER_NORM._replace(rms=True)
_SWISH_LAYER_NORM = _LAYER_NORM._replace(mode=SWISH)


def _mul_variant(
    num_groups: int, concat_ux: bool, dropout_p: float, seed: Optional[torch.Tensor]
) -> _Variant:
    """``num_groups == 0``: layer norm with weight/bias [D]; ``num_groups == H``: group norm
    over H heads with one weight/bias per head ([H])."""
    return _Variant(max(num_groups, 1), num_groups > 0, False, MUL, concat_ux, dropout_p, seed)


# --------------------------------------------------------------------------------------------
# torch.library ops. Forward ops return (y, mean, rstd); the shared backward op returns
# (dx, du, dweight, dbias, y) with empty tensors for the gradients that do not apply.


@triton_library_op("tzrec_ops::norm_bwd_triton")
def norm_bwd_op(
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
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of every norm op in this module (see the module docstring)."""
    return norm_backward(
        dy,
        x,
        u,
        weight,
        bias,
        mean,
        rstd,
        groups,
        group_affine,
        rms,
        mode,
        concat_ux,
        dropout_p,
        seed,
        compute_y,
    )


def _grads(ctx, dy):  # type: ignore[no-untyped-def]
    x, u, weight, bias, mean, rstd, seed = ctx.saved_tensors
    dx, du, dweight, dbias, _ = norm_bwd_op(
        switch_to_contiguous_if_needed(dy),
        x,
        u if ctx.mode == MUL else None,
        weight if ctx.has_w else None,
        bias if ctx.has_b else None,
        mean,
        rstd,
        ctx.groups,
        ctx.group_affine,
        ctx.rms,
        ctx.mode,
        ctx.concat_ux,
        ctx.dropout_p,
        seed if ctx.dropout_p > 0.0 else None,
        False,
    )
    return (
        dx,
        du if ctx.mode == MUL else None,
        dweight if ctx.has_w else None,
        dbias if ctx.has_b else None,
    )


def _save(ctx, x, u, weight, bias, output, variant):  # type: ignore[no-untyped-def]
    _, mean, rstd = output
    empty = x.new_empty(0)
    ctx.save_for_backward(
        x,
        u if u is not None else empty,
        weight if weight is not None else empty,
        bias if bias is not None else empty,
        mean,
        rstd,
        variant.seed if variant.seed is not None else empty,
    )
    ctx.has_w, ctx.has_b = weight is not None, bias is not None
    for name, value in zip(_Variant._fields[:-1], variant[:-1]):
        setattr(ctx, name, value)


@triton_library_op("tzrec_ops::layer_norm_triton")
def layer_norm_op(
    x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Layer norm of x [L, D] with optional weight/bias [D] -> (y, mean [L], rstd [L])."""
    return norm_forward(x, None, weight, bias, eps, *_LAYER_NORM)


def _setup_layer_norm(ctx, inputs, output):  # type: ignore[no-untyped-def]
    x, weight, bias, _ = inputs
    _save(ctx, x, None, weight, bias, output, _LAYER_NORM)


def _layer_norm_backward(ctx, dy, dmean, drstd):  # type: ignore[no-untyped-def]
    dx, _, dweight, dbias = _grads(ctx, dy)
    return dx, dweight, dbias, None


layer_norm_op.register_autograd(
    _layer_norm_backward, setup_context=_setup_layer_norm, grad_outputs=1
)


@triton_library_op("tzrec_ops::rms_norm_triton")
def rms_norm_op(
    x: torch.Tensor, weight: Optional[torch.Tensor], eps: float
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RMS norm of x [L, D] with optional weight [D] -> (y, empty mean, rstd [L])."""
    return norm_forward(x, None, weight, None, eps, *_RMS_NORM)


def _setup_rms_norm(ctx, inputs, output):  # type: ignore[no-untyped-def]
    x, weight, _ = inputs
    _save(ctx, x, None, weight, None, output, _RMS_NORM)


def _rms_norm_backward(ctx, dy, dmean, drstd):  # type: ignore[no-untyped-def]
    dx, _, dweight, _ = _grads(ctx, dy)
    return dx, dweight, None


rms_norm_op.register_autograd(_rms_norm_backward, setup_context=_setup_rms_norm, grad_outputs=1)


@triton_library_op("tzrec_ops::swish_layer_norm_triton")
def swish_layer_norm_op(
    x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x * sigmoid(LayerNorm(x))`` for x [L, D] -> (y, mean [L], rstd [L])."""
    return norm_forward(x, None, weight, bias, eps, *_SWISH_LAYER_NORM)


def _setup_swish(ctx, inputs, output):  # type: ignore[no-untyped-def]
    x, weight, bias, _ = inputs
    _save(ctx, x, None, weight, bias, output, _SWISH_LAYER_NORM)


swish_layer_norm_op.register_autograd(
    _layer_norm_backward, setup_context=_setup_swish, grad_outputs=1
)


@triton_library_op("tzrec_ops::norm_mul_dropout_triton")
def norm_mul_dropout_op(
    x: torch.Tensor,
    u: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    num_groups: int,
    concat_ux: bool,
    dropout_p: float,
    seed: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dropout([u | x | Norm(x) * u])`` (or ``dropout(Norm(x) * u)``) -> (y, mean, rstd).

    The norm is chosen by ``num_groups`` (:func:`_mul_variant`); ``dropout_p == 0`` disables
    dropout. ``seed``: ``[1]`` int64 on x's device, needed when ``dropout_p > 0`` (else None).
    """
    variant = _mul_variant(num_groups, concat_ux, dropout_p, seed)
    return norm_forward(x, u, weight, bias, eps, *variant)


def _setup_norm_mul_dropout(ctx, inputs, output):  # type: ignore[no-untyped-def]
    x, u, weight, bias, _, num_groups, concat_ux, dropout_p, seed = inputs
    _save(ctx, x, u, weight, bias, output, _mul_variant(num_groups, concat_ux, dropout_p, seed))


def _norm_mul_dropout_backward(ctx, dy, dmean, drstd):  # type: ignore[no-untyped-def]
    dx, du, dweight, dbias = _grads(ctx, dy)
    return dx, du, dweight, dbias, None, None, None, None, None


norm_mul_dropout_op.register_autograd(
    _norm_mul_dropout_backward, setup_context=_setup_norm_mul_dropout, grad_outputs=1
)


# --------------------------------------------------------------------------------------------
# Backend functions (the public op's arguments, already validated).


def _rows(x: torch.Tensor) -> torch.Tensor:
    return switch_to_contiguous_if_needed(x.reshape(-1, x.shape[-1]))


def layer_norm(
    x: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """Triton backend of :func:`tzrec_ops.ops.layer_norm.layer_norm`."""
    return layer_norm_op(_rows(x), weight, bias, eps)[0].view(x.shape)


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float = 1e-5) -> torch.Tensor:
    """Triton backend of :func:`tzrec_ops.ops.layer_norm.rms_norm`."""
    return rms_norm_op(_rows(x), weight, eps)[0].view(x.shape)


def swish_layer_norm(
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    eps: float = 1e-5,
) -> torch.Tensor:
    """Triton backend of :func:`tzrec_ops.ops.layer_norm.swish_layer_norm`."""
    return swish_layer_norm_op(_rows(x), weight, bias, eps)[0].view(x.shape)


def _dropout_args(
    dropout_ratio: float, training: bool, seed: Optional[int], device: torch.device
) -> Tuple[float, Optional[torch.Tensor]]:
    """(dropout_p, seed tensor): (0.0, None) when dropout is off, so nothing is drawn or
    filled for it."""
    if not training or dropout_ratio <= 0.0:
        return 0.0, None
    return float(dropout_ratio), dropout_seed(seed, device)


def layer_norm_mul_dropout(
    x: torch.Tensor,
    u: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    dropout_ratio: float,
    training: bool,
    concat_ux: bool = False,
    seed: Optional[int] = None,
) -> torch.Tensor:
    """Triton backend of :func:`tzrec_ops.ops.layer_norm.layer_norm_mul_dropout`."""
    p, seed_tensor = _dropout_args(dropout_ratio, training, seed, x.device)
    return norm_mul_dropout_op(
        _rows(x), _rows(u), weight, bias, eps, 0, concat_ux, p, seed_tensor
    )[0]


def group_norm_mul_dropout(
    x: torch.Tensor,
    u: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    dropout_ratio: float,
    training: bool,
    num_heads: int,
    concat_ux: bool = False,
    seed: Optional[int] = None,
) -> torch.Tensor:
    """Triton backend of :func:`tzrec_ops.ops.layer_norm.group_norm_mul_dropout`."""
    p, seed_tensor = _dropout_args(dropout_ratio, training, seed, x.device)
    return norm_mul_dropout_op(
        _rows(x), _rows(u), weight, bias, eps, num_heads, concat_ux, p, seed_tensor
    )[0]
