"""Triton ``addmm`` against the float64 oracle (the pytorch backend on float64 copies).

On a CPU the kernels run in the Triton interpreter (``TRITON_INTERPRET=1`` is set below before
triton is imported when no GPU is visible) at small shapes; ``pytest -m gpu`` repeats the
comparisons at real sizes and runs torch.compile(fullgraph=True) and opcheck.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    # correctness does not depend on the tile config; tuning every GEMM key costs minutes
    os.environ.setdefault("TZREC_OPS_TRITON_AUTOTUNE", "0")

import pytest  # noqa: E402

from tzrec_ops.ops.mm import addmm  # noqa: E402
from tzrec_ops.testing.tolerances import assert_close  # noqa: E402

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _check(m: int, k: int, n: int, bias_2d: bool, dtype: torch.dtype, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    base = [
        torch.randn(*((m, n) if bias_2d else (n,)), generator=g, dtype=torch.float64),
        torch.randn(m, k, generator=g, dtype=torch.float64),
        torch.randn(k, n, generator=g, dtype=torch.float64) / max(k, 1) ** 0.5,
    ]
    got_in = [t.to(DEVICE, dtype).requires_grad_() for t in base]
    ref_in = [t.to(dtype).to(DEVICE, torch.float64).requires_grad_() for t in base]
    out = addmm(*got_in, backend="triton")
    expected = addmm(*ref_in, backend="pytorch")
    assert out.dtype == dtype
    assert_close(out, expected, dtype, name="z")
    dz = (
        torch.randn(out.shape, generator=g, dtype=torch.float64).to(dtype).to(DEVICE, torch.float64)
    )
    out.backward(dz.to(dtype))
    expected.backward(dz)
    for name, got, want in zip(("d_input", "d_mat1", "d_mat2"), got_in, ref_in):
        assert got.grad.dtype == dtype
        assert_close(got.grad, want.grad, dtype, grad=True, name=name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias_2d", [False, True])
@pytest.mark.parametrize("mkn", [(37, 19, 23), (1, 5, 3), (0, 4, 6), (20, 33, 17)])
def test_addmm_matches_oracle(mkn, bias_2d, dtype):
    _check(*mkn, bias_2d, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias_2d", [False, True])
def test_addmm_backward_split_along_k_matches_oracle(bias_2d, dtype, monkeypatch):
    """d_mat2 = mat1^T @ dz reduces over every row; deep reductions run split along K."""
    from tzrec_ops.backends.triton import mm

    monkeypatch.setattr(mm, "_MIN_SPLIT_DEPTH", 32)
    assert mm.split_k(24, 20, 200, torch.device(DEVICE)) > 1  # the case below is split
    _check(200, 24, 20, bias_2d, dtype, seed=3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mkn", [(37, 19, 40), (5, 0, 8)])
def test_matmul_silu_epilogue_matches_oracle(mkn, dtype):
    """``silu_out`` gets silu of the first columns of ``bias + a @ b`` (from the fp32
    accumulator), next to the unchanged product; K = 0 takes the bias-only path."""
    from tzrec_ops.backends.triton.mm import matmul

    m, k, n = mkn
    g = torch.Generator().manual_seed(3)
    a, b, bias = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((m, k), (k, n), (n,)))
    want = bias + a.to(dtype).double() @ b.to(dtype).double()
    out = torch.empty(m, n, dtype=dtype, device=DEVICE)
    act = torch.empty(m, 2 * n, dtype=dtype, device=DEVICE)[:, 3 : 3 + n // 2]  # strided view
    matmul(a.to(DEVICE, dtype), b.to(DEVICE, dtype), out, bias=bias.to(DEVICE, dtype), silu_out=act)
    assert_close(out, want, dtype, name="z")
    assert_close(act, torch.nn.functional.silu(want[:, : n // 2]), dtype, name="silu(z)")
    with pytest.raises(ValueError, match="silu_out needs a bias"):
        matmul(a.to(DEVICE, dtype), b.to(DEVICE, dtype), out, silu_out=act)


def test_silu_backward_into_strided_view_matches_oracle():
    from tzrec_ops.backends.triton.silu import silu_backward

    g = torch.Generator().manual_seed(4)
    buf = torch.randn(33, 70, generator=g, dtype=torch.float64)
    dy = torch.randn(33, 21, generator=g, dtype=torch.float64)
    x = buf[:, 5:26]
    x_ref = x.clone().requires_grad_()
    torch.nn.functional.silu(x_ref).backward(dy)
    for dtype in DTYPES:
        grads = torch.zeros(33, 70, dtype=dtype, device=DEVICE)
        silu_backward(dy.to(DEVICE, dtype), x.to(DEVICE, dtype), grads[:, 40:61])
        assert_close(grads[:, 40:61], x_ref.grad, dtype, grad=True, name="dx")
        assert torch.count_nonzero(grads[:, :40]) == 0 and torch.count_nonzero(grads[:, 61:]) == 0
    with pytest.raises(ValueError, match="unit column"):
        silu_backward(dy, x, grads[:, 0:42:2])


def test_addmm_rejects_bad_shapes_before_launch():
    x = torch.randn(4, 3, device=DEVICE)
    with pytest.raises(ValueError, match=r"mat2.shape\[0\] \(5\) must equal mat1.shape\[1\] \(3\)"):
        addmm(torch.zeros(2, device=DEVICE), x, torch.randn(5, 2, device=DEVICE), backend="triton")
    with pytest.raises(ValueError, match=r"input must have shape \[2\] or \[4, 2\]"):
        addmm(torch.zeros(3, device=DEVICE), x, torch.randn(3, 2, device=DEVICE), backend="triton")


@pytest.fixture(params=[False, True], ids=["default", "deterministic"])
def deterministic(request, monkeypatch):
    """Both GEMM routes on a GPU at test sizes: half precision goes to cuBLAS (its size
    threshold lowered to 0 here) unless deterministic algorithms are on, which keeps the
    Triton kernel."""
    from tzrec_ops.backends.triton import mm

    monkeypatch.setattr(mm, "CUBLAS_MIN_WORK", 0)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(request.param)
    yield request.param
    torch.use_deterministic_algorithms(before)


@pytest.mark.gpu
def test_cublas_takes_large_half_precision_products_only():
    from tzrec_ops.backends.triton.mm import uses_cublas

    def route(m, k, n, dtype=torch.bfloat16):
        return uses_cublas(torch.empty(m, k, dtype=dtype, device="cuda"),
                           torch.empty(k, n, dtype=dtype, device="cuda"))

    assert route(62000, 512, 2048) and route(62000, 512, 512, torch.float16)  # an STU layer's
    assert not route(7000, 64, 256)  # a small model's: host-bound, the fused kernel
    assert not route(62000, 512, 2048, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias_2d", [False, True])
def test_addmm_gpu_real_sizes(bias_2d, dtype, deterministic):
    from tzrec_ops.backends.triton.mm import uses_cublas

    half = dtype != torch.float32
    one = torch.empty(1, 1, dtype=dtype, device="cuda")
    assert uses_cublas(one, one) == (half and not deterministic)
    _check(3001, 512, 1536, bias_2d, dtype)
    _check(257, 300, 129, bias_2d, dtype, seed=1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_gpu_silu_and_colsum_match_oracle(dtype, deterministic):
    """The fused outputs on both routes: silu of the first columns and the fp32 column sum
    of ``b`` (the bias gradient), at a size that splits the Triton product along K."""
    from tzrec_ops.backends.triton.mm import matmul

    g = torch.Generator().manual_seed(5)
    a, b, bias = (torch.randn(*s, generator=g, dtype=torch.float64)
                  for s in ((2000, 256), (256, 384), (384,)))
    want = bias + a.to(dtype).double() @ b.to(dtype).double()
    out = torch.empty(2000, 384, dtype=dtype, device="cuda")
    act = torch.empty(2000, 200, dtype=dtype, device="cuda")[:, :128]
    matmul(a.to("cuda", dtype), b.to("cuda", dtype), out, bias=bias.to("cuda", dtype),
           silu_out=act)
    assert_close(out.cpu(), want, dtype, name="z")
    assert_close(act.cpu(), torch.nn.functional.silu(want[:, :128]), dtype, name="silu(z)")
    dz = torch.randn(20000, 96, generator=g, dtype=torch.float64)
    x = torch.randn(20000, 64, generator=g, dtype=torch.float64)
    dw = torch.empty(64, 96, dtype=dtype, device="cuda")
    colsum = torch.empty(96, dtype=torch.float32, device="cuda")
    matmul(x.to("cuda", dtype).t(), dz.to("cuda", dtype), dw, colsum=colsum)
    x16, dz16 = x.to(dtype).double(), dz.to(dtype).double()
    assert_close(dw.cpu(), x16.t() @ dz16, dtype, grad=True, name="dw")
    assert_close(colsum.cpu(), dz16.sum(0), torch.float32, grad=True, name="db")


@pytest.mark.gpu
def test_addmm_gpu_compile_and_opcheck():
    from tzrec_ops.backends.triton.mm import addmm_fwd

    x = torch.randn(300, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(128, 96, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(96, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    compiled = torch.compile(lambda b, x, w: addmm(b, x, w, backend="triton"), fullgraph=True)
    out = compiled(b, x, w)
    out.float().sum().backward()
    torch.testing.assert_close(out, addmm(b, x, w, backend="triton"))
    torch.library.opcheck(addmm_fwd.op, (b, x, w))
