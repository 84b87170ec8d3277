"""Shared setup for tzrec-acc's tests: the helpers beside this file import, seeds are fixed."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
