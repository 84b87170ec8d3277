"""Reference norms: layer/RMS/swish layer norm and the fused norm-multiply-dropout.

Every function computes in float32 (float64 for float64 ``x``) and returns ``x``'s dtype.
Shapes: x, u [L, D]; weight and bias [D] (layer norm) or [H] (group norm, D = H * V).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from tzrec_ops.backends.pytorch._common import compute_dtype


def _to(t: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    return None if t is None else t.to(dtype)


def layer_norm(
    x: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """[L, D] -> [L, D]: ``(x - mean) * rstd * weight + bias`` per row."""
    cd = compute_dtype(x.dtype)
    y = F.layer_norm(x.to(cd), (x.shape[-1],), _to(weight, cd), _to(bias, cd), eps)
    return y.to(x.dtype)


def rms_norm(
    x: torch.Tensor, weight: Optional[torch.Tensor] = None, eps: float = 1e-5
) -> torch.Tensor:
    """[L, D] -> [L, D]: ``x / sqrt(mean(x^2) + eps) * weight`` per row."""
    cd = compute_dtype(x.dtype)
    return F.rms_norm(x.to(cd), (x.shape[-1],), _to(weight, cd), eps).to(x.dtype)


def swish_layer_norm(
    x: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """[L, D] -> [L, D]: ``x * sigmoid(layer_norm(x))``."""
    cd = compute_dtype(x.dtype)
    xc = x.to(cd)
    normed = F.layer_norm(xc, (x.shape[-1],), _to(weight, cd), _to(bias, cd), eps)
    return (xc * torch.sigmoid(normed)).to(x.dtype)


def dropout_keep_mask(
    shape: torch.Size, ratio: float, seed: Optional[int], device: torch.device
) -> torch.Tensor:
    """Boolean mask, true with probability ``1 - ratio``.

    ``seed=None`` draws from torch's default generator of ``device`` (so ``torch.manual_seed``
    reproduces it); an int seeds a private generator, giving the same mask for the same seed.
    """
    if seed is None:
        noise = torch.rand(shape, device=device)
    else:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
        noise = torch.rand(shape, generator=generator, device=device)
    return noise >= ratio


def norm_mul_dropout_compute(
    x: torch.Tensor,
    u: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    dropout_ratio: float,
    training: bool,
    concat_ux: bool,
    seed: Optional[int],
    num_heads: Optional[int],
) -> torch.Tensor:
    """``dropout(u * norm(x))`` (or of ``[u | x | u * norm(x)]``) in the compute dtype.

    ``num_heads=None`` is a layer norm over all D features; otherwise a group norm with
    ``num_heads`` groups of D / H features and one scalar weight and bias per group.
    Returns [L, D], or [L, 3D] with ``concat_ux``; the three parts get independent masks.
    """
    cd = compute_dtype(x.dtype)
    xc, uc = x.to(cd), u.to(cd)
    rows, dim = xc.shape
    if num_heads is None:
        normed = F.layer_norm(xc, (dim,), weight.to(cd), bias.to(cd), eps)
    else:
        grouped = F.layer_norm(
            xc.view(rows, num_heads, dim // num_heads), (dim // num_heads,), eps=eps
        )
        grouped = grouped * weight.to(cd).unsqueeze(-1) + bias.to(cd).unsqueeze(-1)
        normed = grouped.view(rows, dim)
    y = uc * normed
    if concat_ux:
        y = torch.cat([uc, xc, y], dim=1)
    if training and dropout_ratio > 0.0:
        keep = dropout_keep_mask(y.shape, dropout_ratio, seed, y.device)
        y = y * keep.to(cd) * (1.0 / (1.0 - dropout_ratio))
    return y


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
    """[L, D] -> [L, D] (or [L, 3D]): ``dropout(u * layer_norm(x))``, in x's dtype."""
    y = norm_mul_dropout_compute(
        x, u, weight, bias, eps, dropout_ratio, training, concat_ux, seed, None
    )
    return y.to(x.dtype)


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
    """[L, H*V] -> [L, H*V] (or [L, 3HV]): ``dropout(u * group_norm(x))``, in x's dtype."""
    y = norm_mul_dropout_compute(
        x, u, weight, bias, eps, dropout_ratio, training, concat_ux, seed, num_heads
    )
    return y.to(x.dtype)
