"""Triton positional and timestamp embeddings against the float64 oracle.

The oracle is the pytorch backend on float64 copies (it computes time buckets in float64, as
the kernel does, so buckets agree exactly). CPU runs use the Triton interpreter at small
shapes; ``pytest -m gpu`` repeats them at real sizes.
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
from tzrec_ops.ops import position as P  # noqa: E402
from tzrec_ops.testing.tolerances import assert_close  # noqa: E402

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SETTINGS = settings(max_examples=10, deadline=None, derandomize=True)


def _pair(base, dtype):
    return (
        base.to(DEVICE, dtype).requires_grad_(),
        base.to(dtype).to(DEVICE, torch.float64).requires_grad_(),
    )


def _sequences(lengths, targets, interleave):
    factor = 2 if interleave else 1
    targets = [min(t, n // factor) for t, n in zip(targets, lengths)]
    return (
        offsets_from_lengths(lengths).to(DEVICE),
        torch.tensor(lengths, device=DEVICE),
        torch.tensor(targets, device=DEVICE),
    )


def _backward_and_compare(out, expected, pairs, dtype, g):
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64).to(dtype)
    out.backward(dout.to(DEVICE))
    expected.backward(dout.to(DEVICE, torch.float64))
    for name, a, b in pairs:
        assert_close(a.grad, b.grad, dtype, grad=True, name=name)


def _position_case(
    lengths, targets, use_targets, interleave, table_rows, dim, alpha, dtype, seed=0
):
    g = torch.Generator().manual_seed(seed)
    offsets, seq_lengths, num_targets = _sequences(lengths, targets, interleave)
    num_targets = num_targets if use_targets else None
    x, x64 = _pair(torch.randn(sum(lengths), dim, generator=g, dtype=torch.float64), dtype)
    table, table64 = _pair(torch.randn(table_rows, dim, generator=g, dtype=torch.float64), dtype)
    max_seq_len = max(lengths + [1])
    out = P.add_positional_embeddings(
        alpha,
        max_seq_len,
        table,
        offsets,
        seq_lengths,
        x,
        num_targets,
        interleave,
        backend="triton",
    )
    expected = P.add_positional_embeddings(
        alpha,
        max_seq_len,
        table64,
        offsets,
        seq_lengths,
        x64,
        num_targets,
        interleave,
        backend="pytorch",
    )
    assert_close(out, expected, dtype, name="out")
    _backward_and_compare(out, expected, [("d_x", x, x64), ("d_table", table, table64)], dtype, g)


@SETTINGS
@given(
    lengths=st.lists(st.integers(0, 12), min_size=1, max_size=4),
    targets=st.lists(st.integers(0, 5), min_size=4, max_size=4),
    use_targets=st.booleans(),
    interleave=st.booleans(),
    table_rows=st.integers(1, 14),
    dim=st.integers(1, 40),
    alpha=st.sampled_from([0.5, 1.0]),
    dtype=st.sampled_from(DTYPES),
)
def test_positional_matches_oracle(
    lengths, targets, use_targets, interleave, table_rows, dim, alpha, dtype
):
    _position_case(lengths, targets, use_targets, interleave, table_rows, dim, alpha, dtype)


def _timestamp_case(
    lengths,
    targets,
    contextual,
    bucket_fn,
    use_query_time,
    dim,
    dtype,
    pos_rows=None,
    num_buckets=40,
    seed=0,
):
    g = torch.Generator().manual_seed(seed)
    offsets, seq_lengths, num_targets = _sequences(lengths, targets, False)
    total = sum(lengths)
    timestamps = torch.cumsum(torch.randint(0, 86400, (total,), generator=g), 0).to(DEVICE)
    query_time = None
    if use_query_time:
        query_time = (
            (timestamps.max() + torch.randint(0, 10**6, (len(lengths), 1), generator=g).to(DEVICE))
            if total
            else torch.zeros(len(lengths), 1, dtype=torch.int64, device=DEVICE)
        )
    x, x64 = _pair(torch.randn(total, dim, generator=g, dtype=torch.float64), dtype)
    pos_rows = pos_rows or max(lengths + [1]) + contextual + 1
    ptab, ptab64 = _pair(torch.randn(pos_rows, dim, generator=g, dtype=torch.float64), dtype)
    ttab, ttab64 = _pair(torch.randn(num_buckets + 1, dim, generator=g, dtype=torch.float64), dtype)
    max_seq_len = max(lengths + [1])
    args = (offsets, seq_lengths)

    def run(ptab, ttab, x, backend):
        return P.add_timestamp_positional_embeddings(
            0.7,
            max_seq_len,
            contextual,
            ptab,
            ttab,
            *args,
            x,
            timestamps,
            num_targets,
            False,
            bucket_fn,
            30.0,
            query_time=query_time,
            backend=backend,
        )

    out = run(ptab, ttab, x, "triton")
    expected = run(ptab64, ttab64, x64, "pytorch")
    assert_close(out, expected, dtype, name="out")
    _backward_and_compare(
        out,
        expected,
        [("d_x", x, x64), ("d_pos_table", ptab, ptab64), ("d_ts_table", ttab, ttab64)],
        dtype,
        g,
    )


@SETTINGS
@given(
    lengths=st.lists(st.integers(0, 12), min_size=1, max_size=4),
    targets=st.lists(st.integers(0, 4), min_size=4, max_size=4),
    contextual=st.integers(0, 3),
    bucket_fn=st.sampled_from(["sqrt", "log"]),
    use_query_time=st.booleans(),
    dim=st.integers(1, 24),
    dtype=st.sampled_from(DTYPES),
    pos_rows=st.sampled_from([None, 3]),
)
def test_timestamp_matches_oracle(
    lengths, targets, contextual, bucket_fn, use_query_time, dim, dtype, pos_rows
):
    _timestamp_case(lengths, targets, contextual, bucket_fn, use_query_time, dim, dtype, pos_rows)


def test_timestamp_rejects_unknown_bucket_fn():
    offsets = offsets_from_lengths([2]).to(DEVICE)
    x = torch.randn(2, 4, device=DEVICE)
    with pytest.raises(ValueError, match="time_bucket_fn"):
        P.add_timestamp_positional_embeddings(
            1.0,
            2,
            0,
            torch.randn(3, 4, device=DEVICE),
            torch.randn(5, 4, device=DEVICE),
            offsets,
            torch.tensor([2], device=DEVICE),
            x,
            torch.tensor([1, 2], device=DEVICE),
            None,
            False,
            "cube",
            backend="triton",
        )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_position_gpu_real_sizes(dtype):
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(400, 500, (48,), generator=g).tolist()
    targets = torch.randint(1, 20, (48,), generator=g).tolist()
    _position_case(lengths, targets, True, False, 520, 200, 0.5, dtype)
    _position_case(lengths, targets, True, True, 300, 64, 1.0, dtype)
    _timestamp_case(lengths, targets, 10, "sqrt", False, 256, dtype, num_buckets=1000)
    _timestamp_case(lengths, targets, 10, "log", True, 130, dtype, num_buckets=1000)


@pytest.mark.gpu
def test_position_gpu_compile():
    offsets = offsets_from_lengths([30, 0, 77]).to("cuda")
    lengths = torch.tensor([30, 0, 77], device="cuda")
    x = torch.randn(107, 64, device="cuda", requires_grad=True)
    table = torch.randn(100, 64, device="cuda", requires_grad=True)
    ttab = torch.randn(101, 64, device="cuda", requires_grad=True)
    ts = torch.arange(107, device="cuda") * 1000

    def f(x, table, ttab):
        y = P.add_positional_embeddings(
            0.5, 80, table, offsets, lengths, x, None, False, backend="triton"
        )
        return P.add_timestamp_positional_embeddings(
            1.0, 80, 0, table, ttab, offsets, lengths, y, ts, None, False, backend="triton"
        )

    out = torch.compile(f, fullgraph=True)(x, table, ttab)
    out.sum().backward()
    torch.testing.assert_close(out, f(x, table, ttab))
