"""The op declarations (:mod:`tzrec_ops.contract`) are what the public ops dispatch with,
what the README documents, and what the conformance suite holds a backend to."""

from __future__ import annotations

import inspect
import pathlib
import re
from typing import Any, Dict, List

import pytest
import torch

import tzrec_ops
from tzrec_ops import contract, registry
from tzrec_ops.contract import (
    OPS,
    Backend,
    ContractError,
    check_implementation,
    contract_markdown,
    op_table,
)
from tzrec_ops.testing import conformance_suite
from tzrec_ops.testing.op_cases import CASES

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
CPU = torch.device("cpu")

_CALLS: List[Dict[str, Any]] = []


class _Reached(Exception):
    pass


def _record(*args: Any, **kwargs: Any) -> Any:
    _CALLS.append({"args": args, "kwargs": kwargs})
    raise _Reached


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    monkeypatch.delenv("TZREC_OPS_BACKEND", raising=False)
    registry.reset_registry()
    _CALLS.clear()
    yield
    registry.reset_registry()


@pytest.mark.parametrize("op", list(OPS))
def test_public_signature_is_the_declaration(op):
    params = [p for p in inspect.signature(getattr(tzrec_ops, op)).parameters if p != "backend"]
    assert tuple(params) == OPS[op].params


@pytest.mark.parametrize("op", list(OPS))
def test_every_op_has_conformance_cases(op):
    assert CASES[op], f"no conformance case for {op}"


@pytest.mark.parametrize("op", list(OPS))
def test_dispatch_passes_the_declared_call_keys_and_arguments_by_keyword(op):
    """A backend implementing every op records what its ``supports`` check and its
    implementation receive: exactly the declared call keys, and every declared argument by
    keyword."""
    seen_calls = []

    def supports(name, call):
        seen_calls.append((name, dict(call)))
        return None

    record = Backend(
        "recorder", -1, {name: f"{__name__}:_record" for name in OPS}, supports=supports
    )
    with pytest.raises(_Reached):
        getattr(tzrec_ops, op)(**CASES[op][0].build(torch.float32), backend=record)
    assert seen_calls and seen_calls[0][0] == op
    assert tuple(seen_calls[0][1]) == OPS[op].call_keys()
    (call,) = _CALLS
    assert call["args"] == ()
    assert tuple(call["kwargs"]) == OPS[op].params


def test_readme_lists_the_declared_contract():
    text = README.read_text()
    match = re.search(r"<!-- contract:begin -->\n(.*?)<!-- contract:end -->", text, re.S)
    assert match, "the README has no generated contract section"
    assert match.group(1) == contract_markdown(), (
        "the README's op table is stale: paste the output of `python -m tzrec_ops contract`"
    )


def test_cli_prints_the_table(capsys):
    from tzrec_ops.__main__ import main

    assert main(["contract"]) == 0
    assert capsys.readouterr().out == contract_markdown()


def test_op_tables_take_declared_ops_only():
    assert op_table("pkg", {"mod": ["layer_norm"]}) == {"layer_norm": "pkg.mod:layer_norm"}
    with pytest.raises(ValueError, match=r"'layer_nrom' is not a tzrec_ops op"):
        op_table("pkg", {"mod": ["layer_nrom"]})


def test_builtin_backends_declare_only_contract_ops():
    pytorch = registry.get_backend("pytorch")
    assert set(pytorch.ops) == {name for name, spec in OPS.items() if not spec.fast_path}
    for record in registry.backends():
        assert set(record.ops) <= set(OPS), record.name


def test_registry_reexports_the_record():
    assert registry.Backend is contract.Backend is tzrec_ops.Backend
    assert registry.BackendError is tzrec_ops.BackendError


def _wrong_layer_norm(x, weight, bias, eps):
    return torch.nn.functional.layer_norm(x, x.shape[1:], weight, bias, eps) * 1.01


def _silent_refusal(op, call):
    return "" if call["dtype"] == torch.bfloat16 else None


