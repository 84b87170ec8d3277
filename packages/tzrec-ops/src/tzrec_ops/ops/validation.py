"""Argument checks shared by every public op.

Every message names the argument, what was expected and what was given. Shape, dtype and
device checks always run (they cost nothing on the device). Checks on tensor *values*
(offsets monotonic and ending at the token count, lengths non-negative, ``num_targets`` not
longer than its sequence) need one device-to-host copy per call; they run in eager mode unless
``TZREC_OPS_VALUE_CHECKS=0`` is set or :func:`set_value_checks` turned them off, and never
while ``torch.compile``/``torch.export``/FX traces the call.
"""

from __future__ import annotations

import os
from typing import List, Optional, Sequence, Tuple

import torch

VALUE_CHECKS_ENV = "TZREC_OPS_VALUE_CHECKS"
_OFFSET_DTYPES = (torch.int32, torch.int64)
_value_checks_override: Optional[bool] = None


def set_value_checks(enabled: Optional[bool]) -> None:
    """Turn the value checks on or off for this process (``None``: follow the env var)."""
    global _value_checks_override
    _value_checks_override = enabled


def tracing() -> bool:
    """True while torch.compile, torch.export or FX symbolic tracing runs the code."""
    return torch.compiler.is_compiling() or torch.fx._symbolic_trace.is_fx_symbolic_tracing()


def value_checks_enabled() -> bool:
    if tracing():
        return False
    if _value_checks_override is not None:
        return _value_checks_override
    return os.environ.get(VALUE_CHECKS_ENV, "1") not in ("0", "false", "no")


def check_tensor(
    name: str,
    t: torch.Tensor,
    ndim: Optional[int] = None,
    dtypes: Optional[Sequence[torch.dtype]] = None,
) -> None:
    """``t`` is a tensor of rank ``ndim`` with a dtype in ``dtypes``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(
            f"{name} must be {ndim}-D, got {t.dim()}-D with shape {tuple(t.shape)}"
        )
    if dtypes is not None and t.dtype not in dtypes:
        allowed = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must be {allowed}, got {t.dtype}")


def check_dim(name: str, t: torch.Tensor, dim: int, expected: int, what: str) -> None:
    """``t.shape[dim] == expected``; ``what`` says where ``expected`` comes from."""
    if t.shape[dim] != expected:
        raise ValueError(
            f"{name}.shape[{dim}] ({t.shape[dim]}) must equal {what} ({expected})"
        )


def check_same_dtype(*named: Tuple[str, torch.Tensor]) -> None:
    first_name, first = named[0]
    for name, t in named[1:]:
        if t.dtype != first.dtype:
            raise TypeError(
                f"{name} has dtype {t.dtype} but {first_name} has {first.dtype}; they must match"
            )


def check_same_device(*named: Tuple[str, Optional[torch.Tensor]]) -> None:
    present = [(n, t) for n, t in named if t is not None]
    first_name, first = present[0]
    for name, t in present[1:]:
        if t.device != first.device:
            raise ValueError(
                f"{name} is on {t.device} but {first_name} is on {first.device}; "
                "all tensors must be on one device"
            )


def check_non_negative(name: str, value: float) -> None:
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def check_positive(name: str, value: float) -> None:
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")


def check_offsets(name: str, offsets: torch.Tensor, batch: Optional[int] = None) -> None:
    """Shape and dtype of a ``[B + 1]`` offsets tensor (values: :func:`check_values`)."""
    check_tensor(name, offsets, ndim=1, dtypes=_OFFSET_DTYPES)
    if offsets.numel() < 1:
        raise ValueError(f"{name} must have B + 1 >= 1 entries, got an empty tensor")
    if batch is not None and offsets.numel() != batch + 1:
        raise ValueError(
            f"{name} must have B + 1 = {batch + 1} entries, got {offsets.numel()}"
        )


class ValueChecks:
    """Collects value conditions on the device and verifies them with one host sync.

    Example::

        checks = ValueChecks()
        checks.offsets("seq_offsets", seq_offsets, total=q.shape[0])
        checks.run()
    """

    def __init__(self) -> None:
        self._conditions: List[torch.Tensor] = []
        self._messages: List[str] = []
        self.enabled = value_checks_enabled()

    def require(self, condition: torch.Tensor, message: str) -> None:
        """Record that every element of boolean ``condition`` must be true."""
        if self.enabled:
            self._conditions.append(condition.all().reshape(1))
            self._messages.append(message)

    def offsets(self, name: str, offsets: torch.Tensor, total: int) -> None:
        """Offsets start at 0, never decrease, and end at ``total``."""
        if not self.enabled:
            return
        self.require(offsets[:1] == 0, f"{name}[0] must be 0")
        self.require(
            offsets[1:] >= offsets[:-1], f"{name} must be non-decreasing (a length is negative)"
        )
        self.require(
            offsets[-1:] == total, f"{name}[-1] must equal the number of tokens ({total})"
        )

    def run(self) -> None:
        """Raise ``ValueError`` with every violated condition's message."""
        if not self._conditions:
            return
        ok = torch.cat(self._conditions).to(torch.bool).cpu().tolist()
        failed = [m for m, good in zip(self._messages, ok) if not good]
        if failed:
            raise ValueError("; ".join(failed))
