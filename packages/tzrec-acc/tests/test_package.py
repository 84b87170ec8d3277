"""tzrec-acc imports with only its required dependencies; optional ones name their extra."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys

import pytest
import torch

import tzrec_acc
from tzrec_acc import __version__
from tzrec_ops.extras import require

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
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "'tzrec_acc.tensorrt'" in result.stdout


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


def test_import_is_cheap_and_names_resolve():
    code = (
        "import sys, tzrec_acc; loaded = sorted(m for m in sys.modules if m.startswith('tzrec'));"
        "print(loaded, 'torch' in sys.modules);"
        "print(all(getattr(tzrec_acc, n) is not None for n in tzrec_acc.__all__))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split("\n")[:2] == ["['tzrec_acc'] False", "True"], out.stderr
    with pytest.raises(AttributeError, match="module 'tzrec_acc' has no attribute 'nothing'"):
        tzrec_acc.nothing  # noqa: B018
