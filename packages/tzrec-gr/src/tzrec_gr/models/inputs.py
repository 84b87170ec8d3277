"""The models' input checks, with errors in the models' own argument names. Serving
(:mod:`tzrec_gr.serving.inputs` and the servers) checks requests with the same functions.

Shapes and dtypes are checked on every call. Values are checked without reading the device
in a steady step:

* lengths (``[B]``) on their host copies (:func:`tzrec_ops.jagged.check_once`): no
  read for CPU tensors or tensors moved with ``tzrec_ops.to_device``, else one read per
  batch, shared with the ops' own checks;
* item ids (``[L]``, too large to copy): when they are on the CPU, or on any device when the
  model was built with ``validate_inputs=True`` (then one device read per call);
* finiteness of float features: only with ``validate_inputs=True``.

Value checks follow ``tzrec_ops``' switch (``TZREC_OPS_VALUE_CHECKS=0`` or
``tzrec_ops.set_value_checks(False)`` turns them off, ``validate_inputs`` included) and are
skipped while ``torch.compile`` / ``torch.export`` trace the model.
"""

from __future__ import annotations

from typing import Optional, TypeVar

import torch

from tzrec_ops.jagged import check_once, first_true, value_checks_enabled

__all__ = [
    "check_appended",
    "check_batch",
    "check_bound",
    "check_finite",
    "check_int_tensor",
    "check_item_ids",
    "check_lengths",
    "check_rows",
]

T = TypeVar("T")


def check_int_tensor(name: str, t: T, ndim: int = 1) -> T:
    """``t`` is an integer tensor of rank ``ndim``; returns it.

    Raises:
        TypeError: ``t`` is not a tensor (as ``tzrec_ops``' checks). ValueError: another
            rank, or a float, complex or bool dtype.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")
    return t


def check_rows(name: str, t: torch.Tensor, rows: int, other: str) -> None:
    """``t`` has one row per row of ``other``."""
    if t.shape[0] != rows:
        raise ValueError(f"{name} has {t.shape[0]} rows but {other} has {rows}; they must match")


def check_bound(name: str, value: Optional[int], built: int) -> int:
    """A call's bound: ``value`` (an int in ``[0, built]``), or ``built`` when None."""
    if value is None:
        return built
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if value > built:
        raise ValueError(
            f"{name} ({value}) must be <= the {name} the model was built with ({built}); "
            f"build the model with a larger {name}"
        )
    return value


def check_lengths(
    name: str, lengths: torch.Tensor, bound: int, bound_name: str, total: int, values_name: str
) -> None:
    """``lengths`` [B]: integers in ``[0, bound]`` summing to ``total``, the rows of
    ``values_name`` (checked on the host copy)."""
    check_int_tensor(name, lengths)

    def check(values: torch.Tensor) -> None:
        if bool((values < 0).any()):
            b = first_true(values < 0)
            raise ValueError(f"{name}[{b}] must be >= 0, got {int(values[b])}")
        if bool((values > bound).any()):
            b = first_true(values > bound)
            raise ValueError(f"{name}[{b}] ({int(values[b])}) must be <= {bound_name} ({bound})")
        if int(values.sum()) != total:
            raise ValueError(
                f"{name} sums to {int(values.sum())} but {values_name} has {total} rows; "
                "they must match"
            )

    check_once(("tzrec_gr.lengths", name, bound, bound_name, total, values_name), (lengths,), check)


def check_appended(
    name: str,
    cached_tokens: torch.Tensor,
    lengths: torch.Tensor,
    per_event: int,
    bound: int,
    bound_name: str,
) -> None:
    """Every user's cached events plus ``lengths[b]`` new ones stay within ``bound``; the
    cache holds ``per_event`` tokens per event (checked on the host copies)."""

    def check(cached: torch.Tensor, new: torch.Tensor) -> None:
        events = cached // per_event + new
        if bool((events > bound).any()):
            b = first_true(events > bound)
            raise ValueError(
                f"user {b} has {int(cached[b]) // per_event} cached events plus {name}[{b}] = "
                f"{int(new[b])} new ones, more than {bound_name} ({bound})"
            )

    key = ("tzrec_gr.appended", name, per_event, bound, bound_name)
    check_once(key, (cached_tokens, lengths), check)


def check_batch(name: str, t: torch.Tensor, batch: int, what: str) -> None:
    """``t.shape[0]`` is the batch size B given by ``what``."""
    if t.shape[0] != batch:
        raise ValueError(
            f"{name} has B = {t.shape[0]} users but {what} has {batch}; they must match"
        )


def check_item_ids(name: str, ids: torch.Tensor, num_items: int, validate_inputs: bool) -> None:
    """Ids in ``[0, num_items)``: on the CPU always, on a device with ``validate_inputs``."""
    if not value_checks_enabled() or ids.numel() == 0:
        return
    if ids.device.type != "cpu" and not validate_inputs:
        return
    bad = (ids < 0) | (ids >= num_items)
    if bool(bad.any()):
        i = first_true(bad.reshape(-1).cpu())
        raise ValueError(
            f"{name} must be in [0, num_items={num_items}), got {name}[{i}] = "
            f"{int(ids.reshape(-1)[i])}"
        )


def check_finite(name: str, t: torch.Tensor, validate_inputs: bool) -> None:
    """No NaN or inf in the float tensor ``t`` (only with ``validate_inputs``)."""
    if not validate_inputs or not value_checks_enabled():
        return
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        row = first_true(bad.reshape(t.shape[0], -1).any(dim=1).cpu())
        raise ValueError(f"{name} has a NaN or inf in row {row}")
