"""addmm: pytorch backend vs the float64 oracle, gradcheck, compile/export, argument errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tzrec_ops.ops.mm import addmm
from tzrec_ops.testing import ops_oracle as oracle
from tzrec_ops.testing.generators import random_values

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True)
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _inputs(m, k, n, dtype, bias_2d, seed=0, transposed=False):
    mat1 = random_values(m, (k,), dtype, seed)
    if transposed:  # a [K, N] view of a contiguous [N, K] buffer
        mat2 = random_values(n, (k,), dtype, seed + 1).t()
    else:
        mat2 = random_values(k, (n,), dtype, seed + 1)
    bias = (
        random_values(m, (n,), dtype, seed + 2)
        if bias_2d
        else random_values(n, (), dtype, seed + 2)
    )
    return [t.requires_grad_() for t in (bias, mat1, mat2)]


def _check(m, k, n, dtype, bias_2d, seed=0, transposed=False):
    inputs = _inputs(m, k, n, dtype, bias_2d, seed, transposed)
    out = addmm(*inputs, backend="pytorch")
    assert out.dtype == dtype and out.shape == (m, n)
    ref_in = oracle.f64_copies(*inputs)
    oracle.assert_fwd_bwd(
        out, oracle.addmm(*ref_in), inputs, ref_in, ["input", "mat1", "mat2"], dtype, seed
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias_2d", [False, True])
@pytest.mark.parametrize("shape", [(37, 29, 23), (0, 8, 5), (1, 1, 1), (64, 128, 32)])
def test_addmm_matches_oracle(dtype, bias_2d, shape):
    _check(*shape, dtype, bias_2d)


@SETTINGS
@given(
    m=st.integers(0, 40),
    k=st.integers(1, 40),
    n=st.integers(1, 40),
    dtype=st.sampled_from(DTYPES[:3]),
    bias_2d=st.booleans(),
    transposed=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_addmm_sweep(m, k, n, dtype, bias_2d, transposed, seed):
    _check(m, k, n, dtype, bias_2d, seed, transposed)


def test_addmm_keeps_bf16_precision():
    """The product accumulates in fp32: 1 + 255 * 2^-9 rounds to 1.5 in bf16 at the end,
    whereas a bf16 running sum would stay at 1.0 (each 2^-9 is below half an ulp of 1)."""
    mat1 = torch.ones(1, 256, dtype=torch.bfloat16)
    mat2 = torch.full((256, 1), 2.0**-9, dtype=torch.bfloat16)
    mat2[0] = 1.0
    bias = torch.zeros(1, dtype=torch.bfloat16)
    assert addmm(bias, mat1, mat2, backend="pytorch").item() == 1.5


@pytest.mark.parametrize("bias_2d", [False, True])
def test_addmm_gradcheck(bias_2d):
    inputs = _inputs(5, 4, 3, torch.float64, bias_2d)
    assert torch.autograd.gradcheck(lambda *a: addmm(*a, backend="pytorch"), inputs)


def test_addmm_compile_and_export():
    bias, mat1, mat2 = (t.detach() for t in _inputs(9, 7, 5, torch.float32, False))
    expected = addmm(bias, mat1, mat2)
    compiled = torch.compile(lambda *a: addmm(*a, backend="pytorch"), fullgraph=True)
    torch.testing.assert_close(compiled(bias, mat1, mat2), expected)

    class Model(torch.nn.Module):
        def forward(self, b, x, w):
            return addmm(b, x, w, backend="pytorch")

    exported = torch.export.export(Model(), (bias, mat1, mat2))
    torch.testing.assert_close(exported.module()(bias, mat1, mat2), expected)


def _ok():
    return [t.detach() for t in _inputs(4, 3, 2, torch.float32, False)]


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda b, x, w: (b, x[0], w), ValueError, r"mat1 must be 2-D, got 1-D"),
        (lambda b, x, w: (b, x, w[0]), ValueError, r"mat2 must be 2-D, got 1-D"),
        (
            lambda b, x, w: (b, x, w[:2]),
            ValueError,
            r"mat2.shape\[0\] \(2\) must equal mat1.shape\[1\] \(3\)",
        ),
        (
            lambda b, x, w: (b[:1], x, w),
            ValueError,
            r"input must have shape \[2\] or \[4, 2\].*got \[1\]",
        ),
        (
            lambda b, x, w: (b, x.int(), w),
            TypeError,
            r"mat1 must be float16 or bfloat16 or float32 or float64, got torch.int32",
        ),
        (
            lambda b, x, w: (b, x, w.double()),
            TypeError,
            r"mat2 has dtype torch.float64 but mat1 has torch.float32",
        ),
        (
            lambda b, x, w: (b.half(), x, w),
            TypeError,
            r"input has dtype torch.float16 but mat1 has torch.float32",
        ),
        (lambda b, x, w: (b, x, w.to("meta")), ValueError, r"mat2 is on meta but mat1 is on cpu"),
        (lambda b, x, w: (b.tolist(), x, w), TypeError, r"input must be a torch.Tensor, got list"),
    ],
)
def test_addmm_errors(change, error, match):
    with pytest.raises(error, match=match):
        addmm(*change(*_ok()), backend="pytorch")
