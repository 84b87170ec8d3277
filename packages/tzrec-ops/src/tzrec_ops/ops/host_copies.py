"""Host copies of small index tensors, so a jagged batch is read back at most once.

Value checks (offsets start at 0 and never decrease, lengths within ``max_seq_len``,
``num_targets`` within its sequence) and host-side sizes (a total token count) need the
*values* of small index tensors: offsets ``[B + 1]``, lengths and ``num_targets`` ``[B]``.
Reading a device tensor's values costs a device-to-host sync. This module keeps one CPU
copy per tensor, keyed on the tensor object and its version counter, so that:

* every op and layer that sees the same tensor reuses one copy (one read per batch, not
  one per op call), and the checks it passed are remembered with it;
* a tensor the caller moved from the CPU with :func:`to_device` costs no read at all;
* index tensors a module derives from known ones (offsets from lengths, a truncation
  plan, an extended KV cache) get their copies by running the same function on the host
  (:func:`mirror`), again without a read.

An in-place change of a tensor bumps its version counter, which drops its copy. Inference
tensors (made under ``torch.inference_mode``) have no version counter: changing one in
place after it was checked is not noticed, so build a new tensor instead.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch
from torch.utils.weak import WeakIdKeyDictionary

from tzrec_ops.ops.utils import tracing

__all__ = [
    "HostCopy",
    "host_copies",
    "host_copy",
    "known_host_copy",
    "mirror", "remember_host_copy", "to_device"]


class HostCopy:
    """A CPU int64 copy of one index tensor and the value checks it has passed.

    Attributes:
        values: the copy (never the tensor itself, never changed).
        passed: keys of the checks these values passed (see
            :func:`tzrec_ops.ops.validation.check_once`).
    """

    __slots__ = ("values", "version", "passed", "_stats")

    def __init__(self, values: torch.Tensor, version: int) -> None:
        self.values = values
        self.version = version
        self.passed: set = set()
        self._stats: Dict[str, Any] = {}

    def stat(self, name: str, compute: Callable[[torch.Tensor], Any]) -> Any:
        """``compute(values)``, computed once per copy (e.g. a length total or maximum)."""
        if name not in self._stats:
            self._stats[name] = compute(self.values)
        return self._stats[name]


_copies: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _version(t: torch.Tensor) -> int:
    # inference tensors carry no version counter (see the module docstring)
    return -1 if t.is_inference() else t._version


def _snapshot(values: torch.Tensor) -> torch.Tensor:
    return values.detach().to(device="cpu", dtype=torch.int64, copy=True)


def known_host_copy(t: torch.Tensor) -> Optional[HostCopy]:
    """The current host copy of ``t`` if one is known (never reads the device)."""
    record = _copies.get(t)
    if record is not None and record.version == _version(t):
        return record
    return None


def host_copy(t: torch.Tensor) -> HostCopy:
    """The host copy of ``t``: the known one, or a new one (one sync if ``t`` is on a device)."""
    record = known_host_copy(t)
    if record is None:
        record = HostCopy(_snapshot(t), _version(t))
        _copies[t] = record
    return record


def host_copies(tensors: Sequence[Optional[torch.Tensor]]) -> List[Optional[HostCopy]]:
    """:func:`host_copy` of each tensor (``None`` stays ``None``); the unknown copies of
    device tensors are read together, in one device-to-host transfer."""
    records: List[Optional[HostCopy]] = [
        None if t is None else known_host_copy(t) for t in tensors
    ]
    missing = [i for i, t in enumerate(tensors) if t is not None and records[i] is None]
    on_device = [i for i in missing if tensors[i].device.type != "cpu"]
    if len(on_device) > 1:
        flat = torch.cat([tensors[i].detach().reshape(-1).to(torch.int64) for i in on_device])
        parts = flat.cpu().split([tensors[i].numel() for i in on_device])
        for i, part in zip(on_device, parts):
            records[i] = HostCopy(part.reshape(tensors[i].shape), _version(tensors[i]))
            _copies[tensors[i]] = records[i]
    for i in missing:
        if records[i] is None:
            records[i] = host_copy(tensors[i])
    return records


def remember_host_copy(t: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Record that ``t`` holds ``values`` (a CPU tensor of the same shape); returns ``t``.

    For a tensor the caller built from CPU data: the checks then read ``values`` instead
    of ``t``. ``values`` is copied, so changing it later does not change the record.
    """
    if tuple(values.shape) != tuple(t.shape):
        raise ValueError(
            f"values must have t's shape {tuple(t.shape)}, got {tuple(values.shape)}"
        )
    _copies[t] = HostCopy(_snapshot(values), _version(t))
    return t


def to_device(
    t: torch.Tensor, device: Union[torch.device, str], non_blocking: bool = True
) -> torch.Tensor:
    """Move a CPU index tensor (offsets, lengths, ``num_targets``) to ``device``, keeping
    its values on the host so that checking the moved tensor needs no device read.

    Example::

        seq_offsets = tzrec_ops.to_device(offsets_from_the_loader, "cuda")
        hstu_mha(..., seq_offsets=seq_offsets)   # checked without a device-to-host sync
    """
    moved = t.to(device, non_blocking=non_blocking)
    if moved is not t:
        remember_host_copy(moved, t)
    return moved


Result = Union[torch.Tensor, Sequence[Any], None]


def mirror(fn: Callable[..., Result], *args: Any, **kwargs: Any) -> Result:
    """``fn(*args, **kwargs)``; when every tensor argument has a known host copy, also run
    ``fn`` on the copies and remember each tensor result's copy.

    ``fn`` must be plain torch code whose integer results do not depend on the device
    (e.g. offsets from lengths, or an index plan). Arguments that are not tensors
    (ints, ``None``) are passed to both runs unchanged. While tracing, only ``fn`` runs
    (traced tensors have no values, and the lookups would break the graph).
    """
    out = fn(*args, **kwargs)
    if tracing():
        return out
    host_args = [_host_arg(a) for a in args]
    host_kwargs = {k: _host_arg(v) for k, v in kwargs.items()}
    if any(a is _UNKNOWN for a in host_args) or any(v is _UNKNOWN for v in host_kwargs.values()):
        return out
    host_out = fn(*host_args, **host_kwargs)
    if isinstance(out, torch.Tensor):
        remember_host_copy(out, host_out)
    elif isinstance(out, (tuple, list)):
        for device_value, host_value in zip(out, host_out):
            if isinstance(device_value, torch.Tensor):
                remember_host_copy(device_value, host_value)
    return out


_UNKNOWN = object()


def _host_arg(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    record = known_host_copy(value)
    return _UNKNOWN if record is None else record.values
