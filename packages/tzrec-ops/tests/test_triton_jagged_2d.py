"""Triton jagged concat/split and jagged-dense bmm against the float64 oracle.

The oracle is the pytorch backend on float64 copies; CPU runs use the Triton interpreter at
small shapes, ``pytest -m gpu`` repeats them at real sizes.
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
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tzrec_ops.jagged import offsets_from_lengths  # noqa: E402
from tzrec_ops.ops import jagged_2d as J  # noqa: E402
from tzrec_ops.testing.tolerances import assert_close  # noqa: E402

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SETTINGS = settings(max_examples=12, deadline=None, derandomize=True)


def _pair(base, dtype):
    return (
        base.to(DEVICE, dtype).requires_grad_(),
        base.to(dtype).to(DEVICE, torch.float64).requires_grad_(),
    )


def _side(lengths, dense, max_len, offsets_dtype):
    if dense:
        return None, [max_len] * len(lengths)
    return offsets_from_lengths(lengths, offsets_dtype).to(DEVICE), lengths


def _concat_split_case(
    left_lengths, right_lengths, dense_left, dense_right, dim, dtype, offsets_dtype, seed=0
):
    max_l = max(left_lengths + [1])
    max_r = max(right_lengths + [1])
    off_l, left_lengths = _side(left_lengths, dense_left, max_l, offsets_dtype)
    off_r, right_lengths = _side(right_lengths, dense_right, max_r, offsets_dtype)
    g = torch.Generator().manual_seed(seed)
    left, left64 = _pair(
        torch.randn(sum(left_lengths), dim, generator=g, dtype=torch.float64), dtype
    )
    right, right64 = _pair(
        torch.randn(sum(right_lengths), dim, generator=g, dtype=torch.float64), dtype
    )
    out = J.concat_2D_jagged(left, right, max_l, max_r, off_l, off_r, backend="triton")
    expected = J.concat_2D_jagged(left64, right64, max_l, max_r, off_l, off_r, backend="pytorch")
    assert torch.equal(out.double(), expected)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64).to(dtype)
    out.backward(dout.to(DEVICE))
    expected.backward(dout.to(DEVICE, torch.float64))
    assert torch.equal(left.grad.double(), left64.grad)
    assert torch.equal(right.grad.double(), right64.grad)
    if dense_left and dense_right:
        return
    values, values64 = _pair(expected.detach().cpu(), dtype)
    kwargs = dict(
        total_len_left=sum(left_lengths),
        max_len_left=max_l if dense_left else None,
        max_len_right=max_r if dense_right else None,
        offsets_left=off_l,
        offsets_right=off_r,
    )
    got_l, got_r = J.split_2D_jagged(max_l + max_r, values, backend="triton", **kwargs)
    ref_l, ref_r = J.split_2D_jagged(max_l + max_r, values64, backend="pytorch", **kwargs)
    assert torch.equal(got_l.double(), ref_l) and torch.equal(got_r.double(), ref_r)
    (got_l.sum() + 2 * got_r.sum()).backward()
    (ref_l.sum() + 2 * ref_r.sum()).backward()
    assert torch.equal(values.grad.double(), values64.grad)


@SETTINGS
@given(
    left=st.lists(st.integers(0, 6), min_size=1, max_size=4),
    right_extra=st.lists(st.integers(0, 6), min_size=4, max_size=4),
    dense=st.sampled_from([(False, False), (True, False), (False, True), (True, True)]),
    dim=st.integers(1, 40),
    dtype=st.sampled_from(DTYPES),
    offsets_dtype=st.sampled_from([torch.int32, torch.int64]),
)
def test_concat_split_roundtrip_matches_oracle(left, right_extra, dense, dim, dtype, offsets_dtype):
    right = right_extra[: len(left)]
    _concat_split_case(left, right, *dense, dim, dtype, offsets_dtype)


def _bmm_case(lengths, k, n, dtype, transposed, seed=0, max_seq_len=None):
    g = torch.Generator().manual_seed(seed)
    batch = len(lengths)
    offsets = offsets_from_lengths(lengths).to(DEVICE)
    jag, jag64 = _pair(torch.randn(sum(lengths), k, generator=g, dtype=torch.float64), dtype)
    dense_base = torch.randn(batch, n, k, generator=g, dtype=torch.float64).transpose(1, 2)
    if not transposed:
        dense_base = dense_base.contiguous()
    dense = dense_base.to(DEVICE, dtype).requires_grad_()
    dense64 = dense_base.to(dtype).to(DEVICE, torch.float64).requires_grad_()
    bias, bias64 = _pair(torch.randn(batch, n, generator=g, dtype=torch.float64), dtype)
    max_seq_len = max_seq_len or max(lengths + [1])
    out = J.jagged_dense_bmm_broadcast_add(max_seq_len, offsets, jag, dense, bias, backend="triton")
    expected = J.jagged_dense_bmm_broadcast_add(
        max_seq_len, offsets, jag64, dense64, bias64, backend="pytorch"
    )
    assert_close(out, expected, dtype, name="out")
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64).to(dtype)
    out.backward(dout.to(DEVICE))
    expected.backward(dout.to(DEVICE, torch.float64))
    for name, a, b in (
        ("d_jagged", jag, jag64),
        ("d_dense", dense, dense64),
        ("d_bias", bias, bias64),
    ):
        assert_close(a.grad, b.grad, dtype, grad=True, name=name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("lengths,k,n", [([5, 0, 17], 13, 9), ([1], 3, 20), ([0, 0], 4, 4)])
def test_jagged_dense_bmm_matches_oracle(lengths, k, n, transposed, dtype):
    _bmm_case(lengths, k, n, dtype, transposed)


def test_bmm_rejects_mismatched_dense():
    offsets = offsets_from_lengths([2, 3]).to(DEVICE)
    jag = torch.randn(5, 4, device=DEVICE)
    with pytest.raises(
        ValueError, match=r"dense.shape\[1\] \(3\) must equal jagged.shape\[1\] \(4\)"
    ):
        J.jagged_dense_bmm_broadcast_add(
            3,
            offsets,
            jag,
            torch.randn(2, 3, 6, device=DEVICE),
            torch.randn(2, 6, device=DEVICE),
            backend="triton",
        )


def test_split_needs_offsets():
    with pytest.raises(ValueError, match="needs offsets_left or offsets_right"):
        J.split_2D_jagged(
            4, torch.randn(4, 2, device=DEVICE), max_len_left=1, max_len_right=1, backend="triton"
        )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_jagged_gpu_real_sizes(dtype):
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 700, (64,), generator=g).tolist()
    targets = torch.randint(0, 20, (64,), generator=g).tolist()
    _concat_split_case(lengths, targets, False, False, 256, dtype, torch.int64)
    _concat_split_case(lengths, targets, True, False, 130, dtype, torch.int32)
    _bmm_case(lengths, 200, 130, dtype, transposed=True, max_seq_len=700)
    _bmm_case(lengths, 512, 256, dtype, transposed=False, max_seq_len=1024)


@pytest.mark.gpu
def test_jagged_gpu_compile():
    offsets = offsets_from_lengths([30, 0, 77]).to("cuda")
    jag = torch.randn(107, 64, device="cuda", requires_grad=True)
    dense = torch.randn(3, 64, 32, device="cuda", requires_grad=True)
    bias = torch.randn(3, 32, device="cuda", requires_grad=True)
    right = torch.randn(6, 32, device="cuda", requires_grad=True)

    def f(jag, dense, bias, right):
        out = J.jagged_dense_bmm_broadcast_add(80, offsets, jag, dense, bias, backend="triton")
        return J.concat_2D_jagged(out, right, 80, 2, offsets, None, backend="triton")

    out = torch.compile(f, fullgraph=True)(jag, dense, bias, right)
    out.sum().backward()
    torch.testing.assert_close(out, f(jag, dense, bias, right))
