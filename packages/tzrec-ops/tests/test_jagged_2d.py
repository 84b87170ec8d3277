"""Jagged concat/split/bmm: pytorch backend vs the float64 oracle, gradcheck, fbgemm-free
index path, compile/export and argument errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tzrec_ops.backends.pytorch import _common
from tzrec_ops.ops.jagged_2d import (
    concat_2D_jagged,
    jagged_dense_bmm_broadcast_add,
    split_2D_jagged,
)
from tzrec_ops.testing import ops_oracle as oracle
from tzrec_ops.testing.generators import lengths_strategy, offsets_from_lengths, random_values

SETTINGS = settings(max_examples=30, deadline=None, derandomize=True)
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
PT = "pytorch"


def _side(lengths, dense_len, dim, dtype, seed, offsets_dtype, strided=False):
    """(values, offsets or None, spans, max_len) of one side; ``dense_len`` set -> dense."""
    batch = len(lengths)
    if dense_len is not None:
        lengths = [dense_len] * batch
    total = sum(lengths)
    if strided:
        values = random_values(dim, (total,), dtype, seed).t()
    else:
        values = random_values(total, (dim,), dtype, seed)
    offsets = None if dense_len is not None else offsets_from_lengths(lengths, offsets_dtype)
    spans = oracle.spans(offsets_from_lengths(lengths))
    return values.requires_grad_(), offsets, spans, max([0, *lengths])


def _check_concat_split(
    lengths_l, lengths_r, dense, dim, dtype, offsets_dtype, seed=0, strided=False
):
    """concat vs the oracle (fwd + bwd), then split(concat) vs the oracle (fwd + bwd)."""
    left, off_l, spans_l, max_l = _side(
        lengths_l, dense[0], dim, dtype, seed, offsets_dtype, strided
    )
    right, off_r, spans_r, max_r = _side(
        lengths_r, dense[1], dim, dtype, seed + 1, offsets_dtype, strided
    )
    out = concat_2D_jagged(left, right, max_l, max_r, off_l, off_r, backend=PT)
    ref_in = oracle.f64_copies(left, right)
    expected = oracle.concat_2D_jagged(*ref_in, spans_l, spans_r)
    oracle.assert_fwd_bwd(out, expected, [left, right], ref_in, ["left", "right"], dtype, seed)

    values = out.detach().requires_grad_()
    nl = [e - s for s, e in spans_l]
    nr = [e - s for s, e in spans_r]
    got_l, got_r = split_2D_jagged(
        max([0, *(a + b for a, b in zip(nl, nr))]),
        values,
        total_len_left=sum(nl) if seed % 2 else None,  # exercise the derived total too
        max_len_left=max_l,
        max_len_right=max_r,
        offsets_left=off_l,
        offsets_right=off_r,
        backend=PT,
    )
    torch.testing.assert_close(got_l, left.detach(), atol=0, rtol=0)
    torch.testing.assert_close(got_r, right.detach(), atol=0, rtol=0)
    (ref_values,) = oracle.f64_copies(values)
    exp_l, exp_r = oracle.split_2D_jagged(ref_values, nl, nr)
    both = torch.cat([got_l, got_r])
    oracle.assert_fwd_bwd(
        both, torch.cat([exp_l, exp_r]), [values], [ref_values], ["values"], dtype, seed
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dense", [(None, None), (3, None), (None, 2)])
@pytest.mark.parametrize("offsets_dtype", [torch.int32, torch.int64])
def test_concat_split_match_oracle(dtype, dense, offsets_dtype):
    _check_concat_split([3, 0, 5, 1], [2, 4, 0, 1], dense, 7, dtype, offsets_dtype)


@SETTINGS
@given(
    lengths=lengths_strategy(max_batch=5, max_len=9),
    data=st.data(),
    dense=st.sampled_from([(None, None), (2, None), (None, 3), (0, None)]),
    dim=st.integers(1, 9),
    dtype=st.sampled_from(DTYPES[:3]),
    offsets_dtype=st.sampled_from([torch.int32, torch.int64]),
    strided=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_concat_split_sweep(lengths, data, dense, dim, dtype, offsets_dtype, strided, seed):
    right = data.draw(st.lists(st.integers(0, 9), min_size=len(lengths), max_size=len(lengths)))
    _check_concat_split(lengths, right, dense, dim, dtype, offsets_dtype, seed, strided)


def _bmm_inputs(lengths, k, n, dtype, offsets_dtype, seed=0, transposed=False):
    batch = len(lengths)
    jagged = random_values(sum(lengths), (k,), dtype, seed)
    if transposed:  # [B, K, N] view of a [B, N, K] buffer
        dense = random_values(batch, (n, k), dtype, seed + 1).transpose(1, 2)
    else:
        dense = random_values(batch, (k, n), dtype, seed + 1)
    bias = random_values(batch, (n,), dtype, seed + 2)
    offsets = offsets_from_lengths(lengths, offsets_dtype)
    return offsets, [t.requires_grad_() for t in (jagged, dense, bias)]


def _check_bmm(lengths, k, n, dtype, offsets_dtype, seed=0, transposed=False, slack=0):
    offsets, inputs = _bmm_inputs(lengths, k, n, dtype, offsets_dtype, seed, transposed)
    max_len = max([0, *lengths]) + slack
    out = jagged_dense_bmm_broadcast_add(max_len, offsets, *inputs, backend=PT)
    assert out.dtype == dtype and out.shape == (sum(lengths), n)
    ref_in = oracle.f64_copies(*inputs)
    expected = oracle.jagged_dense_bmm_broadcast_add(offsets, *ref_in)
    oracle.assert_fwd_bwd(out, expected, inputs, ref_in, ["jagged", "dense", "bias"], dtype, seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transposed", [False, True])
def test_bmm_matches_oracle(dtype, transposed):
    _check_bmm([5, 0, 9, 1], 13, 11, dtype, torch.int64, transposed=transposed, slack=3)


@SETTINGS
@given(
    lengths=lengths_strategy(max_batch=4, max_len=12),
    k=st.integers(1, 16),
    n=st.integers(1, 16),
    dtype=st.sampled_from(DTYPES[:3]),
    offsets_dtype=st.sampled_from([torch.int32, torch.int64]),
    transposed=st.booleans(),
    slack=st.integers(0, 3),
    seed=st.integers(0, 1000),
)
def test_bmm_sweep(lengths, k, n, dtype, offsets_dtype, transposed, slack, seed):
    _check_bmm(lengths, k, n, dtype, offsets_dtype, seed, transposed, slack)


def test_gradcheck():
    left, off_l, _, max_l = _side([2, 0, 3], None, 3, torch.float64, 0, torch.int64)
    right, off_r, _, max_r = _side([1, 2, 0], None, 3, torch.float64, 1, torch.int64)
    assert torch.autograd.gradcheck(
        lambda a, b: concat_2D_jagged(a, b, max_l, max_r, off_l, off_r, backend=PT), (left, right)
    )
    values = random_values(8, (3,), torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda v: split_2D_jagged(5, v, offsets_left=off_l, offsets_right=off_r, backend=PT),
        (values,),
    )
    offsets, inputs = _bmm_inputs([2, 0, 3], 3, 2, torch.float64, torch.int64)
    assert torch.autograd.gradcheck(
        lambda *a: jagged_dense_bmm_broadcast_add(4, offsets, *a, backend=PT), inputs
    )


def test_padding_helpers_without_fbgemm(monkeypatch):
    """The index-based padding path (used when fbgemm-gpu is absent) round-trips exactly."""
    monkeypatch.setattr(_common, "HAS_FBGEMM", False)
    offsets = offsets_from_lengths([2, 0, 3], torch.int32)
    values = random_values(5, (4,), torch.float32)
    padded = _common.jagged_to_padded(values, offsets, 4)
    assert padded.shape == (3, 4, 4)
    torch.testing.assert_close(padded[0, :2], values[:2], atol=0, rtol=0)
    torch.testing.assert_close(padded[2, :3], values[2:], atol=0, rtol=0)
    assert padded[0, 2:].abs().sum() == 0 and padded[1].abs().sum() == 0
    torch.testing.assert_close(_common.padded_to_jagged(padded, offsets, 5), values, atol=0, rtol=0)


@pytest.mark.skipif(not _common.HAS_FBGEMM, reason="fbgemm-gpu is not installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fbgemm_path_equals_index_path(monkeypatch, dtype):
    offsets = offsets_from_lengths([3, 0, 5, 1], torch.int64)
    _, inputs = _bmm_inputs([3, 0, 5, 1], 6, 4, dtype, torch.int64)
    with_fbgemm = jagged_dense_bmm_broadcast_add(7, offsets, *inputs, backend=PT)
    monkeypatch.setattr(_common, "HAS_FBGEMM", False)
    without = jagged_dense_bmm_broadcast_add(7, offsets, *inputs, backend=PT)
    torch.testing.assert_close(with_fbgemm, without, atol=0, rtol=0)


def test_compile_and_export():
    offsets, inputs = _bmm_inputs([3, 1, 4], 5, 6, torch.float32, torch.int64)
    jagged, dense, bias = (t.detach() for t in inputs)
    off_r = offsets_from_lengths([1, 0, 2])
    right = random_values(3, (5,), torch.float32, 9)

    def fn(jagged, dense, bias, right):
        out = jagged_dense_bmm_broadcast_add(4, offsets, jagged, dense, bias, backend=PT)
        cat = concat_2D_jagged(jagged, right, 4, 2, offsets, off_r, backend=PT)
        left, rest = split_2D_jagged(
            6, cat, total_len_left=8, offsets_left=offsets, offsets_right=off_r, backend=PT
        )
        return out, cat, left, rest

    expected = fn(jagged, dense, bias, right)
    got = torch.compile(fn, fullgraph=True)(jagged, dense, bias, right)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)

    class Model(torch.nn.Module):
        def forward(self, *args):
            return fn(*args)

    exported = torch.export.export(Model(), (jagged, dense, bias, right))
    for g, e in zip(exported.module()(jagged, dense, bias, right), expected):
        torch.testing.assert_close(g, e)


def _concat_args():
    left = torch.randn(5, 3)
    right = torch.randn(3, 3)
    return left, right, offsets_from_lengths([2, 3]), offsets_from_lengths([1, 2])


@pytest.mark.parametrize(
    "call, error, match",
    [
        (
            lambda lv, r, ol, orr: concat_2D_jagged(lv[0], r, 3, 2, ol, orr),
            ValueError,
            r"values_left must be 2-D, got 1-D",
        ),
        (
            lambda lv, r, ol, orr: concat_2D_jagged(lv, r[:, :2], 3, 2, ol, orr),
            ValueError,
            r"values_right.shape\[1\] \(2\) must equal values_left.shape\[1\] \(3\)",
        ),
        (
            lambda lv, r, ol, orr: concat_2D_jagged(lv, r.double(), 3, 2, ol, orr),
            TypeError,
            r"values_right has dtype torch.float64 but values_left has torch.float32",
        ),
        (
            lambda lv, r, ol, orr: concat_2D_jagged(lv, r.to("meta"), 3, 2, ol, orr),
            ValueError,
            r"values_right is on meta but values_left is on cpu",
        ),
        (
            lambda lv, r, ol, orr: concat_2D_jagged(lv, r, -1, 2, ol, orr),
            ValueError,
            r"max_len_left must be >= 0, got -1",
        ),
        (
            lambda lv, r, ol, orr: concat_2D_jagged(lv, r, 3, 2, ol.float(), orr),
            TypeError,
            r"offsets_left must be int32 or int64, got torch.float32",
        ),
        (
            lambda lv, r, ol, orr: concat_2D_jagged(lv, r, 3, 2, ol, orr[:2]),
            ValueError,
            r"offsets_left \(3 entries\) and offsets_right \(2 entries\) must describe the same batch",  # noqa: E501
        ),
        (
            lambda lv, r, ol, orr: concat_2D_jagged(lv, r, 3, 2, ol, None),
            ValueError,
            r"values_right.shape\[0\] \(3\) must equal B \* max_len_right = 2 \* 2 = 4 for a dense "
            r"right side",
        ),
        (
            lambda lv, r, ol, orr: concat_2D_jagged(lv, r, 3, 2, torch.tensor([0, 3, 2]), orr),
            ValueError,
            r"offsets_left must be non-decreasing",
        ),
        (
            lambda lv, r, ol, orr: concat_2D_jagged(lv, r, 3, 2, torch.tensor([0, 2, 4]), orr),
            ValueError,
            r"offsets_left\[-1\] must equal values_left.shape\[0\] \(5\), got 4",
        ),
        (
            lambda lv, r, ol, orr: concat_2D_jagged(lv, r, 3, 2, torch.tensor([1, 2, 5]), orr),
            ValueError,
            r"offsets_left\[0\] must be 0",
        ),
        (
            lambda lv, r, ol, orr: concat_2D_jagged(lv, r, 2, 2, ol, orr),
            ValueError,
            r"every sequence length \(offsets_left\[b \+ 1\] - offsets_left\[b\]\) must be <= "
            r"max_len_left \(2\), got 3 for sequence 1",
        ),
        (
            lambda lv, r, ol, orr: split_2D_jagged(5, lv, max_len_left=2),
            ValueError,
            r"needs offsets_left or offsets_right",
        ),
        (
            lambda lv, r, ol, orr: split_2D_jagged(5, lv, offsets_right=ol),
            ValueError,
            r"max_len_left is required when offsets_left is None",
        ),
        (
            lambda lv, r, ol, orr: split_2D_jagged(
                5,
                torch.randn(8, 3),
                total_len_left=3,
                total_len_right=4,
                offsets_left=ol,
                offsets_right=orr,
            ),
            ValueError,
            r"total_len_left \(3\) \+ total_len_right \(4\) must equal values.shape\[0\] \(8\)",
        ),
        (
            lambda lv, r, ol, orr: split_2D_jagged(
                5, torch.randn(7, 3), total_len_left=3, max_len_left=2, offsets_right=orr
            ),
            ValueError,
            r"total_len_left \(3\) must equal B \* max_len_left \(4\) for a dense left side",
        ),
        (
            lambda lv, r, ol, orr: split_2D_jagged(
                4, torch.randn(8, 3), offsets_left=ol, offsets_right=orr
            ),
            ValueError,
            r"left \+ right lengths must be <= max_seq_len \(4\), got 5 for sequence 1",
        ),
        (
            lambda lv, r, ol, orr: split_2D_jagged(-1, lv, offsets_left=ol),
            ValueError,
            r"max_seq_len must be >= 0, got -1",
        ),
        (
            lambda lv, r, ol, orr: jagged_dense_bmm_broadcast_add(
                3, ol, lv, torch.randn(2, 4, 2), torch.randn(2, 2)
            ),
            ValueError,
            r"dense.shape\[1\] \(4\) must equal jagged.shape\[1\] \(3\)",
        ),
        (
            lambda lv, r, ol, orr: jagged_dense_bmm_broadcast_add(
                3, ol, lv, torch.randn(2, 3, 2), torch.randn(2, 5)
            ),
            ValueError,
            r"bias.shape\[1\] \(5\) must equal dense.shape\[2\] \(2\)",
        ),
        (
            lambda lv, r, ol, orr: jagged_dense_bmm_broadcast_add(
                3, ol, lv, torch.randn(3, 3, 2), torch.randn(3, 2)
            ),
            ValueError,
            r"seq_offsets must have B \+ 1 = 4 entries, got 3",
        ),
        (
            lambda lv, r, ol, orr: jagged_dense_bmm_broadcast_add(
                3, ol, lv, torch.randn(2, 3, 2), torch.randn(2, 2)[0]
            ),
            ValueError,
            r"bias must be 2-D, got 1-D",
        ),
        (
            lambda lv, r, ol, orr: jagged_dense_bmm_broadcast_add(
                3, ol, lv, torch.randn(2, 3, 2).half(), torch.randn(2, 2)
            ),
            TypeError,
            r"dense has dtype torch.float16 but jagged has torch.float32",
        ),
        (
            lambda lv, r, ol, orr: jagged_dense_bmm_broadcast_add(
                2, ol, lv, torch.randn(2, 3, 2), torch.randn(2, 2)
            ),
            ValueError,
            r"every sequence length \(seq_offsets\[b \+ 1\] - seq_offsets\[b\]\) must be <= "
            r"max_seq_len \(2\), got 3 for sequence 1",
        ),
        (
            lambda lv, r, ol, orr: jagged_dense_bmm_broadcast_add(
                3, ol.to("meta"), lv, torch.randn(2, 3, 2), torch.randn(2, 2)
            ),
            ValueError,
            r"seq_offsets is on meta but jagged is on cpu",
        ),
    ],
)
def test_errors(call, error, match):
    with pytest.raises(error, match=match):
        call(*_concat_args())
