"""The bad-input matrix: every public op that takes a jagged batch, on every backend,
rejects each kind of bad jagged input with an error naming the argument, before any
backend implementation is looked up (so before any kernel runs).

Each op is called on one tiny good batch (lengths [2, 3], num_targets [1, 1]) with one
argument spoiled. The backend lookups are replaced by a function that fails the test, so
a check that came after the lookup, or only inside a backend, shows up as a failure. The
backend axis holds ``pytorch``, ``triton`` (the CPU interpreter here) and a third-party
backend record that implements every op. The matrix itself is
:mod:`tzrec_ops.testing.bad_inputs` (the conformance suite runs it for any backend).
"""

from __future__ import annotations

import os
from typing import Any, List, Tuple

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tzrec_ops.ops.validation import set_value_checks  # noqa: E402
from tzrec_ops.registry import Backend, get_backend  # noqa: E402
from tzrec_ops.testing.bad_inputs import (  # noqa: E402
    CASES,
    OpCase,
    assert_rejected_first,
    forbid_backends,
)

OPS = CASES
CPU = torch.device("cpu")

def _never_run(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("a backend implementation was reached")


THIRD_PARTY = Backend(
    name="third_party",
    priority=-100,
    ops={op: f"{__name__}:_never_run" for case in OPS.values() for op, _ in case.needs},
    description="a plugin implementing every op of the matrix",
)
BACKENDS = ("pytorch", "triton", "third_party")
# the (op, backend) pairs whose path the backend does not implement: the registry must say so
NOT_IMPLEMENTED = {
    ("preprocess_and_attention_fused", "pytorch"),  # no fused op: it runs unfused
    ("hstu_mha_sla", "triton"),  # no arbitrary masks
}


def _backend_ids(case: OpCase) -> Tuple[str, ...]:
    return BACKENDS if case.module is None else ("no backend",)


def _matrix() -> List[Any]:
    return [
        pytest.param(op, backend, defect, id=f"{op}-{backend}-{defect}")
        for op, case in OPS.items()
        for backend in _backend_ids(case)
        for defect in case.defects
    ]


def _request(backend: str) -> Any:
    if backend == "third_party":
        return THIRD_PARTY
    return None if backend == "no backend" else backend


def _skip_unless_implemented(op: str, backend: str, device: torch.device = CPU) -> None:
    """Skip where the backend does not implement this path, after asserting that the
    registry says so (and only for the expected pairs)."""
    if backend not in ("pytorch", "triton"):
        return
    record = get_backend(backend)
    if record.unavailable_reason() is not None:
        pytest.skip(f"{backend} is unavailable here: {record.unavailable_reason()}")
    call = {"device": device, "dtype": torch.float32}
    reasons = [record.rejection(name, {**call, **options}) for name, options in OPS[op].needs]
    rejected = [r for r in reasons if r is not None]
    assert bool(rejected) == ((op, backend) in NOT_IMPLEMENTED), rejected
    if rejected:
        pytest.skip(f"{backend} does not implement this path: {rejected[0]}")


@pytest.fixture(autouse=True)
def _value_checks_on():
    set_value_checks(True)
    yield
    set_value_checks(None)


def _assert_rejected_first(op, backend, defect, monkeypatch, device: torch.device) -> None:
    _skip_unless_implemented(op, backend, device)
    assert_rejected_first(op, _request(backend), defect, monkeypatch, device)


@pytest.mark.parametrize("op,backend,defect", _matrix())
def test_bad_jagged_input_is_rejected_first(op, backend, defect, monkeypatch):
    _assert_rejected_first(op, backend, defect, monkeypatch, CPU)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("op,backend,defect", _matrix())
def test_gpu_bad_jagged_input_is_rejected_first(op, backend, defect, monkeypatch):
    """The same matrix with the batch on the GPU: index tensors are read from the device
    (the host-copy path), and the real Triton backend is the one being protected."""
    _assert_rejected_first(op, backend, defect, monkeypatch, torch.device("cuda"))


@pytest.mark.parametrize(
    "op,backend",
    [
        pytest.param(op, backend, id=f"{op}-{backend}")
        for op, case in OPS.items()
        for backend in _backend_ids(case)
    ],
)
def test_good_batch_reaches_the_backend_lookup(op, backend, monkeypatch):
    """The unspoiled batch passes every check, so each defect above is what was rejected."""
    _skip_unless_implemented(op, backend)
    case = OPS[op]
    forbid_backends(monkeypatch, case)
    with pytest.raises(AssertionError, match="before the arguments were checked"):
        case.call(case.good(), _request(backend))
