"""Argument checks shared by every public op.

Every message names the argument, what was expected and what was given, and every check runs
in the public op, before a backend is chosen, so no backend can be reached with bad input.
Shape, dtype and device checks always run. Checks on the *values* of index tensors (offsets
start at 0, never decrease and end at the token count; lengths within ``max_seq_len``;
``num_targets`` within its sequence) read host copies of those tensors
(:mod:`tzrec_ops.ops.host_copies`): one device-to-host transfer per batch at most, none for
tensors moved with :func:`~tzrec_ops.jagged.to_device`, and a check the same
tensors passed before is not run again. They run in eager mode unless
``TZREC_OPS_VALUE_CHECKS=0`` is set or :func:`set_value_checks` turned them off, and never
while ``torch.compile``/``torch.export``/FX traces the call.
"""

from __future__ import annotations

import numbers
import os
from typing import Any, Callable, Hashable, Optional, Sequence, Tuple

import torch

from tzrec_ops.ops.host_copies import host_copies
from tzrec_ops.ops.utils import tracing

VALUE_CHECKS_ENV = "TZREC_OPS_VALUE_CHECKS"
_OFFSET_DTYPES = (torch.int32, torch.int64)
_value_checks_override: Optional[bool] = None


def set_value_checks(enabled: Optional[bool]) -> None:
    """Turn the value checks on or off for this process (``None``: follow the env var)."""
    global _value_checks_override
    _value_checks_override = enabled


def value_checks_enabled() -> bool:
    if tracing():
        return False
    if _value_checks_override is not None:
        return _value_checks_override
    return os.environ.get(VALUE_CHECKS_ENV, "1") not in ("0", "false", "no")


def check_int(name: str, value: Any) -> None:
    """``value`` is an int (a ``torch.SymInt`` while tracing), not a bool or a float."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, torch.SymInt)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")


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


def check_once(
    key: Hashable, tensors: Sequence[Optional[torch.Tensor]], check: Callable[..., None]
) -> None:
    """Run ``check`` on the host copies of ``tensors`` (``None`` stays ``None``), unless
    these very copies already passed the check ``key``; a no-op when value checks are off.

    ``key`` must hold every other input of ``check`` (names, bounds, totals). Unknown
    copies of device tensors are read in one device-to-host transfer.
    """
    if not value_checks_enabled():
        return
    copies = host_copies(tensors)
    first = next(c for c in copies if c is not None)
    full_key = (key, *(c for c in copies if c is not first))
    if full_key in first.passed:
        return
    check(*(None if c is None else c.values for c in copies))
    # one combination per check: offsets kept across batches with new num_targets each
    # step must not pile up every old num_targets copy
    first.passed.difference_update([k for k in first.passed if k[0] == key])
    first.passed.add(full_key)


def first_true(mask: torch.Tensor) -> int:
    """The index of the first true entry of a 1-D host ``mask`` (for error messages)."""
    return int(mask.nonzero()[0, 0])


def check_jagged(
    offsets_name: str,
    offsets: torch.Tensor,
    *,
    total: Optional[int],
    total_what: str = "the number of tokens",
    max_seq_len: Optional[int] = None,
    max_name: str = "max_seq_len",
    appended: int = 0,
    min_length: int = 0,
    min_length_why: str = "",
    num_targets: Optional[torch.Tensor] = None,
    targets_factor: int = 1,
    targets_reserve: int = 0,
    targets_reserve_why: str = "",
) -> None:
    """The values of a jagged batch's offsets (and ``num_targets``), checked once per batch.

    Offsets start at 0, never decrease and end at ``total`` (``None``: the op does not know
    the token count); every length plus ``appended`` is at most ``max_seq_len`` (the
    argument ``max_name``) and at least ``min_length``; ``num_targets[b]`` is >= 0 and
    ``targets_factor * num_targets[b] + targets_reserve <= length[b]``. Shapes, dtypes and
    devices must have been checked already. Raises ``ValueError`` naming the argument, the
    expected value and the first offending entry.
    """
    key = (
        "jagged",
        offsets_name,
        total,
        total_what,
        max_seq_len,
        max_name,
        appended,
        min_length,
        min_length_why,
        targets_factor,
        targets_reserve,
        targets_reserve_why,
    )

    def check(o: torch.Tensor, targets: Optional[torch.Tensor]) -> None:
        name = offsets_name
        if o[0] != 0:
            raise ValueError(f"{name}[0] must be 0, got {int(o[0])}")
        lengths = o[1:] - o[:-1]
        if bool((lengths < 0).any()):
            b = first_true(lengths < 0)
            raise ValueError(
                f"{name} must be non-decreasing, got {name}[{b + 1}] = {int(o[b + 1])} < "
                f"{name}[{b}] = {int(o[b])}"
            )
        if total is not None and o[-1] != total:
            raise ValueError(f"{name}[-1] must equal {total_what} ({total}), got {int(o[-1])}")
        full = lengths + appended
        plus = f" + {appended} new tokens" if appended else ""
        if max_seq_len is not None and bool((full > max_seq_len).any()):
            b = first_true(full > max_seq_len)
            raise ValueError(
                f"every sequence length ({name}[b + 1] - {name}[b]{plus}) must be <= "
                f"{max_name} ({max_seq_len}), got {int(full[b])} for sequence {b}"
            )
        if min_length > 0 and bool((full < min_length).any()):
            b = first_true(full < min_length)
            raise ValueError(
                f"every sequence length ({name}[b + 1] - {name}[b]{plus}) must be >= "
                f"{min_length} ({min_length_why}), got {int(full[b])} for sequence {b}"
            )
        if targets is None:
            return
        if bool((targets < 0).any()):
            b = first_true(targets < 0)
            raise ValueError(f"num_targets must be >= 0, got num_targets[{b}] = {int(targets[b])}")
        need = targets_factor * targets + targets_reserve
        if bool((need > full).any()):
            b = first_true(need > full)
            times = f"{targets_factor} * " if targets_factor != 1 else ""
            reserve = f" + {targets_reserve} ({targets_reserve_why})" if targets_reserve else ""
            raise ValueError(
                f"{times}num_targets[b]{reserve} must be <= the length of sequence b "
                f"({name}[b + 1] - {name}[b]{plus}), got num_targets[{b}] = "
                f"{int(targets[b])} for a length of {int(full[b])}"
            )

    check_once(key, (offsets, num_targets), check)
