"""Installed distributions (tzrec-ops and the example backend ``compiled``, from
examples/tzrec-ops-backend-example) seen by a fresh process."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys

import pytest


def _info(**env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("TZREC_OPS", "TRITON"))}
    environ.update(env)
    return subprocess.run(
        [sys.executable, "-m", "tzrec_ops", "info"],
        capture_output=True, text=True, env=environ, timeout=120,
    )


def _backend_line(stdout: str, name: str) -> str:
    lines = [line for line in stdout.splitlines() if line.strip().startswith(name + " ")]
    assert len(lines) == 1, stdout
    return lines[0]


def test_builtin_backends_come_through_tzrec_ops_entry_points():
    eps = {
        ep.name: ep
        for ep in importlib.metadata.entry_points(group="tzrec_ops")
        if ep.dist.metadata["Name"] == "tzrec-ops"
    }
    assert {"pytorch", "triton", "rocm"} <= set(eps)
    assert eps["pytorch"].value == "tzrec_ops.backends.pytorch.plugin"


def test_info_lists_installed_plugin_with_its_distribution():
    result = _info()
    assert result.returncode == 0, result.stderr
    line = _backend_line(result.stdout, "compiled")
    version = importlib.metadata.version("tzrec-ops-compiled")
    assert "available" in line and f"from tzrec-ops-compiled {version}" in line
    assert "from tzrec-ops 0.1.0" in _backend_line(result.stdout, "pytorch")
    assert "failed plugins: none" in result.stdout


def test_strict_mode_accepts_every_installed_plugin():
    result = _info(TZREC_OPS_STRICT_PLUGINS="1")
    assert result.returncode == 0, result.stderr


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TZREC_OPS")}
    environ.update(env)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=environ, timeout=300
    )


_LAYER_NORM = (
    "import json, torch, tzrec_ops\n"
    "from tzrec_ops.registry import select_backend\n"
    "impl = select_backend('layer_norm', {request}, device=torch.device('cpu'), "
    "dtype=torch.bfloat16)\n"
    "print(impl.__module__)\n"
    "x = torch.tensor([[1.0, 2.0, 3.0, 6.0]], dtype=torch.bfloat16)\n"
    "print(json.dumps(tzrec_ops.layer_norm(x, backend={request}).float().tolist()[0]))\n"
)
# layer_norm([1, 2, 3, 6]): mean 3, biased variance 3.5
_EXPECTED = [(v - 3) / (3.5 + 1e-5) ** 0.5 for v in (1, 2, 3, 6)]


@pytest.mark.parametrize("env", ["compiled", "layer_norm=compiled"])
def test_env_override_reaches_the_plugin_in_a_fresh_process(env):
    result = _run(_LAYER_NORM.format(request=None), TZREC_OPS_BACKEND=env)
    assert result.returncode == 0, result.stderr
    module, values = result.stdout.splitlines()
    assert module == "tzrec_ops_compiled.norms"
    # bfloat16 keeps 8 mantissa bits: 2**-8 relative
    assert json.loads(values) == pytest.approx(_EXPECTED, rel=2**-8)


def test_selection_by_name_reaches_the_plugin_in_a_fresh_process():
    result = _run(_LAYER_NORM.format(request="'compiled'"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == "tzrec_ops_compiled.norms"
