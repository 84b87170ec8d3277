"""``layer_norm``: one compiled kernel for half-precision input, ATen's fused kernel else.

For bfloat16 and float16 the reference upcasts x, normalises and casts back in separate
passes; the compiled graph reads x once, normalises in float32 and writes the input dtype,
in the forward and in the backward. For float32 and float64 ATen's ``layer_norm`` is already
one fused pass, and on a 2-core CPU it beat the compiled graph (forward + backward on
[4096, 128]: 0.39 ms against 0.55 ms, one run), so it is called directly.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

_HALF = (torch.bfloat16, torch.float16)


def _half_layer_norm(
    x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float
) -> torch.Tensor:
    xf = x.float()
    mean = xf.mean(-1, keepdim=True)
    centered = xf - mean
    y = centered * torch.rsqrt((centered * centered).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


_compiled = torch.compile(_half_layer_norm, dynamic=True)


def layer_norm(
    x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float
) -> torch.Tensor:
    """[L, D] -> [L, D] in x's dtype, normalised over D."""
    if x.dtype in _HALF:
        return _compiled(x, weight, bias, float(eps))
    # weight and bias may have another float dtype than x (e.g. float32 parameters)
    weight = None if weight is None else weight.to(x.dtype)
    bias = None if bias is None else bias.to(x.dtype)
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
