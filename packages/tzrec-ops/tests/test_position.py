"""Positional and timestamp embeddings: pytorch backend vs the float64 oracle, bucket and
position semantics (including query_time), gradcheck, compile/export and argument errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tzrec_ops.ops.position import add_positional_embeddings, add_timestamp_positional_embeddings
from tzrec_ops.testing import ops_oracle as oracle
from tzrec_ops.testing.generators import lengths_strategy, offsets_from_lengths, random_values

SETTINGS = settings(max_examples=30, deadline=None, derandomize=True)
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
PT = "pytorch"


def _batch(lengths, targets, dim, dtype, offsets_dtype, seed):
    offsets = offsets_from_lengths(lengths, offsets_dtype)
    seq_lengths = torch.tensor(lengths, dtype=offsets_dtype)
    x = random_values(sum(lengths), (dim,), dtype, seed).requires_grad_()
    nt = None if targets is None else torch.tensor(targets, dtype=offsets_dtype)
    return offsets, seq_lengths, x, nt


def _table(rows, dim, dtype, seed):
    return random_values(rows, (dim,), dtype, seed).requires_grad_()


def _check_pos(
    lengths,
    targets,
    interleave,
    table_rows,
    dim,
    dtype,
    alpha,
    offsets_dtype=torch.int64,
    seed=0,
    table_dtype=None,
):
    offsets, seq_lengths, x, nt = _batch(lengths, targets, dim, dtype, offsets_dtype, seed)
    table = _table(table_rows, dim, table_dtype or dtype, seed + 1)
    max_len = max([1, *lengths])
    out = add_positional_embeddings(
        alpha, max_len, table, offsets, seq_lengths, x, nt, interleave, backend=PT
    )
    assert out.dtype == dtype and out.shape == x.shape
    ref_x, ref_t = oracle.f64_copies(x, table)
    expected = oracle.add_positional_embeddings(alpha, ref_t, offsets, ref_x, targets, interleave)
    oracle.assert_fwd_bwd(out, expected, [x, table], [ref_x, ref_t], ["x", "table"], dtype, seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleave", [False, True])
def test_positional_matches_oracle(dtype, interleave):
    _check_pos([7, 0, 1, 12], [2, 0, 0, 3], interleave, 9, 6, dtype, 0.5)


def test_positional_semantics():
    """One sequence of 5 tokens, 2 targets: rows P[0], P[1], P[2], P[3], P[3]."""
    table = torch.arange(16.0).unsqueeze(1)
    x = torch.zeros(5, 1)
    offsets = torch.tensor([0, 5])
    out = add_positional_embeddings(
        1.0, 5, table, offsets, torch.tensor([5]), x, torch.tensor([2]), False
    )
    assert out.squeeze(1).tolist() == [0, 1, 2, 3, 3]
    out = add_positional_embeddings(
        1.0, 5, table, offsets, torch.tensor([5]), x, torch.tensor([2]), True
    )
    assert out.squeeze(1).tolist() == [0, 1, 1, 1, 1]  # interleaved: high = 5 - 2 * 2
    out = add_positional_embeddings(1.0, 5, table[:3], offsets, torch.tensor([5]), x, None, False)
    assert out.squeeze(1).tolist() == [0, 1, 2, 2, 2]  # no targets, clamped to K - 1


@st.composite
def _cases(draw, max_len=10):
    lengths = draw(lengths_strategy(max_batch=4, max_len=max_len))
    interleave = draw(st.booleans())
    with_targets = draw(st.booleans())
    targets = None
    if with_targets:
        targets = [
            draw(
                st.one_of(
                    st.just(n // (2 if interleave else 1)),
                    st.integers(0, n // (2 if interleave else 1)),
                )
            )
            for n in lengths
        ]
    return lengths, targets, interleave


@SETTINGS
@given(
    case=_cases(),
    table_rows=st.integers(1, 14),
    dim=st.integers(1, 8),
    dtype=st.sampled_from(DTYPES[:3]),
    alpha=st.sampled_from([0.5, 1.0]),
    offsets_dtype=st.sampled_from([torch.int32, torch.int64]),
    fp32_table=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_positional_sweep(case, table_rows, dim, dtype, alpha, offsets_dtype, fp32_table, seed):
    lengths, targets, interleave = case
    _check_pos(
        lengths,
        targets,
        interleave,
        table_rows,
        dim,
        dtype,
        alpha,
        offsets_dtype,
        seed,
        torch.float32 if fp32_table else None,
    )


def _timestamps(lengths, contextual, seed, dtype=torch.int64):
    """Per sequence: ``contextual`` zeros, then an increasing cumsum of random gaps."""
    g = torch.Generator().manual_seed(seed + 5)
    parts = []
    for n in lengths:
        gaps = torch.randint(0, 86400, (max(n - contextual, 0),), generator=g)
        base = torch.randint(1_600_000_000, 1_700_000_000, (1,), generator=g)
        prefix = torch.zeros(min(n, contextual), dtype=torch.int64)
        parts.append(torch.cat([prefix, base + torch.cumsum(gaps, 0)]))
    return torch.cat([torch.zeros(0, dtype=torch.int64), *parts]).to(dtype)


def _check_ts(
    lengths,
    targets,
    interleave,
    contextual,
    fn,
    increments,
    pos_rows,
    ts_rows,
    dim,
    dtype,
    alpha=1.0,
    offsets_dtype=torch.int64,
    seed=0,
    query=None,
    ts_dtype=torch.int64,
):
    offsets, seq_lengths, x, nt = _batch(lengths, targets, dim, dtype, offsets_dtype, seed)
    pos_table = _table(pos_rows, dim, torch.float32, seed + 1)
    ts_table = _table(ts_rows, dim, torch.float32, seed + 2)
    ts = _timestamps(lengths, contextual, seed, ts_dtype)
    query_time = None if query is None else torch.tensor(query, dtype=ts_dtype)
    out = add_timestamp_positional_embeddings(
        alpha,
        max([1, *lengths]),
        contextual,
        pos_table,
        ts_table,
        offsets,
        seq_lengths,
        x,
        ts,
        nt,
        interleave,
        fn,
        increments,
        query_time,
        backend=PT,
    )
    assert out.dtype == dtype and out.shape == x.shape
    ref_in = oracle.f64_copies(x, pos_table, ts_table)
    query_list = None if query_time is None else query_time.reshape(-1).tolist()
    expected = oracle.add_timestamp_positional_embeddings(
        alpha,
        contextual,
        ref_in[1],
        ref_in[2],
        offsets,
        ref_in[0],
        ts,
        targets,
        interleave,
        fn,
        increments,
        query_list,
    )
    oracle.assert_fwd_bwd(
        out, expected, [x, pos_table, ts_table], ref_in, ["x", "pos_table", "ts_table"], dtype, seed
    )
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fn", ["sqrt", "log"])
def test_timestamp_matches_oracle(dtype, fn):
    _check_ts([9, 0, 1, 14], [2, 0, 1, 3], False, 3, fn, 60.0, 12, 21, 5, dtype, alpha=0.5)


@SETTINGS
@given(
    case=_cases(max_len=12),
    contextual=st.integers(0, 4),
    fn=st.sampled_from(["sqrt", "log"]),
    increments=st.sampled_from([10.0, 60.0, 97.0]),
    pos_rows=st.integers(1, 16),
    ts_rows=st.integers(1, 40),
    dim=st.integers(1, 6),
    dtype=st.sampled_from(DTYPES[:3]),
    offsets_dtype=st.sampled_from([torch.int32, torch.int64]),
    with_query=st.booleans(),
    float_ts=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_timestamp_sweep(
    case,
    contextual,
    fn,
    increments,
    pos_rows,
    ts_rows,
    dim,
    dtype,
    offsets_dtype,
    with_query,
    float_ts,
    seed,
):
    lengths, targets, interleave = case
    ts_dtype = torch.float64 if float_ts else torch.int64
    query = [1_700_100_000 + 3600 * b for b in range(len(lengths))] if with_query else None
    _check_ts(
        lengths,
        targets,
        interleave,
        contextual,
        fn,
        increments,
        pos_rows,
        ts_rows,
        dim,
        dtype,
        offsets_dtype=offsets_dtype,
        seed=seed,
        query=query,
        ts_dtype=ts_dtype,
    )


def test_timestamp_semantics():
    """Positions count back from the history end; buckets use the last timestamp (or query_time)."""
    pos_table = torch.arange(16.0).unsqueeze(1)
    ts_table = torch.zeros(11, 1)
    x = torch.zeros(6, 1)
    offsets, lengths = torch.tensor([0, 6]), torch.tensor([6])
    ts = torch.tensor([0, 100, 200, 300, 400, 500])

    def run(targets, contextual, query=None, table=ts_table, fn="sqrt"):
        out = add_timestamp_positional_embeddings(
            1.0,
            6,
            contextual,
            pos_table,
            table,
            offsets,
            lengths,
            x,
            ts,
            targets,
            False,
            fn,
            1.0,
            query,
        )
        return out.squeeze(1).tolist()

    # C = 1, 2 targets: prefix p=0 -> 0; history p=1..3 -> high - p + C = 4, 3, 2; targets -> C = 1
    assert run(torch.tensor([2]), 1) == [0, 4, 3, 2, 1, 1]
    assert run(None, 0) == [6, 5, 4, 3, 2, 1]  # no targets: high = n
    # buckets: sqrt((500 - ts) / 1), clamped to the top bucket 10
    buckets = torch.arange(11.0).unsqueeze(1) * 100
    assert [v - p for v, p in zip(run(None, 0, table=buckets), run(None, 0))] == [
        1000,
        1000,
        1000,
        1000,
        1000,
        0,
    ]
    assert run(None, 0, torch.tensor([500]), buckets) == run(None, 0, None, buckets)  # qt = last ts
    assert run(None, 0, torch.tensor([[510]]), buckets)[-1] - 1 == 300  # sqrt(10) -> bucket 3
    log_out = run(None, 0, torch.tensor([520]), buckets, "log")
    assert log_out[-1] - 1 == 200  # log(20) = 2.996 -> bucket 2


def test_query_time_future_changes_output():
    base = dict(
        lengths=[6, 4],
        targets=[1, 2],
        interleave=False,
        contextual=2,
        fn="sqrt",
        increments=60.0,
        pos_rows=8,
        ts_rows=200,
        dim=3,
        dtype=torch.float32,
    )
    last = _timestamps([6, 4], 2, 0)[[5, 9]].tolist()
    none_out = _check_ts(**base)
    same_out = _check_ts(**base, query=last)
    future = _check_ts(**base, query=[v + 10**6 for v in last])
    torch.testing.assert_close(none_out, same_out, atol=0, rtol=0)
    assert not torch.equal(none_out, future)


def test_gradcheck():
    offsets, seq_lengths, x, nt = _batch([3, 0, 4], [1, 0, 2], 2, torch.float64, torch.int64, 0)
    table = _table(4, 2, torch.float64, 1)
    ts_table = _table(6, 2, torch.float64, 2)
    ts = _timestamps([3, 0, 4], 1, 0)
    assert torch.autograd.gradcheck(
        lambda x, t: add_positional_embeddings(
            0.5, 4, t, offsets, seq_lengths, x, nt, False, backend=PT
        ),
        (x, table),
    )
    assert torch.autograd.gradcheck(
        lambda x, p, t: add_timestamp_positional_embeddings(
            0.5, 4, 1, p, t, offsets, seq_lengths, x, ts, nt, False, backend=PT
        ),
        (x, table, ts_table),
    )


def test_compile_and_export():
    offsets, seq_lengths, x, nt = _batch([5, 2, 7], [1, 0, 2], 4, torch.float32, torch.int64, 0)
    x = x.detach()
    pos_table = _table(8, 4, torch.float32, 1).detach()
    ts_table = _table(20, 4, torch.float32, 2).detach()
    ts = _timestamps([5, 2, 7], 2, 0)

    def fn(x, pos_table, ts_table, ts):
        a = add_positional_embeddings(
            0.5, 7, pos_table, offsets, seq_lengths, x, nt, False, backend=PT
        )
        b = add_timestamp_positional_embeddings(
            1.0,
            7,
            2,
            pos_table,
            ts_table,
            offsets,
            seq_lengths,
            x,
            ts,
            nt,
            False,
            "log",
            60.0,
            backend=PT,
        )
        return a, b

    expected = fn(x, pos_table, ts_table, ts)
    for g, e in zip(torch.compile(fn, fullgraph=True)(x, pos_table, ts_table, ts), expected):
        torch.testing.assert_close(g, e)

    class Model(torch.nn.Module):
        def forward(self, *args):
            return fn(*args)

    exported = torch.export.export(Model(), (x, pos_table, ts_table, ts))
    for g, e in zip(exported.module()(x, pos_table, ts_table, ts), expected):
        torch.testing.assert_close(g, e)


def _pos_args():
    return dict(
        alpha=1.0,
        max_seq_len=5,
        position_embeddings_weight=torch.randn(6, 3),
        seq_offsets=torch.tensor([0, 2, 5]),
        seq_lengths=torch.tensor([2, 3]),
        seq_embeddings=torch.randn(5, 3),
        num_targets=torch.tensor([1, 1]),
        interleave_targets=False,
    )


def _ts_args():
    args = _pos_args()
    args.update(
        max_contextual_seq_len=1,
        timestamp_embeddings_weight=torch.randn(4, 3),
        timestamps=torch.arange(5),
    )
    return args


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(seq_embeddings=torch.randn(5)), ValueError, r"seq_embeddings must be 2-D, got 1-D"),
        (
            dict(position_embeddings_weight=torch.randn(6, 4)),
            ValueError,
            r"position_embeddings_weight.shape\[1\] \(4\) must equal seq_embeddings.shape\[1\] \(3\)",  # noqa: E501
        ),
        (
            dict(position_embeddings_weight=torch.randn(0, 3)),
            ValueError,
            r"position_embeddings_weight must have at least one row",
        ),
        (
            dict(seq_lengths=torch.tensor([2, 3, 0])),
            ValueError,
            r"seq_offsets must have B \+ 1 = 4 entries, got 3",
        ),
        (
            dict(seq_lengths=torch.tensor([3, 2])),
            ValueError,
            r"seq_lengths must equal seq_offsets\[1:\] - seq_offsets\[:-1\]",
        ),
        (
            dict(seq_lengths=torch.tensor([2.0, 3.0])),
            TypeError,
            r"seq_lengths must be int32 or int64, got torch.float32",
        ),
        (
            dict(seq_offsets=torch.tensor([0, 2, 4])),
            ValueError,
            r"seq_offsets\[-1\] must equal the token count seq_embeddings.shape\[0\] \(5\), got 4",
        ),
        (
            dict(max_seq_len=2),
            ValueError,
            r"every sequence length \(seq_offsets\[b \+ 1\] - seq_offsets\[b\]\) must be <= "
            r"max_seq_len \(2\), got 3 for sequence 1",
        ),
        (dict(max_seq_len=-1), ValueError, r"max_seq_len must be >= 0, got -1"),
        (
            dict(num_targets=torch.tensor([3, 1])),
            ValueError,
            r"num_targets\[b\] must be <= the length of sequence b .*, got num_targets\[0\] = 3 "
            r"for a length of 2",
        ),
        (
            dict(num_targets=torch.tensor([2, 1]), interleave_targets=True),
            ValueError,
            r"2 \* num_targets\[b\] must be <= the length of sequence b .*, "
            r"got num_targets\[0\] = 2 for a length of 2",
        ),
        (
            dict(num_targets=torch.tensor([-1, 1])),
            ValueError,
            r"num_targets must be >= 0, got num_targets\[0\] = -1",
        ),
        (
            dict(num_targets=torch.tensor([1])),
            ValueError,
            r"num_targets.shape\[0\] \(1\) must equal the batch size",
        ),
        (
            dict(seq_embeddings=torch.randn(5, 3, device="meta")),
            ValueError,
            r"seq_offsets is on cpu but seq_embeddings is on meta",
        ),
    ],
)
@pytest.mark.parametrize("op", ["pos", "ts"])
def test_errors(change, error, match, op):
    args = _pos_args() if op == "pos" else _ts_args()
    args.update(change)
    fn = add_positional_embeddings if op == "pos" else add_timestamp_positional_embeddings
    with pytest.raises(error, match=match):
        fn(**args)


@pytest.mark.parametrize(
    "change, error, match",
    [
        (
            dict(time_bucket_fn="linear"),
            ValueError,
            r"time_bucket_fn must be 'sqrt' or 'log', got 'linear'",
        ),
        (
            dict(time_bucket_increments=0.0),
            ValueError,
            r"time_bucket_increments must be > 0, got 0.0",
        ),
        (
            dict(max_contextual_seq_len=-2),
            ValueError,
            r"max_contextual_seq_len must be >= 0, got -2",
        ),
        (
            dict(timestamps=torch.arange(4)),
            ValueError,
            r"timestamps.shape\[0\] \(4\) must equal seq_embeddings.shape\[0\] \(5\)",
        ),
        (dict(timestamps=torch.arange(5)[None]), ValueError, r"timestamps must be 1-D, got 2-D"),
        (
            dict(timestamp_embeddings_weight=torch.randn(4, 2)),
            ValueError,
            r"timestamp_embeddings_weight.shape\[1\] \(2\) must equal seq_embeddings.shape\[1\] \(3\)",  # noqa: E501
        ),
        (
            dict(query_time=torch.tensor([1, 2, 3])),
            ValueError,
            r"query_time must have shape \[2\] or \[2, 1\], got \[3\]",
        ),
        (
            dict(query_time=torch.tensor([1.0, 2.0])),
            TypeError,
            r"query_time has dtype torch.float32 but timestamps has torch.int64",
        ),
    ],
)
def test_timestamp_errors(change, error, match):
    args = _ts_args()
    args.update(change)
    with pytest.raises(error, match=match):
        add_timestamp_positional_embeddings(**args)
