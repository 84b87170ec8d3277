"""tzrec-acc imports with only its required dependencies; optional ones name their extra."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from tzrec_acc import __version__
from tzrec_acc._extras import require

# optional for tzrec-acc: each module is blocked while every tzrec_acc module is imported
OPTIONAL = ("triton", "fbgemm_gpu", "torchrec", "torch_tensorrt", "tzrec_gr")

IMPORT_ALL = """
import importlib, pkgutil, sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None  # "import name" now raises ImportError
import tzrec_acc
modules = [m.name for m in pkgutil.walk_packages(tzrec_acc.__path__, "tzrec_acc.")]
for module in modules:
    importlib.import_module(module)
print(sorted(["tzrec_acc", *modules]))
"""


def test_every_module_imports_without_optional_dependencies():
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL, ",".join(OPTIONAL)],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "'tzrec_acc._extras'" in result.stdout


def test_version_matches_distribution():
    assert __version__ == importlib.metadata.version("tzrec-acc")


@pytest.mark.parametrize("module, extra", [("torch_tensorrt", "tensorrt"), ("tzrec_gr", "gr")])
def test_missing_extra_raises_naming_the_extra(monkeypatch, module, extra):
    assert extra in importlib.metadata.metadata("tzrec-acc").get_all("Provides-Extra")
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(
        ImportError,
        match=rf"^the feature needs the optional dependency {module}, which is not installed: "
        rf"pip install 'tzrec-acc\[{extra}\]'$",
    ) as info:
        require(module, f"tzrec-acc[{extra}]", "the feature")
    assert info.value.name == module


def test_installed_dependency_is_returned():
    assert require("torch", "torch", "anything") is torch


def test_readme_python_examples_run(capsys):
    readme = pathlib.Path(__file__).resolve().parents[1] / "README.md"
    blocks = re.findall(r"```python\n(.*?)```", readme.read_text(), re.S)
    assert blocks
    exec(compile("\n".join(blocks), str(readme), "exec"), {})
    out = capsys.readouterr().out
    missing = (
        "needs the optional dependency torch_tensorrt, which is not installed: "
        "pip install 'tzrec-acc[tensorrt]'"
    )
    assert (missing in out) == (importlib.util.find_spec("torch_tensorrt") is None)
    assert out.startswith("0.1.0\n")
