"""The conformance suite: one definition of "correct" for every tzrec-ops backend.

For each op the backend under test declares (its ``Backend.ops``):

* ``test_implementation_matches_the_declaration``: the implementation's parameters are the
  op's declared ones, by name and order, passable by keyword, with the public op's defaults
  and annotations where it gives any (:func:`tzrec_ops.contract.check_implementation`; the
  registry skips an implementation whose parameters differ, this test also holds the type
  hints to the public op's).
* ``test_matches_float64_oracle``: forward and backward of every case of
  :mod:`tzrec_ops.testing.op_cases` (jagged edge cases, every call option) in float32 and
  bfloat16 against the float64 oracle, with :mod:`tzrec_ops.testing.tolerances`. A call the
  backend refuses must raise :class:`tzrec_ops.BackendError` with a reason (reported as a
  skip); a call it accepts must match: a refusal, never a wrong answer.
* ``test_bad_input_never_reaches_the_backend``: the bad-input matrix
  (:mod:`tzrec_ops.testing.bad_inputs`) with the backend requested by name.
* ``test_compiles_with_fullgraph``: ``torch.compile(fullgraph=True)`` traces the op's first
  accepted case and gives the eager result.
* ``test_opcheck_registered_ops``: ``torch.library.opcheck`` on every custom
  (``torch.library``) op the backend runs in that case's forward and backward.

Run it through the pytest plugin (``pytest_plugins = ["tzrec_ops.testing.conformance"]`` in a
conftest, then ``pytest --tzrec-backend NAME``), or import its tests into a test module
(``from tzrec_ops.testing.conformance_suite import *``) that sets ``CONFORMANCE_BACKENDS``.
Tensors go to ``--tzrec-device`` (default: CUDA when available, else the CPU).
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import pytest
import torch

import tzrec_ops
from tzrec_ops.contract import OPS, BackendError, check_implementation
from tzrec_ops.registry import get_backend
from tzrec_ops.testing import bad_inputs
from tzrec_ops.testing.op_cases import CASES, Case, as_outputs, float64_copies
from tzrec_ops.testing.tolerances import assert_close

DTYPES = (torch.float32, torch.bfloat16)
# opcheck's checks that need no compiler; the AOT-dispatch one compiles (GPU runs only)
_CPU_OPCHECKS = ("test_schema", "test_autograd_registration", "test_faketensor")
_ALL_OPCHECKS = (*_CPU_OPCHECKS, "test_aot_dispatch_dynamic")

__all__ = [
    "pytest_generate_tests",
    "test_bad_input_never_reaches_the_backend",
    "test_compiles_with_fullgraph",
    "test_implementation_matches_the_declaration",
    "test_matches_float64_oracle",
    "test_opcheck_registered_ops",
]


def _backends(config: Any, module: Any) -> List[str]:
    """A test module that imports the suite names its backends (``CONFORMANCE_BACKENDS``);
    the suite module itself, added by the plugin, runs the ``--tzrec-backend`` ones."""
    if hasattr(module, "CONFORMANCE_BACKENDS"):
        return list(module.CONFORMANCE_BACKENDS)
    return list(config.getoption("tzrec_backend", default=None) or [])


def _device(config: Any) -> torch.device:
    name = config.getoption("tzrec_device", default=None)
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _declared(backend: str) -> List[str]:
    """The declared ops ``backend`` implements, in declaration order."""
    ops = get_backend(backend).ops
    unknown = sorted(set(ops) - set(OPS))
    if unknown:
        raise AssertionError(f"backend {backend!r} names undeclared ops: {unknown}")
    return [op for op in OPS if op in ops]


def _oracle_params(name: str, device: torch.device) -> List[Any]:
    return [
        pytest.param(name, device, case, dtype, id=f"{name}-{op}-{case.name}-{str(dtype)[6:]}")
        for op in _declared(name)
        for case in CASES[op]
        for dtype in DTYPES
    ]


def _bad_input_params(name: str, device: torch.device) -> List[Any]:
    """The matrix's op paths whose backend ops ``name`` all implements."""
    ops = get_backend(name).ops
    return [
        pytest.param(name, device, path, defect, id=f"{name}-{path}-{defect}")
        for path, bad in bad_inputs.CASES.items()
        if bad.needs and all(need in ops for need, _ in bad.needs)
        for defect in bad.defects
    ]


