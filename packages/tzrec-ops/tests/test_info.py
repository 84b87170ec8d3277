"""``python -m tzrec_ops info`` on a CPU machine."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from _fake_plugins import FakePlugins

from tzrec_ops.__main__ import info_lines, main
from tzrec_ops.registry import backends, reset_registry

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="describes a CPU-only machine")


@pytest.fixture
def plugins(monkeypatch, tmp_path):
    for var in ("TZREC_OPS_BACKEND", "TZREC_OPS_STRICT_PLUGINS", "TRITON_INTERPRET"):
        monkeypatch.delenv(var, raising=False)
    reset_registry()
    fake = FakePlugins(monkeypatch, tmp_path)
    yield fake
    reset_registry()
    fake.cleanup()


def _info(capsys) -> str:
    assert main(["info"]) == 0
    return capsys.readouterr().out


def _backend_line(out: str, name: str) -> str:
    """The backend's line under "backends": indented, starting with its name."""
    (line,) = [ln for ln in out.splitlines() if ln.startswith("  ") and ln.split()[0] == name]
    return line


def _expected_triton_reason() -> str:
    if importlib.util.find_spec("triton") is None:
        return "unavailable: triton is not installed (pip install 'tzrec-ops[triton]')"
    return "unavailable: no CUDA/ROCm device is visible (set TRITON_INTERPRET=1 to run on the CPU)"


def test_info_prints_versions_and_device(plugins, capsys):
    out = _info(capsys)
    assert f"tzrec-ops {importlib.metadata.version('tzrec-ops')}" in out.splitlines()
    assert f"torch {torch.__version__}" in out.splitlines()
    assert "device: no CUDA/ROCm device visible" in out


def test_pytorch_is_available_and_triton_says_why_not(plugins, capsys):
    out = _info(capsys)
    assert "priority 0   available" in _backend_line(out, "pytorch")
    assert "from tzrec-ops 0.1.0" in _backend_line(out, "pytorch")
    assert _expected_triton_reason() in _backend_line(out, "triton")
    assert _expected_triton_reason() in _backend_line(out, "triton_tma")
    assert "failed plugins: none" in out


def test_interpreter_makes_triton_available_on_cpu(plugins, capsys, monkeypatch):
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed in this environment")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = _info(capsys)
    assert "available" in _backend_line(out, "triton").split("priority 20")[1].split("[")[0]
    assert "tensor descriptors are not supported by the Triton interpreter" in _backend_line(
        out, "triton_tma"
    )


def test_info_lists_failed_plugins_and_env_choice(plugins, capsys, monkeypatch):
    plugins.add("broken-dist", "0.9.1", {"broken": "import acme_native_missing\n"})
    monkeypatch.setenv("TZREC_OPS_BACKEND", "pytorch")
    with pytest.warns(RuntimeWarning, match="broken-dist 0.9.1"):
        out = _info(capsys)
    assert "TZREC_OPS_BACKEND=pytorch" in out
    failed = out.split("failed plugins:\n")[1]
    assert "plugin 'broken'" in failed and "broken-dist 0.9.1" in failed
    assert "No module named 'acme_native_missing'" in failed


def test_rejects_unknown_command(capsys):
    with pytest.raises(SystemExit):
        main(["frobnicate"])
    assert "invalid choice: 'frobnicate'" in capsys.readouterr().err


def test_module_runs_as_a_program():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TZREC_OPS", "TRITON"))}
    result = subprocess.run(
        [sys.executable, "-m", "tzrec_ops", "info"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "available" in _backend_line(result.stdout, "pytorch")
    assert _expected_triton_reason() in _backend_line(result.stdout, "triton")


def test_info_prints_each_backend_description():
    lines = info_lines()
    for backend in backends():
        if backend.description:
            assert f"    {backend.description}" in lines, backend.name
