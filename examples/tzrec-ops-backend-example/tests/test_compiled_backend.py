"""The ``compiled`` backend, installed as its own distribution, seen through tzrec-ops.

Its numerics, refusals, bad-input protection, tracing and opcheck are tzrec-ops'
conformance suite: ``pytest --tzrec-backend compiled`` (see conftest.py). These tests cover
what is particular to this package: its entry point, its distribution, how it is selected.
"""

from __future__ import annotations

import importlib.metadata
import pathlib
import re

import pytest
import torch

import tzrec_ops
from tzrec_ops.registry import BackendError, get_registry, reset_registry, select_backend
from tzrec_ops_compiled import attention, norms


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    monkeypatch.delenv("TZREC_OPS_BACKEND", raising=False)
    reset_registry()
    yield
    reset_registry()


def test_entry_point_is_installed():
    (ep,) = [
        ep for ep in importlib.metadata.entry_points(group="tzrec_ops") if ep.name == "compiled"
    ]
    assert ep.value == "tzrec_ops_compiled.plugin"
    assert ep.dist.metadata["Name"] == "tzrec-ops-compiled"


def test_registry_records_backend_and_its_distribution():
    registry = get_registry()
    version = importlib.metadata.version("tzrec-ops-compiled")
    assert registry.origins["compiled"] == f"tzrec-ops-compiled {version}"
    assert registry.failed_plugins == []
    assert registry.backends["compiled"].unavailable_reason() is None


def test_env_override_picks_it(monkeypatch):
    monkeypatch.setenv("TZREC_OPS_BACKEND", "layer_norm=compiled")
    impl = select_backend("layer_norm", device=torch.device("cpu"), dtype=torch.float32)
    assert impl is norms.layer_norm


def test_low_priority_keeps_it_out_of_automatic_selection():
    impl = select_backend("layer_norm", device=torch.device("cpu"), dtype=torch.float32)
    assert impl is not norms.layer_norm


def test_refusal_names_the_option():
    q = torch.randn(5, 2, 8)
    offsets = torch.tensor([0, 2, 5])
    with pytest.raises(BackendError, match=r"'compiled'.*min_full_attn_seq_len=1 is not supported"):
        tzrec_ops.hstu_mha(3, 0.5, q, q, q, offsets, max_attn_len=1, min_full_attn_seq_len=1,
                           backend="compiled")


def test_alpha_scale_and_dtype_do_not_recompile():
    """They are handled outside the compiled graph, so only the mask options recompile."""
    torch._dynamo.reset()
    offsets = torch.tensor([0, 2, 5])
    calls = [(0.5, -1, torch.float32), (0.25, 7, torch.bfloat16), (1.0, 3, torch.float16)]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for alpha, scaling, dtype in calls:
            q, k, v = (torch.randn(5, 2, 8, dtype=dtype) for _ in range(3))
            attention.hstu_mha(3, alpha, q, k, v, offsets, True, 0.0, False, None, 0, 0, 0,
                               False, None, scaling)


def test_readme_python_example_runs():
    readme = pathlib.Path(__file__).resolve().parents[1] / "README.md"
    (block,) = re.findall(r"```python\n(.*?)```", readme.read_text(), re.S)
    namespace: dict = {}
    exec(compile(block, str(readme), "exec"), namespace)
    expected = tzrec_ops.layer_norm(namespace["x"], backend="pytorch")
    torch.testing.assert_close(namespace["y"], expected)