def _op_params(name: str, device: torch.device) -> List[Any]:
    return [pytest.param(name, device, op, id=f"{name}-{op}") for op in _declared(name)]


def pytest_generate_tests(metafunc: Any) -> None:
    """Parametrize the suite's tests by backend and device, then by (case, dtype) for the
    oracle test, (op path, defect) for the bad-input test, op for the others."""
    fixtures = metafunc.fixturenames
    if "backend_name" not in fixtures:
        return
    names = _backends(metafunc.config, metafunc.module)
    device = _device(metafunc.config)
    if "case" in fixtures:
        argnames, make = ["case", "dtype"], _oracle_params
    elif "defect" in fixtures:
        argnames, make = ["path", "defect"], _bad_input_params
    else:
        argnames, make = ["op"], _op_params
    params = [param for name in names for param in make(name, device)]
    metafunc.parametrize(["backend_name", "device", *argnames], params)


def _to(args: Dict[str, Any], device: torch.device) -> Dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def _run(
    backend: str, case: Case, dtype: torch.dtype, device: torch.device, grad: bool
) -> Tuple[Dict[str, Any], Any]:
    """The case's arguments on ``device`` (float ones requiring grad when ``grad``) and the
    op's result on ``backend``; a refusal skips the test with the backend's reason."""
    args = _to(case.build(dtype), device)
    if grad:
        for name in OPS[case.op].grads:
            value = args.get(name)
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                args[name] = value.detach().requires_grad_(True)
    try:
        return args, getattr(tzrec_ops, case.op)(**args, backend=backend)
    except BackendError as err:
        message = str(err)
        reason = message.split(f"cannot run {case.op}: ", 1)[-1].split("\n", 1)[0].strip()
        assert f"cannot run {case.op}: " in message and reason, (
            f"a refusal must give a reason, got: {message}"
        )
        pytest.skip(f"{backend} refuses {case.op} {case.name} in {dtype}: {reason}")


def _first_accepted(backend: str, op: str, device: torch.device) -> Case:
    for case in CASES[op]:
        try:
            _run(backend, case, torch.float32, device, grad=False)
        except pytest.skip.Exception:
            continue
        return case
    pytest.skip(f"{backend} refuses every float32 case of {op} on {device}")


def test_implementation_matches_the_declaration(
    backend_name: str, device: torch.device, op: str
) -> None:
    record = get_backend(backend_name)
    check_implementation(OPS[op], record.implementation(op), backend=backend_name, annotations=True)


def test_matches_float64_oracle(backend_name: str, device: torch.device, case: Case,
                                dtype: torch.dtype) -> None:
    spec = OPS[case.op]
    args, result = _run(backend_name, case, dtype, device, grad=True)
    outputs = as_outputs(result)
    oracle_args = float64_copies(args, spec.grads)
    expected = case.oracle(oracle_args)
    assert len(outputs) == len(expected), f"{case.op} returned {len(outputs)} outputs"
    pairs = []
    for i, (got, want) in enumerate(zip(outputs, expected)):
        if got is None and want is not None and case.op == "hstu_preprocess_and_attention":
            continue  # the fused path may leave k and v inside its buffer
        assert got is not None and want is not None, f"output {i} is None"
        assert got.dtype == dtype, f"output {i} has dtype {got.dtype}, expected {dtype}"
        assert got.device.type == device.type, f"output {i} is on {got.device}"
        assert_close(got.cpu(), want, dtype=dtype, name=f"{case.op} output {i}")
        pairs.append((got, want))
    inputs = [n for n in spec.grads if isinstance(args.get(n), torch.Tensor)
              and args[n].requires_grad]
    if not inputs:
        assert not any(got.requires_grad for got, _ in pairs), "a forward-only op kept a graph"
        return
    g = torch.Generator().manual_seed(1_000_003)
    douts = [torch.randn(got.shape, generator=g, dtype=torch.float64) for got, _ in pairs]
    got_grads = torch.autograd.grad(
        [got for got, _ in pairs], [args[n] for n in inputs],
        [d.to(device=device, dtype=dtype) for d in douts], allow_unused=True,
        materialize_grads=True,
    )
    want_grads = torch.autograd.grad(
        [want for _, want in pairs], [oracle_args[n] for n in inputs], douts, allow_unused=True,
        materialize_grads=True,
    )
    for name, got, want in zip(inputs, got_grads, want_grads):
        assert_close(got.cpu(), want, dtype=dtype, grad=True, name=f"{case.op} d{name}")


