"""No device-to-host sync in a training step of either model, checked on the CPU.

A CUDA sync shows up in the aten ops a step dispatches: ``_local_scalar_dense`` (``.item()``,
``int(t)``, ``bool(t)``, ``if t``), ops whose output size depends on values (``nonzero``,
``masked_select``, boolean-mask indexing, ``repeat_interleave`` without ``output_size``,
``unique``, ``bincount``), ``equal``, and copies to the CPU. On the CPU every tensor is a host
tensor, so :class:`SyncRecorder` tells the two sides apart by where a tensor came from: the
step's inputs, the model's parameters and buffers, and whatever ops compute from them are
"device" tensors; host copies of index tensors (:mod:`tzrec_ops.jagged`: remembered when the
batch was built, and derived by ``mirror`` on the host side) are not. A synchronizing op on a
device tensor is recorded with the Python stack that made it.

The GPU counterpart, ``torch.cuda.set_sync_debug_mode("error")`` on a real step, is in
``test_sync_free.py`` (``-m gpu``); this test runs everywhere, in a second or two.
"""

from __future__ import annotations

import traceback
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Tuple

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from tzrec_ops.jagged import remember_host_copy

aten = torch.ops.aten

# ops that read values back to the host on a GPU, whatever their arguments
_ALWAYS = {
    aten._local_scalar_dense.default,  # .item(), int(t), float(t), bool(t), `if t`
    aten.nonzero.default,
    aten.argwhere.default,
    aten.masked_select.default,
    aten.equal.default,
    aten.bincount.default,
    aten._unique.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.unique_dim_consecutive.default,
}


class Sync(NamedTuple):
    """One synchronizing op: its name, why it syncs, and where it was called from."""

    op: str
    why: str
    stack: Tuple[str, ...]

    def where(self) -> str:
        """The innermost call site in the tzrec packages (``file:line in function``)."""
        return self.stack[-1] if self.stack else "?"

    def __str__(self) -> str:
        return f"{self.op} ({self.why}) at\n    " + "\n    ".join(self.stack[-6:])


def _why(func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[str]:
    """Why ``func(*args, **kwargs)`` syncs when its tensor arguments are on a GPU (None: it
    does not)."""
    if func in _ALWAYS:
        return "reads values"
    packet = func.overloadpacket
    if packet is aten.repeat_interleave and kwargs.get("output_size") is None:
        if func is not aten.repeat_interleave.self_int:  # int repeats: the size is known
            return "repeat_interleave without output_size"
    if packet in (aten.index, aten._unsafe_index, aten.index_put, aten.index_put_):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ()):
            return "boolean-mask indexing"
    if packet in (aten._to_copy, aten.to) and kwargs.get("device") is not None:
        if torch.device(kwargs["device"]).type == "cpu":
            return "copy to the host"
    if packet is aten.copy_ and args[0].device.type == "cpu" and args[1].device.type != "cpu":
        return "copy to the host"
    return None


def _here() -> Tuple[str, ...]:
    """The call stack, frames of the tzrec packages only (innermost last)."""
    return tuple(
        f"{frame.filename.split('/src/')[-1]}:{frame.lineno} in {frame.name}"
        for frame in traceback.extract_stack()[:-3]
        if "/tzrec_" in frame.filename and "/tests/" not in frame.filename
    )


# Tensor methods that read a GPU tensor's values but dispatch no op on a CPU one (there
# ``.cpu()`` returns the tensor itself and ``.tolist()`` reads it directly)
_HOST_METHODS = ("cpu", "tolist", "numpy")


