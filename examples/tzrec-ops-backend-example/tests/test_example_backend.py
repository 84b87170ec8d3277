"""The example backend, installed as its own distribution, seen through tzrec-ops."""

from __future__ import annotations

import importlib.metadata
import pathlib
import re

import pytest
import torch

from tzrec_ops.ops.mm import addmm
from tzrec_ops.registry import BackendError, get_registry, reset_registry, select_backend
from tzrec_ops_backend_example import kernels

# max |example - float64 oracle| for inputs in [-1, 1) with K = 32
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 0.25, torch.float64: 1e-12}


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    monkeypatch.delenv("TZREC_OPS_BACKEND", raising=False)
    reset_registry()
    yield
    reset_registry()


def test_entry_point_is_installed():
    (ep,) = [
        ep
        for ep in importlib.metadata.entry_points(group="tzrec_ops")
        if ep.name == "example"
    ]
    assert ep.value == "tzrec_ops_backend_example.plugin"
    assert ep.dist.metadata["Name"] == "tzrec-ops-backend-example"


def test_registry_records_backend_and_its_distribution():
    registry = get_registry()
    assert "example" in registry.backends
    assert registry.origins["example"] == "tzrec-ops-backend-example 0.1.0"
    assert registry.failed_plugins == []
    assert registry.backends["example"].unavailable_reason() is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bias_shape", ["row", "full"])
def test_addmm_matches_float64_oracle(dtype, bias_shape):
    gen = torch.Generator().manual_seed(0)
    mat1 = torch.rand(8, 32, generator=gen) * 2 - 1
    mat2 = torch.rand(32, 16, generator=gen) * 2 - 1
    bias = torch.rand(16 if bias_shape == "row" else (8, 16), generator=gen) * 2 - 1
    out = addmm(bias.to(dtype), mat1.to(dtype), mat2.to(dtype), backend="example")
    assert out.dtype == dtype and out.shape == (8, 16)
    expected = addmm(
        bias.to(dtype).double(), mat1.to(dtype).double(), mat2.to(dtype).double(),
        backend="pytorch",
    )
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=0)


def test_env_override_picks_example(monkeypatch):
    monkeypatch.setenv("TZREC_OPS_BACKEND", "addmm=example")
    impl = select_backend("addmm", device=torch.device("cpu"), dtype=torch.float32)
    assert impl is kernels.addmm


def test_low_priority_keeps_it_out_of_automatic_selection():
    impl = select_backend("addmm", device=torch.device("cpu"), dtype=torch.float32)
    assert impl is not kernels.addmm


def test_rejects_integer_dtype_with_reason():
    with pytest.raises(BackendError, match=r"'example'.*dtype torch\.int64 is not supported"):
        select_backend("addmm", "example", device=torch.device("cpu"), dtype=torch.int64)


def test_readme_python_example_runs():
    readme = pathlib.Path(__file__).resolve().parents[1] / "README.md"
    (block,) = re.findall(r"```python\n(.*?)```", readme.read_text(), re.S)
    namespace: dict = {}
    exec(compile(block, str(readme), "exec"), namespace)
    expected = namespace["bias"] + namespace["mat1"] @ namespace["mat2"]
    torch.testing.assert_close(namespace["out"], expected)
