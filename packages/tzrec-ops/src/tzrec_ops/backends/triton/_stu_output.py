"""Triton backend of ``hstu_compute_output``, the STU layer's fused output projection (one
``torch.library`` op with one backward; :mod:`.hstu_compute` re-exports it).

``y = dropout([u | attn | u * Norm(attn)])`` from the fused norm-mul-dropout kernel, then
``out = x + y @ W`` as one GEMM whose epilogue adds the residual (whose gradient is ``d_out``
itself, returned without a copy). With ``recompute_y_in_backward`` y is not saved; the norm
backward kernel rebuilds it (same dropout seed) for ``dW = y^T @ d_out``. The seed is a ``[1]``
int64 tensor drawn on the device per call (:func:`~._kernel_utils.dropout_seed`; None without
dropout) and saved for the backward, which replays the forward's mask from it.

Legend: L = tokens, E = embedding dim, H = heads; attn and u are ``[L, H * V]``, x and out
``[L, E]``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from tzrec_ops.backends.triton._eager import triton_library_op
from tzrec_ops.backends.triton._kernel_utils import dropout_seed
from tzrec_ops.backends.triton._norm_kernels import MUL, norm_backward, norm_forward
from tzrec_ops.backends.triton.mm import matmul
from tzrec_ops.ops.utils import switch_to_contiguous_if_needed

__all__ = ["hstu_compute_output"]



@triton_library_op("tzrec_ops::hstu_compute_output_triton")
def compute_output_op(
    attn: torch.Tensor,
    u: torch.Tensor,
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor,
    norm_eps: float,
    output_weight: torch.Tensor,
    num_heads: int,
    group_norm: bool,
    concat_ux: bool,
    dropout_p: float,
    seed: Optional[torch.Tensor],
    recompute_y_in_backward: bool,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out [L, E], saved y (empty with recompute), mean, rstd)."""
    y, mean, rstd = norm_forward(
        attn,
        u,
        norm_weight,
        norm_bias,
        norm_eps,
        num_heads if group_norm else 1,
        group_norm,
        False,
        MUL,
        concat_ux,
        dropout_p,
        seed,
    )
    out = torch.empty((x.shape[0], output_weight.shape[1]), dtype=x.dtype, device=x.device)
    matmul(y, output_weight, out, bias=x)
    return out, x.new_empty(0) if recompute_y_in_backward else y, mean, rstd


@triton_library_op("tzrec_ops::hstu_compute_output_bwd_triton")
def compute_output_bwd_op(
    dout: torch.Tensor,
    attn: torch.Tensor,
    u: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor,
    output_weight: torch.Tensor,
    saved_y: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    num_heads: int,
    group_norm: bool,
    concat_ux: bool,
    dropout_p: float,
    seed: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d_attn, d_u, d_norm_weight, d_norm_bias, d_output_weight); the residual's d_x is
    d_out itself, which the autograd formula returns without a copy."""
    dy = torch.empty((dout.shape[0], output_weight.shape[0]), dtype=dout.dtype, device=dout.device)
    matmul(dout, output_weight.t(), dy)
    recompute = saved_y.numel() == 0 and dout.shape[0] > 0
    d_attn, d_u, d_norm_weight, d_norm_bias, y = norm_backward(
        dy,
        attn,
        u,
        norm_weight,
        norm_bias,
        mean,
        rstd,
        num_heads if group_norm else 1,
        group_norm,
        False,
        MUL,
        concat_ux,
        dropout_p,
        seed,
        recompute,
    )
    if not recompute:
        y = saved_y.view(dy.shape)
    d_output_weight = torch.empty_like(output_weight)
    matmul(y.t(), dout, d_output_weight)
    return d_attn, d_u, d_norm_weight, d_norm_bias, d_output_weight


def _setup_output(ctx, inputs, output):  # type: ignore[no-untyped-def]
    (
        attn,
        u,
        _,
        norm_weight,
        norm_bias,
        _,
        output_weight,
        num_heads,
        group_norm,
        concat_ux,
        dropout_p,
        seed,
        _,
    ) = inputs
    _, saved_y, mean, rstd = output
    ctx.save_for_backward(
        attn,
        u,
        norm_weight,
        norm_bias,
        output_weight,
        saved_y,
        mean,
        rstd,
        seed if seed is not None else rstd.new_empty(0),  # unread without dropout
    )
    ctx.options = (num_heads, group_norm, concat_ux, dropout_p)


def _output_backward(ctx, dout, *unused):  # type: ignore[no-untyped-def]
    *saved, seed = ctx.saved_tensors
    dropout_p = ctx.options[-1]
    d_attn, d_u, dnw, dnb, dw = compute_output_bwd_op(
        dout.contiguous(), *saved, *ctx.options, seed if dropout_p > 0.0 else None
    )
    return (d_attn, d_u, dout, dnw, dnb, None, dw) + (None,) * 6


compute_output_op.register_autograd(_output_backward, setup_context=_setup_output, grad_outputs=1)


def hstu_compute_output(
    attn: torch.Tensor,
    u: torch.Tensor,
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor,
    norm_eps: float,
    output_weight: torch.Tensor,
    num_heads: int,
    linear_dim: int,
    dropout_ratio: float,
    training: bool,
    concat_ux: bool,
    group_norm: bool,
    recompute_y_in_backward: bool,
) -> torch.Tensor:
    """Triton backend of :func:`tzrec_ops.ops.hstu_compute.hstu_compute_output`."""
    dropout = training and dropout_ratio > 0.0
    return compute_output_op(
        switch_to_contiguous_if_needed(attn),
        switch_to_contiguous_if_needed(u),
        switch_to_contiguous_if_needed(x),
        norm_weight,
        norm_bias,
        float(norm_eps),
        output_weight,
        num_heads,
        bool(group_norm),
        bool(concat_ux),
        float(dropout_ratio) if dropout else 0.0,
        dropout_seed(None, x.device) if dropout else None,
        bool(recompute_y_in_backward),
    )[0]
