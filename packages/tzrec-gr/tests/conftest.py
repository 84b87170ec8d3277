"""Shared setup for tzrec-gr's tests.

Without a GPU, ``TRITON_INTERPRET=1`` is set before any Triton kernel module is imported, so
the triton backend runs in the CPU interpreter for the backend-parity tests (Triton fixes the
mode when a kernel is decorated). Automatic backend selection never picks the interpreter.
"""

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
