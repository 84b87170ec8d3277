"""tzrec-bench imports with only its required dependencies; optional ones name their extra."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from tzrec_bench import __version__
from tzrec_ops.extras import require

# optional for tzrec-bench: each module is blocked while every tzrec_bench module is imported
OPTIONAL = ("triton", "fbgemm_gpu", "torchrec", "torch_tensorrt")

IMPORT_ALL = """
import importlib, pkgutil, sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None  # "import name" now raises ImportError
import tzrec_bench
modules = [m.name for m in pkgutil.walk_packages(tzrec_bench.__path__, "tzrec_bench.")]
for module in modules:
    importlib.import_module(module)
print(sorted(["tzrec_bench", *modules]))
"""


def test_every_module_imports_without_optional_dependencies():
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL, ",".join(OPTIONAL)],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "'tzrec_bench.benchmarks.export'" in result.stdout


def test_version_matches_distribution():
    assert __version__ == importlib.metadata.version("tzrec-bench")


def test_missing_extra_raises_naming_the_extra(monkeypatch):
    assert "triton" in importlib.metadata.metadata("tzrec-ops").get_all("Provides-Extra")
    monkeypatch.setitem(sys.modules, "triton", None)
    with pytest.raises(
        ImportError,
        match=r"^the Triton kernel benchmark needs the optional dependency triton, which is not "
        r"installed: pip install 'tzrec-ops\[triton\]'$",
    ):
        require("triton", "tzrec-ops[triton]", "the Triton kernel benchmark")


def test_installed_dependency_is_returned():
    assert require("torch", "torch", "anything") is torch


def test_readme_python_examples_run(capsys):
    readme = pathlib.Path(__file__).resolve().parents[1] / "README.md"
    blocks = re.findall(r"```python\n(.*?)```", readme.read_text(), re.S)
    assert blocks
    exec(compile("\n".join(blocks), str(readme), "exec"), {})
    out = capsys.readouterr().out
    missing = (
        "needs the optional dependency triton, which is not installed: "
        "pip install 'tzrec-ops[triton]'"
    )
    assert (missing in out) == (importlib.util.find_spec("triton") is None)
