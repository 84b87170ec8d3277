"""Checking a backend against the float64 oracle: :func:`assert_close` applies the per-dtype
tolerances of :mod:`tzrec_ops.tolerances` (the table and its rule, re-exported here)."""

from __future__ import annotations

from typing import Optional

import torch

from tzrec_ops.tolerances import (  # noqa: F401 (re-exported for the tests)
    BACKWARD,
    FORWARD,
    TF32,
    Tolerance,
    tolerance,
    torch_tolerance,
)

__all__ = ["Tolerance", "assert_close", "tolerance", "torch_tolerance"]


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    dtype: Optional[torch.dtype] = None,
    grad: bool = False,
    name: str = "tensor",
) -> None:
    """Check ``actual`` (a backend run in ``dtype``, default ``actual.dtype``) against the
    float64 ``expected`` with the rule in the module docstring; the message names ``name``."""
    dtype = actual.dtype if dtype is None else dtype
    if actual.shape != expected.shape:
        raise AssertionError(
            f"{name}: shape {tuple(actual.shape)} differs from the oracle's {tuple(expected.shape)}"
        )
    atol, rtol = torch_tolerance(expected, dtype, grad)
    torch.testing.assert_close(
        actual.detach().to(torch.float64),
        expected.detach().to(torch.float64),
        atol=atol,
        rtol=rtol,
        msg=lambda m: f"{name} ({dtype}, {'grad' if grad else 'forward'} tolerance): {m}",
    )
