"""Test-session setup shared by every tzrec-ops test module.

Triton decides at ``@triton.jit`` decoration time whether a kernel runs in the CPU
interpreter, so ``TRITON_INTERPRET`` must be fixed before any kernel module is imported and
stay the same for the whole session: on a machine without a GPU it is set to 1 here. The
interpreter never wins automatic selection (see ``backends/triton/plugin.py``), so tests of
the reference backend are unaffected; Triton tests ask for ``backend="triton"`` by name.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# --tzrec-backend NAME runs the conformance suite against NAME (see test_conformance.py)
pytest_plugins = ["tzrec_ops.testing.conformance"]