def test_suite_fails_a_wrong_answer():
    wrong = Backend("wrong", -1, {"layer_norm": f"{__name__}:_wrong_layer_norm"})
    with pytest.raises(AssertionError, match="layer_norm output 0"):
        conformance_suite.test_matches_float64_oracle(
            wrong, CPU, CASES["layer_norm"][0], torch.float32
        )


def test_suite_fails_a_refusal_without_reason():
    mute = Backend(
        "mute",
        -1,
        {"layer_norm": "tzrec_ops.backends.pytorch.layer_norm:layer_norm"},
        supports=_silent_refusal,
    )
    with pytest.raises(AssertionError, match="a refusal must give a reason"):
        conformance_suite.test_matches_float64_oracle(
            mute, CPU, CASES["layer_norm"][0], torch.bfloat16
        )


@pytest.mark.parametrize("op", list(OPS))
def test_declared_module_defines_the_public_op(op):
    assert getattr(tzrec_ops, op).__module__ == f"tzrec_ops.ops.{OPS[op].module}"


def test_mirrored_op_table_follows_the_declared_modules():
    table = contract.mirrored_op_table("pkg", fast_paths=False)
    assert table == {n: f"pkg.{s.module}:{n}" for n, s in OPS.items() if not s.fast_path}
    assert set(contract.mirrored_op_table("pkg")) == set(OPS)


# -- implementations against the declarations (as pluggy checks hookimpls) ------------------

BUILTIN_BACKENDS = ("pytorch", "triton", "triton_tma")


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("backend", BUILTIN_BACKENDS)
def test_builtin_implementation_matches_the_declaration(backend, op):
    """Names, order, keyword passing, defaults and annotations of every built-in
    implementation are the public op's."""
    if backend != "pytorch":
        # the triton backends' modules import triton (test-ops-fbgemm runs without it)
        pytest.importorskip("triton", reason="the triton backends' modules need triton")
    record = registry.get_backend(backend)
    if op not in record.ops:
        pytest.skip(f"{backend} does not implement {op}")
    check_implementation(OPS[op], record.implementation(op), backend=backend, annotations=True)


def _missing(x, weight, bias):
    pass


def _extra(x, weight, bias, eps, scale=1.0):
    pass


def _swapped(x, bias, weight, eps):
    pass


def _positional_only(x, weight, bias, eps, /):
    pass


def _catch_all(**kwargs):
    pass


def _other_default(x, weight=None, bias=None, eps=1e-6):
    pass


def _default_the_op_lacks(
    x, u, weight=None, bias=None, eps=1e-5, dropout_ratio=0.0, training=0, concat_ux=0, seed=0
):
    pass


def _misannotated(x: torch.Tensor, weight: int, bias, eps):
    pass


def _matching(x: torch.Tensor, weight, bias, eps: float = 1e-5):
    pass


@pytest.mark.parametrize(
    "op, fn, message",
    [
        ("layer_norm", _missing, r"lacks parameter 'eps' \(declared: x, weight, bias, eps\)"),
        ("layer_norm", _extra, r"has parameter 'scale', which layer_norm does not declare"),
        ("layer_norm", _swapped, r"parameter 'bias' is at position 1, where layer_norm declares"),
        ("layer_norm", _positional_only, r"parameter 'x' is positional-only"),
        ("layer_norm", _catch_all, r"takes \*\*kwargs"),
        ("layer_norm", _other_default, r"'eps' defaults to 1e-06, the public op's default is 1e-0"),
        ("layer_norm_mul_dropout", _default_the_op_lacks, r"'weight' defaults to None, .* none"),
    ],
)
def test_check_rejects_a_mismatch_naming_backend_op_and_parameter(op, fn, message):
    where = rf"^backend 'acme': {op} implementation {__name__}:{fn.__name__}"
    with pytest.raises(ContractError, match=rf"{where}.*{message}"):
        check_implementation(OPS[op], fn, backend="acme")


def test_annotations_are_checked_on_request():
    check_implementation(OPS["layer_norm"], _misannotated)
    message = r"'weight' is annotated int, the public op's is Optional\[torch.Tensor\]"
    with pytest.raises(ContractError, match=message):
        check_implementation(OPS["layer_norm"], _misannotated, annotations=True)
    check_implementation(OPS["layer_norm"], _matching, annotations=True)
