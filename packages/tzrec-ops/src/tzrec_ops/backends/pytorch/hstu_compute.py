"""Reference STU building blocks: the input projection (uqvk) and the output projection.

Legend: L = tokens, E = embedding dim, H = heads, A = q/k dim per head, V = value dim per
head. Maths in float32 (float64 for float64 x); outputs in x's dtype.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tzrec_ops.backends.pytorch._common import compute_dtype
from tzrec_ops.backends.pytorch.layer_norm import norm_mul_dropout_compute

Tensors4 = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _normed_uvqk(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor,
    norm_eps: float,
    uvqk_weight: torch.Tensor,
    uvqk_bias: torch.Tensor,
) -> torch.Tensor:
    """[L, E] -> [L, 2H(V + A)]: ``layer_norm(x) @ W + b`` in the compute dtype."""
    normed = _normed(x, norm_weight, norm_bias, norm_eps)
    return _uvqk(normed, uvqk_weight, uvqk_bias)


def _normed(
    x: torch.Tensor, norm_weight: torch.Tensor, norm_bias: torch.Tensor, norm_eps: float
) -> torch.Tensor:
    cd = compute_dtype(x.dtype)
    return F.layer_norm(x.to(cd), (x.shape[1],), norm_weight.to(cd), norm_bias.to(cd), norm_eps)


def _uvqk(normed: torch.Tensor, uvqk_weight: torch.Tensor, uvqk_bias: torch.Tensor) -> torch.Tensor:
    return torch.addmm(uvqk_bias.to(normed.dtype), normed, uvqk_weight.to(normed.dtype))


def _split(
    uvqk: torch.Tensor, num_heads: int, attn_dim: int, hidden_dim: int, dtype: torch.dtype
) -> Tensors4:
    """Columns ``[u | v | q | k]`` -> SiLU(u) [L, HV], q/k [L, H, A], v [L, H, V] views."""
    rows = uvqk.shape[0]
    hv, ha = num_heads * hidden_dim, num_heads * attn_dim
    u = F.silu(uvqk[:, :hv]).to(dtype)
    rest = uvqk[:, hv:].to(dtype)
    v, q, k = torch.split(rest, [hv, ha, ha], dim=1)
    return (
        u,
        q.view(rows, num_heads, attn_dim),
        k.view(rows, num_heads, attn_dim),
        v.view(rows, num_heads, hidden_dim),
    )


def _project(
    normed: torch.Tensor,
    uvqk_weight: torch.Tensor,
    uvqk_bias: torch.Tensor,
    num_heads: int,
    attn_dim: int,
    hidden_dim: int,
    dtype: torch.dtype,
) -> Tensors4:
    return _split(_uvqk(normed, uvqk_weight, uvqk_bias), num_heads, attn_dim, hidden_dim, dtype)


def _whole_chain(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor,
    norm_eps: float,
    num_heads: int,
    attn_dim: int,
    hidden_dim: int,
    uvqk_weight: torch.Tensor,
    uvqk_bias: torch.Tensor,
) -> Tensors4:
    uvqk = _normed_uvqk(x, norm_weight, norm_bias, norm_eps, uvqk_weight, uvqk_bias)
    return _split(uvqk, num_heads, attn_dim, hidden_dim, x.dtype)


def hstu_compute_uqvk(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor,
    norm_eps: float,
    num_heads: int,
    attn_dim: int,
    hidden_dim: int,
    uvqk_weight: torch.Tensor,
    uvqk_bias: torch.Tensor,
    recompute_normed_x_in_backward: bool = False,
    recompute_uvqk_in_backward: bool = False,
) -> Tensors4:
    """x [L, E] -> (SiLU(u) [L, HV], q [L, H, A], k [L, H, A], v [L, H, V]).

    The recompute flags wrap parts of the chain in non-reentrant activation checkpointing
    (only while grad is enabled): normed x, the uvqk product, or both are recomputed in
    backward instead of being saved. Results are bitwise equal to the plain chain.
    """
    remat_normed = recompute_normed_x_in_backward and torch.is_grad_enabled()
    remat_uvqk = recompute_uvqk_in_backward and torch.is_grad_enabled()
    args = (
        x,
        norm_weight,
        norm_bias,
        norm_eps,
        num_heads,
        attn_dim,
        hidden_dim,
        uvqk_weight,
        uvqk_bias,
    )
    if remat_normed and remat_uvqk:
        return checkpoint(_whole_chain, *args, use_reentrant=False)
    if remat_normed:
        uvqk = checkpoint(
            _normed_uvqk,
            x,
            norm_weight,
            norm_bias,
            norm_eps,
            uvqk_weight,
            uvqk_bias,
            use_reentrant=False,
        )
        return _split(uvqk, num_heads, attn_dim, hidden_dim, x.dtype)
    normed = _normed(x, norm_weight, norm_bias, norm_eps)
    proj_args = (normed, uvqk_weight, uvqk_bias, num_heads, attn_dim, hidden_dim, x.dtype)
    if remat_uvqk:
        return checkpoint(_project, *proj_args, use_reentrant=False)
    return _project(*proj_args)


def _output(
    attn: torch.Tensor,
    u: torch.Tensor,
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor,
    norm_eps: float,
    output_weight: torch.Tensor,
    num_heads: Optional[int],
    dropout_ratio: float,
    training: bool,
    concat_ux: bool,
) -> torch.Tensor:
    y = norm_mul_dropout_compute(
        attn,
        u,
        norm_weight,
        norm_bias,
        norm_eps,
        dropout_ratio,
        training,
        concat_ux,
        None,
        num_heads,
    )
    return torch.addmm(x.to(y.dtype), y, output_weight.to(y.dtype)).to(x.dtype)


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
    """[L, E]: ``x + dropout(u * norm(attn)) @ W`` (or of ``[u | attn | u * norm(attn)]``).

    Dropout draws from torch's default generator. With ``recompute_y_in_backward`` (and
    grad enabled) y is recomputed in backward, with the same dropout mask, instead of saved.
    """
    args = (
        attn,
        u,
        x,
        norm_weight,
        norm_bias,
        norm_eps,
        output_weight,
        num_heads if group_norm else None,
        dropout_ratio,
        training,
        concat_ux,
    )
    if recompute_y_in_backward and torch.is_grad_enabled():
        return checkpoint(_output, *args, use_reentrant=False)
    return _output(*args)