def test_bad_input_never_reaches_the_backend(backend_name: str, device: torch.device, path: str,
                                             defect: str, monkeypatch: Any) -> None:
    bad_inputs.assert_rejected_first(path, backend_name, defect, monkeypatch, device)


def test_compiles_with_fullgraph(backend_name: str, device: torch.device, op: str) -> None:
    case = _first_accepted(backend_name, op, device)
    args = _to(case.build(torch.float32), device)
    fn = getattr(tzrec_ops, op)
    eager = as_outputs(fn(**args, backend=backend_name))
    torch._dynamo.reset()  # every op gets its own compile budget

    def call(**kwargs: Any) -> Any:
        return fn(**kwargs, backend=backend_name)

    traced = as_outputs(torch.compile(call, fullgraph=True, backend="eager")(**args))
    for got, want in zip(traced, eager):
        if want is not None:
            assert_close(got.detach().cpu(), want.detach().cpu().double(), dtype=torch.float32,
                         name=f"compiled {op}")


def _custom_ops_of(run: Any) -> Dict[Any, Tuple[tuple, dict]]:
    """The non-aten ops ``run()`` dispatches, each with the arguments of its first call."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: Dict[Any, Tuple[tuple, dict]] = {}

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            kwargs = kwargs or {}
            if func.namespace not in ("aten", "prim", "prims") and func not in seen:
                seen[func] = (args, kwargs)
            return func(*args, **kwargs)

    with Recorder():
        run()
    return seen


def test_opcheck_registered_ops(backend_name: str, device: torch.device, op: str) -> None:
    case = _first_accepted(backend_name, op, device)
    spec = OPS[op]

    def run() -> None:
        args, result = _run(backend_name, case, torch.float32, device, grad=bool(spec.grads))
        outs = [o for o in as_outputs(result) if o is not None and o.requires_grad]
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    recorded = _custom_ops_of(run)
    if not recorded:
        pytest.skip(f"{backend_name} runs no torch.library op for {op}")
    checks = _CPU_OPCHECKS if device.type == "cpu" else _ALL_OPCHECKS
    for custom_op, (args, kwargs) in recorded.items():
        args, kwargs = _inputs_for_opcheck(custom_op, args, kwargs)
        torch.library.opcheck(custom_op, args, kwargs, test_utils=checks)


def _inputs_for_opcheck(func: Any, args: tuple, kwargs: dict) -> Tuple[tuple, dict]:
    """The recorded inputs, detached for an op without an autograd formula of its own (a
    backward op such as ``..._bwd``: it receives the forward's saved tensors, which require
    grad, and opcheck would try to differentiate through it)."""
    from torch._library.custom_ops import OPDEFS
    from torch.utils._pytree import tree_map

    opdef = OPDEFS.get(func._schema.name)
    if opdef is None or opdef._backward_fn is not None:
        return args, kwargs

    def detach(x: Any) -> Any:
        return x.detach() if isinstance(x, torch.Tensor) else x

    return tree_map(detach, args), tree_map(detach, kwargs)
