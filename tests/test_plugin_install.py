"""Installed distributions (tzrec-ops and the example backend) seen by a fresh process."""

from __future__ import annotations

import importlib.metadata
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
    line = _backend_line(result.stdout, "example")
    assert "available" in line and "from tzrec-ops-backend-example 0.1.0" in line
    assert "from tzrec-ops 0.1.0" in _backend_line(result.stdout, "pytorch")
    assert "failed plugins: none" in result.stdout


def test_strict_mode_accepts_every_installed_plugin():
    result = _info(TZREC_OPS_STRICT_PLUGINS="1")
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("env", ["example", "addmm=example"])
def test_env_override_reaches_the_plugin_in_a_fresh_process(env):
    code = (
        "import torch\n"
        "from tzrec_ops.ops.mm import addmm\n"
        "from tzrec_ops.registry import select_backend\n"
        "impl = select_backend('addmm', device=torch.device('cpu'), dtype=torch.float32)\n"
        "print(impl.__module__)\n"
        "print(addmm(torch.ones(2), torch.ones(1, 3), torch.ones(3, 2)).tolist())\n"
    )
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TZREC_OPS")}
    environ["TZREC_OPS_BACKEND"] = env
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=environ, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["tzrec_ops_backend_example.kernels", "[[4.0, 4.0]]"]
