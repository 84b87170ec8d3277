"""The STU stack on the triton backend against the pytorch backend.

CPU: the Triton interpreter (TRITON_INTERPRET=1, set before triton is imported) at tiny
shapes. GPU (``-m gpu``): real sizes in bf16. Skipped, with the reason, while the triton
backend does not implement every op the STU layer calls.
"""

from __future__ import annotations

import copy
import importlib.util
import os

import pytest
import torch

from tzrec_gr import STULayer, STUStack
from tzrec_gr._jagged import lengths_to_offsets
from tzrec_gr.stu import _LAYER_OPS


def _triton_missing_ops():
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    from tzrec_ops.backends.triton.plugin import _OPS

    missing = [op for op in _LAYER_OPS if op not in _OPS]
    return f"triton backend lacks {', '.join(missing)}" if missing else None


def _stacks(e, h, d, layers, device, dtype):
    ref = STUStack(
        [
            STULayer(e, h, d, d, output_dropout_ratio=0.0, backend="pytorch", device=device)
            for _ in range(layers)
        ]
    ).to(dtype)
    tri = copy.deepcopy(ref)
    for layer in tri.stu_layers:
        layer._backend = __import__("tzrec_ops").get_backend("triton")
    return ref, tri


def _compare(lengths, e, h, d, device, dtype, tol):
    ref, tri = _stacks(e, h, d, 2, device, dtype)
    offsets = lengths_to_offsets(lengths).to(device)
    targets = (lengths // 4).clamp(min=1).to(device)
    x = torch.randn(int(lengths.sum()), e, device=device, dtype=dtype)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    n = int(lengths.max())
    out_ref = ref(x1, offsets, n, targets).x
    out_tri = tri(x2, offsets, n, targets).x
    torch.testing.assert_close(out_tri.float(), out_ref.float(), **tol)
    grad = torch.randn_like(out_ref)
    out_ref.backward(grad)
    out_tri.backward(grad)
    torch.testing.assert_close(x2.grad.float(), x1.grad.float(), **tol)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="set TRITON_INTERPRET=1 before starting pytest to run triton on the CPU",
)
def test_stack_triton_interpreter_matches_pytorch():
    reason = _triton_missing_ops()
    if reason:
        pytest.skip(reason)
    _compare(torch.tensor([5, 9, 3]), 32, 2, 16, "cpu", torch.float32, {"rtol": 1e-4, "atol": 1e-4})


@pytest.mark.gpu
def test_stack_triton_matches_float64_oracle_gpu():
    """bf16 on triton against the same (bf16-rounded) weights run in float64 on pytorch."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    reason = _triton_missing_ops()
    if reason:
        pytest.skip(reason)
    from tzrec_ops.testing.tolerances import assert_close

    torch.manual_seed(0)
    lengths = torch.randint(900, 1024, (16,))
    tri, _ = _stacks(512, 4, 128, 2, "cuda", torch.bfloat16)
    for layer in tri.stu_layers:
        layer._backend = __import__("tzrec_ops").get_backend("triton")
    oracle = copy.deepcopy(tri).double()
    for layer in oracle.stu_layers:
        layer._backend = __import__("tzrec_ops").get_backend("pytorch")
    offsets = lengths_to_offsets(lengths).cuda()
    targets = (lengths // 4).clamp(min=1).cuda()
    x = torch.randn(int(lengths.sum()), 512, device="cuda", dtype=torch.bfloat16)
    x_tri, x_ref = x.clone().requires_grad_(), x.double().requires_grad_()
    n = int(lengths.max())
    out_tri = tri(x_tri, offsets, n, targets).x
    out_ref = oracle(x_ref, offsets, n, targets).x
    assert_close(out_tri, out_ref, torch.bfloat16, name="stack output")
    grad = torch.randn_like(out_ref)
    out_tri.backward(grad.to(torch.bfloat16))
    out_ref.backward(grad)
    assert_close(x_tri.grad, x_ref.grad, torch.bfloat16, grad=True, name="x.grad")
