"""The serving examples in examples/ run on the CPU, each in a fresh interpreter.

Each trains a model for a few steps, serves one user incrementally and asserts that every
cached result equals the full forward (the script fails otherwise).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[3] / "examples"


@pytest.mark.parametrize("name", ["retrieval_serving.py", "ranking_serving.py"])
def test_serving_example_runs(name):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "cached vs full" in done.stdout
