"""The Python examples in tzrec-ops' README run as written."""

from __future__ import annotations

import pathlib
import re

import pytest

from tzrec_ops.registry import reset_registry

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    for var in ("TZREC_OPS_BACKEND", "TRITON_INTERPRET"):
        monkeypatch.delenv(var, raising=False)
    reset_registry()
    yield
    reset_registry()


def test_readme_python_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 2
    namespace: dict = {}
    exec(compile("\n".join(blocks), str(README), "exec"), namespace)
    assert tuple(namespace["out"].shape) == (10, 2, 16)
    assert namespace["record"].name == "pytorch"  # no GPU, no interpreter
