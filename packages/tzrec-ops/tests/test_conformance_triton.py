"""The conformance suite on backend ``triton``: in Triton's CPU interpreter here (tiny shapes),
on the GPU with ``-m ""`` there.

Tracing with fake tensors (``torch.compile``, ``opcheck``'s fake-tensor check) cannot run
kernels in the interpreter, which reads data pointers; those two tests are GPU tests here:
``pytest packages/tzrec-ops/tests/test_conformance_triton.py -m gpu``. The GPU run covers
``triton_tma`` with ``--tzrec-backend triton_tma``.
"""

import pytest
import torch

from tzrec_ops.testing import conformance_suite
from tzrec_ops.testing.conformance_suite import (  # noqa: F401
    pytest_generate_tests,
    test_bad_input_never_reaches_the_backend,
    test_implementation_matches_the_declaration,
    test_matches_float64_oracle,
)

pytest.importorskip("triton")

CONFORMANCE_BACKENDS = ("triton",)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiles_with_fullgraph(backend_name, device, op):
    conformance_suite.test_compiles_with_fullgraph(backend_name, device, op)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_opcheck_registered_ops(backend_name, device, op):
    conformance_suite.test_opcheck_registered_ops(backend_name, device, op)