class SyncRecorder(TorchDispatchMode):
    """Records the ops that would sync on a GPU, applied to "device" tensors, and the calls
    of ``Tensor.cpu`` / ``tolist`` / ``numpy`` on them.

    Args:
        device_tensors: the tensors that live on the device (a step's inputs, the model's
            parameters and buffers); everything an op computes from one of them is a device
            tensor too. Tensors built from constants alone (``torch.arange(n)``) are neither:
            on a GPU they are made there without a read.
    """

    def __init__(self, device_tensors: Iterable[torch.Tensor]) -> None:
        super().__init__()
        self._device: WeakIdKeyDictionary = WeakIdKeyDictionary()
        for t in device_tensors:
            self._device[t] = True
        self.syncs: List[Sync] = []
        self._methods: Dict[str, Any] = {}

    def __enter__(self):
        for name in _HOST_METHODS:
            method = self._methods[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._watch(name, method))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, method in self._methods.items():
            setattr(torch.Tensor, name, method)
        return super().__exit__(*exc)

    def _watch(self, name: str, method: Any) -> Any:
        def watched(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if t in self._device:
                self.syncs.append(Sync(f"Tensor.{name}", "copy to the host", _here()))
            return method(t, *args, **kwargs)

        return watched

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        on_device = any(t in self._device for t in inputs)
        why = _why(func, args, kwargs) if on_device else None
        if why is not None:
            self.syncs.append(Sync(str(func.overloadpacket.__name__), why, _here()))
        out = func(*args, **kwargs)
        if on_device and why != "copy to the host":
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self._device[t] = True
        return out


def record_syncs(step, device_tensors: Iterable[torch.Tensor]) -> List[Sync]:
    """The syncs ``step()`` makes (see :class:`SyncRecorder`)."""
    with SyncRecorder(device_tensors) as recorder:
        step()
    return recorder.syncs


def _known(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its values registered as its host copy: what ``tzrec_ops.to_device`` does
    for a batch the data pipeline moves to the GPU."""
    return remember_host_copy(t, t.clone())


def _state(model: torch.nn.Module) -> List[torch.Tensor]:
    return list(model.parameters()) + list(model.buffers())


# -- allow-list: syncs of the CPU only, each with its reason ------------------------------

# check_item_ids checks ids that are on the CPU (free there) and skips device ids unless the
# model was built with validate_inputs=True (documented: one device read per call)
CPU_ONLY = {"check_item_ids": "item ids are checked only when they are on the CPU"}


def _unexpected(syncs: List[Sync]) -> List[Sync]:
    return [s for s in syncs if not any(f" in {name}" in s.where() for name in CPU_ONLY)]


def _ranking_step(interleave: bool):
    from _models import ranking_batch, ranking_model, ranking_user

    model = ranking_model(enable_interleaving=interleave).train()
    batch = ranking_batch([ranking_user(5, 2), ranking_user(3, 3), ranking_user(0, 1)])
    batch = {k: _known(v) if k.endswith("sequence_length") else v for k, v in batch.items()}
    labels = torch.randint(0, 4, (batch["candidate.item_id"].shape[0],))

    def step() -> None:
        model.loss(model(batch), labels).backward()

    return step, [*batch.values(), labels, *_state(model)]


def _retrieval_step():
    from _models import history_user, retrieval_batch, retrieval_model

    model = retrieval_model(dropout_ratio=0.1).train()
    ids, lengths, ts = retrieval_batch([history_user(5), history_user(3), history_user(1)])
    lengths = _known(lengths)

    def step() -> None:
        model.loss(ids, lengths, ts).backward()

    return step, [ids, lengths, ts, *_state(model)]


@pytest.mark.parametrize("interleave", [False, True])
def test_ranking_training_step_makes_no_sync(interleave):
    step, device = _ranking_step(interleave)
    syncs = _unexpected(record_syncs(step, device))
    assert not syncs, "\n".join(map(str, syncs))


def test_retrieval_training_step_makes_no_sync():
    step, device = _retrieval_step()
    syncs = _unexpected(record_syncs(step, device))
    assert not syncs, "\n".join(map(str, syncs))


def test_the_recorder_sees_syncs_on_device_tensors_only():
    """The recorder flags ``.item()``, boolean masks, ``nonzero``, ``repeat_interleave``
    without ``output_size`` and copies to the host, on device tensors and what they make;
    not the same ops on host copies or constants."""
    x = torch.arange(6)
    host = torch.arange(6)

    def step() -> None:
        y = x * 2
        int(y.sum())  # _local_scalar_dense
        y[y > 3]  # boolean-mask index
        torch.nonzero(y)
        torch.repeat_interleave(y[:3], y[:3])
        torch.repeat_interleave(y[:3], y[:3], output_size=6)  # no sync: size given
        y.to("cpu", copy=True)
        y.tolist()
        int(host.sum()) + int((torch.arange(3) * 2).max())  # host tensors: no sync
        host[host > 3]

    ops = [(s.op, s.why) for s in record_syncs(step, [x])]
    assert ops == [
        ("_local_scalar_dense", "reads values"),
        ("index", "boolean-mask indexing"),
        ("nonzero", "reads values"),
        ("repeat_interleave", "repeat_interleave without output_size"),
        ("_to_copy", "copy to the host"),
        ("Tensor.tolist", "copy to the host"),
    ]
