"""Row normalisations and the STU's fused ``norm(x) * u`` followed by dropout.

Legend: L = rows (tokens), D = features, H = heads (groups), V = D / H.
x is [L, D]; weight and bias may have any float dtype (e.g. float32 parameters with bf16
activations); outputs have x's dtype.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from tzrec_ops.ops.validation import (
    check_dim,
    check_non_negative,
    check_positive,
    check_same_device,
    check_tensor,
)
from tzrec_ops.registry import Backend, select_backend

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
BackendArg = Union[str, Backend, None]


def check_norm_input(
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    eps: float,
    param_size: Optional[int] = None,
    names: tuple = ("x", "weight", "bias"),
) -> None:
    """x is float [L, D]; weight/bias (when given) are float [param_size or D]; eps >= 0."""
    x_name, w_name, b_name = names
    check_tensor(x_name, x, ndim=2, dtypes=FLOATS)
    size = x.shape[1] if param_size is None else param_size
    what = f"{x_name}.shape[1]" if param_size is None else "num_heads"
    for name, t in ((w_name, weight), (b_name, bias)):
        if t is not None:
            check_tensor(name, t, ndim=1, dtypes=FLOATS)
            check_dim(name, t, 0, size, what)
    check_same_device((x_name, x), (w_name, weight), (b_name, bias))
    check_non_negative("eps", eps)


def check_dropout(dropout_ratio: float, seed: Optional[int] = None) -> None:
    """0 <= dropout_ratio < 1, and seed is None or an int in [0, 2**63)."""
    if not 0.0 <= dropout_ratio < 1.0:
        raise ValueError(f"dropout_ratio must be in [0, 1), got {dropout_ratio}")
    if seed is not None and (
        isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63
    ):
        raise ValueError(f"seed must be None or an int in [0, 2**63), got {seed!r}")


def _require_affine(weight: Optional[torch.Tensor], bias: Optional[torch.Tensor]) -> None:
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None:
            raise TypeError(f"{name} must be a torch.Tensor, got None")


def _check_mul_input(x: torch.Tensor, u: torch.Tensor) -> None:
    check_tensor("u", u, ndim=2, dtypes=FLOATS)
    if u.shape != x.shape:
        raise ValueError(f"u must have x's shape {list(x.shape)}, got {list(u.shape)}")
    if u.dtype != x.dtype:
        raise TypeError(f"u has dtype {u.dtype} but x has {x.dtype}; they must match")
    check_same_device(("x", x), ("u", u))


def _run_mul_dropout(op: str, backend: BackendArg, **args: Any) -> torch.Tensor:
    """Run ``layer_norm_mul_dropout`` or ``group_norm_mul_dropout`` on the backend selected
    for the call, whose ``supports`` check sees the dropout in effect and ``concat_ux``.
    ``args`` are the op's declared arguments, already checked, in the declared order."""
    impl = select_backend(
        op,
        backend,
        device=args["x"].device,
        dtype=args["x"].dtype,
        dropout_ratio=args["dropout_ratio"] if args["training"] else 0.0,
        concat_ux=args["concat_ux"],
    )
    return impl(**args)


def layer_norm(
    x: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
    *,
    backend: BackendArg = None,
) -> torch.Tensor:
    """Layer norm over the last dimension: [L, D] -> [L, D].

    ``weight=None``/``bias=None`` mean no scale / no shift.
    """
    check_norm_input(x, weight, bias, eps)
    impl = select_backend("layer_norm", backend, device=x.device, dtype=x.dtype)
    return impl(x=x, weight=weight, bias=bias, eps=eps)


def rms_norm(
    x: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
    *,
    backend: BackendArg = None,
) -> torch.Tensor:
    """RMS norm over the last dimension: ``x / sqrt(mean(x^2) + eps) * weight``, [L, D]."""
    check_norm_input(x, weight, None, eps)
    impl = select_backend("rms_norm", backend, device=x.device, dtype=x.dtype)
    return impl(x=x, weight=weight, eps=eps)


def swish_layer_norm(
    x: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
    *,
    backend: BackendArg = None,
) -> torch.Tensor:
    """``x * sigmoid(layer_norm(x, weight, bias))``: [L, D] -> [L, D]."""
    check_norm_input(x, weight, bias, eps)
    impl = select_backend("swish_layer_norm", backend, device=x.device, dtype=x.dtype)
    return impl(x=x, weight=weight, bias=bias, eps=eps)


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
    *,
    backend: BackendArg = None,
) -> torch.Tensor:
    """``y = u * layer_norm(x)``, then ``[u | x | y]`` with ``concat_ux``, then dropout.

    Args:
        x, u: [L, D], one dtype.
        weight, bias: [D].
        dropout_ratio: in [0, 1); applied (with 1 / (1 - p) scaling) only when ``training``.
            With ``concat_ux`` the u, x and y parts get independent masks.
        seed: the dropout seed. The same seed gives the same mask on one backend and device;
            ``None`` draws from torch's default generator.

    Returns:
        [L, D], or [L, 3D] with ``concat_ux``, in x's dtype.
    """
    _require_affine(weight, bias)
    check_norm_input(x, weight, bias, eps)
    _check_mul_input(x, u)
    check_dropout(dropout_ratio, seed)
    return _run_mul_dropout(
        "layer_norm_mul_dropout",
        backend,
        x=x, u=u, weight=weight, bias=bias, eps=eps, dropout_ratio=dropout_ratio,
        training=training, concat_ux=concat_ux, seed=seed,
    )


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
    *,
    backend: BackendArg = None,
) -> torch.Tensor:
    """Like :func:`layer_norm_mul_dropout` with a group norm: x viewed as [L, H, V] is
    normalised over V per head, and weight/bias [H] hold one scale and shift per head.

    Returns:
        [L, H*V], or [L, 3*H*V] with ``concat_ux``, in x's dtype.
    """
    check_positive("num_heads", num_heads)
    check_tensor("x", x, ndim=2, dtypes=FLOATS)
    if x.shape[1] % num_heads != 0:
        raise ValueError(f"x.shape[1] ({x.shape[1]}) must be a multiple of num_heads ({num_heads})")
    _require_affine(weight, bias)
    check_norm_input(x, weight, bias, eps, param_size=num_heads)
    _check_mul_input(x, u)
    check_dropout(dropout_ratio, seed)
    return _run_mul_dropout(
        "group_norm_mul_dropout",
        backend,
        x=x, u=u, weight=weight, bias=bias, eps=eps, dropout_ratio=dropout_ratio,
        training=training, num_heads=num_heads, concat_ux=concat_ux, seed=seed,
    )
