"""What the Triton ops' kernels write while traced, checked in the CPU interpreter.

``torch.compile`` decomposes a ``triton_op`` into its kernels; a kernel's written arguments
are functionalized one launch at a time: Inductor clones each over its storage span
(``clone_preserve_strides``) and scatters the result back. A written argument that is a
partial view of a buffer an earlier launch already wrote is, to Inductor, a view of a
computed value that it materializes compactly, so the clone reads past its end: on an H200
the compiled HSTURanking backward died with an illegal memory access in that clone
(``triton_poi_fused_26``, 8,226,304 elements: exactly dq's span as a column view of a
4017 x 2048 ``duvqk``, the attention's dq kernel writing after the dK/dV kernel;
pytorch/pytorch#161115).

Fake tensors cannot run the interpreter, so the ops run eagerly here with ``tracing()``
forced on, taking their traced branches; each launch's written arguments are found by
comparing its tensor arguments' bytes before and after it.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from typing import Any, Dict, List

import torch

if not torch.cuda.is_available():
    # triton.jit decides at decoration time whether a kernel is interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import tzrec_ops  # noqa: E402
from tzrec_ops.contract import OPS, BackendError  # noqa: E402
from tzrec_ops.registry import get_backend  # noqa: E402
from tzrec_ops.testing.op_cases import CASES, as_outputs  # noqa: E402

pytest.importorskip("triton")

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tests run in the Triton interpreter"
)


def _whole(t: torch.Tensor) -> bool:
    """Whether ``t`` covers its storage exactly (no offset, no gaps, nothing beyond)."""
    return (
        t.storage_offset() == 0
        and t.is_contiguous()
        and t.numel() * t.element_size() == t.untyped_storage().nbytes()
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes (NaN in uninitialized memory compares equal to itself)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


class _WriteRecorder:
    """Wraps ``launchable``: runs each launch, notes the tensor arguments it wrote and
    collects the launches that wrote a partial view of a storage an earlier launch wrote."""

    def __init__(self, launchable: Any) -> None:
        self._launchable = launchable
        # storages written so far, kept alive so that no address is reused
        self._written: Dict[int, torch.UntypedStorage] = {}
        self.problems: List[str] = []

    def __call__(self, kernel: Any) -> Any:
        return _Launch(self, kernel)

    def launch(self, kernel: Any, grid: Any, args: tuple, kwargs: dict) -> Any:
        names = list(getattr(kernel, "arg_names", None) or [])
        named = [(names[i] if i < len(names) else f"arg{i}", a) for i, a in enumerate(args)]
        named += list(kwargs.items())
        tensors = [(n, t) for n, t in named if isinstance(t, torch.Tensor) and t.numel() > 0]
        before = [_bits(t).clone() for _, t in tensors]
        result = self._launchable(kernel)[grid](*args, **kwargs)
        wrote = [(n, t) for (n, t), b in zip(tensors, before) if not torch.equal(_bits(t), b)]
        kernel_name = getattr(getattr(kernel, "fn", kernel), "__name__", repr(kernel))
        for name, t in wrote:
            if not _whole(t) and t.untyped_storage().data_ptr() in self._written:
                self.problems.append(
                    f"{kernel_name} writes {name} {list(t.shape)} (strides {list(t.stride())}, "
                    f"offset {t.storage_offset()}), a partial view of a buffer an earlier "
                    f"launch wrote"
                )
        for _, t in wrote:
            storage = t.untyped_storage()
            self._written[storage.data_ptr()] = storage
        return result


class _Launch:
    def __init__(self, recorder: _WriteRecorder, kernel: Any) -> None:
        self._recorder, self._kernel = recorder, kernel

    def __getitem__(self, grid: Any) -> Any:
        return lambda *args, **kwargs: self._recorder.launch(self._kernel, grid, args, kwargs)


@pytest.fixture
def traced_writes(monkeypatch: pytest.MonkeyPatch) -> _WriteRecorder:
    """Every Triton backend module sees ``tracing() == True`` and launches through a
    :class:`_WriteRecorder`."""
    import tzrec_ops.backends.triton as package
    from tzrec_ops.backends.triton import _eager

    recorder = _WriteRecorder(_eager.launchable)
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        if hasattr(module, "tracing"):
            monkeypatch.setattr(module, "tracing", lambda: True)
        if hasattr(module, "launchable"):
            monkeypatch.setattr(module, "launchable", recorder)
    return recorder


@pytest.mark.parametrize("op", [op for op in OPS if op in get_backend("triton").ops])
def test_traced_kernels_never_write_views_of_written_buffers(traced_writes, op):
    """Forward and backward of the op's first case the backend accepts (float32)."""
    spec = OPS[op]
    for case in CASES[op]:
        args = case.build(torch.float32)
        for name in spec.grads:
            value = args.get(name)
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                args[name] = value.detach().requires_grad_(True)
        try:
            result = getattr(tzrec_ops, op)(**args, backend="triton")
        except BackendError:
            continue
        outs = [o for o in as_outputs(result) if o is not None and o.requires_grad]
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        break
    else:
        pytest.skip(f"triton refuses every float32 case of {op}")
    assert not traced_writes.problems, "\n".join(traced_writes.problems)


def test_traced_preprocess_backward_gives_eager_gradients(monkeypatch):
    """The traced branch of the fused preprocess backward (a buffer per gradient, one
    concatenation) gives the eager branch's gradients bit for bit."""
    from tzrec_ops.backends.triton import hstu_compute

    case = next(c for c in CASES["hstu_preprocess_and_attention"])
    spec = OPS["hstu_preprocess_and_attention"]

    def grads(traced: bool) -> List[torch.Tensor]:
        monkeypatch.setattr(hstu_compute, "tracing", lambda: traced)
        args = case.build(torch.float32)
        leaves = []
        for name in spec.grads:
            value = args.get(name)
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                args[name] = value.detach().requires_grad_(True)
                leaves.append(args[name])
        outs = [
            o
            for o in as_outputs(tzrec_ops.hstu_preprocess_and_attention(**args, backend="triton"))
            if o is not None
        ]
        return torch.autograd.grad(outs, leaves, [torch.ones_like(o) for o in outs])

    for got, want in zip(grads(True), grads(False)):
        assert torch.equal(got, want)
