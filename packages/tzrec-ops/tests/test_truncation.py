"""STU truncation plan: the spec's cases vs a pure-Python reference, plan fields, replay on
parallel tensors, gradients, compile/export of the replay, and argument errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tzrec_ops.ops.truncation import (
    STUTruncationPlan,
    apply_stu_truncation_plan,
    compute_stu_truncation_plan,
)
from tzrec_ops.testing.generators import offsets_from_lengths, random_values
from tzrec_ops.testing.ops_oracle import reference_stu_truncation

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)
PT = "pytorch"

# (lengths, num_targets, contextual_seq_len, truncate_tail_len), from the reference spec §5
SPEC_CASES = [
    ([3, 5, 2], None, 0, 16),
    ([4, 10, 7], None, 0, 5),
    ([8, 12], [3, 5], 0, 2),
    ([6, 12, 20], [1, 2, 4], 3, 4),
    ([6, 8], [1, 2], 2, 0),
]


def _check(lengths, targets, contextual, tail, offsets_dtype=torch.int64, dim=3):
    offsets = offsets_from_lengths(lengths, offsets_dtype)
    nt = None if targets is None else torch.tensor(targets, dtype=offsets_dtype)
    max_len = max([0, *lengths])
    plan = compute_stu_truncation_plan(
        offsets, nt, max_len, truncate_tail_len=tail, contextual_seq_len=contextual
    )
    new_lengths, kept = reference_stu_truncation(lengths, targets, contextual, tail)
    assert plan.new_lengths.tolist() == new_lengths
    assert plan.new_lengths.dtype == offsets_dtype and plan.new_x_offsets.dtype == offsets_dtype
    assert plan.new_x_offsets.tolist() == offsets_from_lengths(new_lengths).tolist()
    assert plan.new_max_seq_len == max([0, *new_lengths])
    assert plan.pre_max_seq_len == max_len and plan.contextual_seq_len == contextual
    batch = len(lengths)
    assert plan.total_prefix == batch * contextual
    assert plan.total_kept == len(kept) - batch * contextual
    assert plan.total_dropped == sum(lengths) - len(kept)
    assert plan.total_rest == sum(lengths) - batch * contextual
    assert plan.offsets_prefix.tolist() == [b * contextual for b in range(batch + 1)]
    assert plan.offsets_rest.tolist() == [
        o - b * contextual for b, o in enumerate(offsets.tolist())
    ]
    x = random_values(sum(lengths), (dim,), torch.float32).requires_grad_()
    ts = torch.arange(sum(lengths), dtype=torch.int64) * 10
    out = apply_stu_truncation_plan(x, plan, backend=PT)
    torch.testing.assert_close(out, x.detach()[kept], atol=0, rtol=0)
    assert apply_stu_truncation_plan(ts, plan, backend=PT).tolist() == (ts[kept]).tolist()  # replay
    (grad,) = torch.autograd.grad(out.sum(), x)
    expected_grad = torch.zeros(sum(lengths), dim)
    expected_grad[kept] = 1.0
    torch.testing.assert_close(grad, expected_grad, atol=0, rtol=0)
    return plan


@pytest.mark.parametrize("case", SPEC_CASES)
@pytest.mark.parametrize("offsets_dtype", [torch.int32, torch.int64])
def test_spec_cases(case, offsets_dtype):
    _check(*case, offsets_dtype=offsets_dtype)


def test_worked_example():
    """C = 1, tail = 2: [c, h0, h1, h2, t0] -> [c, h1, h2, t0]."""
    plan = _check([5], [1], 1, 2)
    assert plan.offsets_head.tolist() == [0, 1] and plan.offsets_tail.tolist() == [0, 3]


@st.composite
def _cases(draw):
    contextual = draw(st.integers(0, 3))
    with_targets = draw(st.booleans())
    batch = draw(st.integers(0, 5))
    lengths, targets = [], []
    for _ in range(batch):
        t = draw(st.integers(0, 3)) if with_targets else 0
        lengths.append(contextual + t + draw(st.integers(0, 8)))
        targets.append(t)
    tail = draw(st.integers(0, 9))
    return lengths, targets if with_targets else None, contextual, tail


@SETTINGS
@given(case=_cases(), offsets_dtype=st.sampled_from([torch.int32, torch.int64]))
def test_sweep(case, offsets_dtype):
    _check(*case, offsets_dtype=offsets_dtype)


def test_replay_compiles_and_exports():
    offsets = offsets_from_lengths([6, 12, 20])
    plan = compute_stu_truncation_plan(
        offsets, torch.tensor([1, 2, 4]), 20, truncate_tail_len=4, contextual_seq_len=3
    )
    x = random_values(38, (4,), torch.float32)
    expected = apply_stu_truncation_plan(x, plan, backend=PT)
    compiled = torch.compile(
        lambda x: apply_stu_truncation_plan(x, plan, backend=PT), fullgraph=True
    )
    torch.testing.assert_close(compiled(x), expected, atol=0, rtol=0)

    class Model(torch.nn.Module):
        def forward(self, x):
            return apply_stu_truncation_plan(x, plan, backend=PT)

    torch.testing.assert_close(
        torch.export.export(Model(), (x,)).module()(x), expected, atol=0, rtol=0
    )


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(truncate_tail_len=-1), ValueError, r"truncate_tail_len must be >= 0, got -1"),
        (
            dict(truncate_tail_len=2, contextual_seq_len=-1),
            ValueError,
            r"contextual_seq_len must be >= 0, got -1",
        ),
        (
            dict(truncate_tail_len=2, contextual_seq_len=4),
            ValueError,
            r"every sequence length \(x_offsets\[b \+ 1\] - x_offsets\[b\]\) must be >= 4 "
            r"\(contextual_seq_len, the prefix every sequence holds\), got 3 for sequence 0",
        ),
        (
            dict(truncate_tail_len=2, num_targets=torch.tensor([4, 0])),
            ValueError,
            r"num_targets\[b\] must be <= the length of sequence b \(x_offsets\[b \+ 1\] - "
            r"x_offsets\[b\]\), got num_targets\[0\] = 4 for a length of 3",
        ),
        (
            dict(truncate_tail_len=2, contextual_seq_len=1, num_targets=torch.tensor([3, 0])),
            ValueError,
            r"num_targets\[b\] \+ 1 \(contextual_seq_len\) must be <= the length of sequence b "
            r".*, got num_targets\[0\] = 3 for a length of 3",
        ),
        (
            dict(truncate_tail_len=2, num_targets=torch.tensor([-1, 0])),
            ValueError,
            r"num_targets must be >= 0",
        ),
        (
            dict(truncate_tail_len=2, num_targets=torch.tensor([1])),
            ValueError,
            r"num_targets.shape\[0\] \(1\) must equal x_offsets.numel\(\) - 1 \(2\)",
        ),
        (
            dict(truncate_tail_len=2, num_targets=torch.tensor([1.0, 1.0])),
            TypeError,
            r"num_targets must be int32 or int64, got torch.float32",
        ),
        (
            dict(truncate_tail_len=2, x_offsets=torch.tensor([0, 5, 3])),
            ValueError,
            r"x_offsets must be non-decreasing",
        ),
        (
            dict(truncate_tail_len=2, x_offsets=torch.tensor([1, 3, 7])),
            ValueError,
            r"x_offsets\[0\] must be 0",
        ),
        (
            dict(truncate_tail_len=2, x_offsets=torch.tensor([0.0, 3.0])),
            TypeError,
            r"x_offsets must be int32 or int64, got torch.float32",
        ),
        (
            dict(truncate_tail_len=2, max_seq_len=-3),
            ValueError,
            r"max_seq_len must be >= 0, got -3",
        ),
        (
            dict(truncate_tail_len=2, max_seq_len=3),
            ValueError,
            r"every sequence length \(x_offsets\[b \+ 1\] - x_offsets\[b\]\) must be <= "
            r"max_seq_len \(3\), got 4 for sequence 1",
        ),
    ],
)
def test_plan_errors(kwargs, error, match):
    args = dict(x_offsets=torch.tensor([0, 3, 7]), num_targets=None, max_seq_len=4)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        compute_stu_truncation_plan(**args)


def test_apply_errors():
    plan = compute_stu_truncation_plan(torch.tensor([0, 3, 7]), None, 4, truncate_tail_len=1)
    with pytest.raises(
        ValueError, match=r"x.shape\[0\] \(6\) must equal the planned token count \(7\)"
    ):
        apply_stu_truncation_plan(torch.randn(6, 2), plan)
    with pytest.raises(ValueError, match=r"x must be 1-D or 2-D, got 3-D"):
        apply_stu_truncation_plan(torch.randn(7, 2, 2), plan)
    with pytest.raises(TypeError, match=r"plan must be an STUTruncationPlan, got dict"):
        apply_stu_truncation_plan(torch.randn(7, 2), {})
    assert isinstance(plan, STUTruncationPlan)
