"""build_sla_func_tensor against a per-token Python transcription of the SLA rules."""

from __future__ import annotations

from typing import List, Optional, Sequence

import pytest
import torch

from tzrec_ops.jagged import offsets_from_lengths
from tzrec_ops.ops.hstu_attention_utils import build_sla_func_tensor


def _expected(
    lengths: Sequence[int], targets: Optional[Sequence[int]], k1: int, k2: int, prefix: int
) -> List[List[int]]:
    """[3, L] rows (cmax0, cmin0, cmax1), one token at a time."""
    g = max(k2, prefix)
    cols = []
    for b, n in enumerate(lengths):
        hb = max(n - (targets[b] if targets is not None else 0), 0)
        for p in range(n):
            if p < hb:
                cols.append((min(g, p + 1), max(g, p - k1 + 1), p + 1))
            else:
                cols.append((hb, hb, hb))
    return [[c[r] for c in cols] for r in range(3)]


CASES = [
    # lengths, targets, k1, k2, C
    ([6], [1], 2, 1, 0),
    ([5, 0, 1, 9], None, 3, 0, 0),
    ([5, 0, 1, 9], [2, 0, 1, 3], 4, 2, 0),
    ([8, 7], [1, 2], 2, 1, 3),  # C overrides the smaller k2
    ([4, 3], [4, 3], 2, 2, 0),  # every token a target: history end 0
    ([10], [0], 0, 0, 0),  # k1 = 0: no local window
    ([], None, 1, 1, 0),
]


@pytest.mark.parametrize("lengths,targets,k1,k2,prefix", CASES)
@pytest.mark.parametrize("offsets_dtype", [torch.int32, torch.int64])
def test_matches_per_token_rules(lengths, targets, k1, k2, prefix, offsets_dtype):
    offsets = offsets_from_lengths(lengths, offsets_dtype)
    nt = None if targets is None else torch.tensor(targets, dtype=offsets_dtype)
    func = build_sla_func_tensor(3, k1, k2, offsets, sum(lengths), nt, prefix)
    assert func.dtype == torch.int32 and func.shape == (3, 3, sum(lengths))
    assert func.stride(0) == 0  # one mask shared by every head
    for h in range(3):
        assert func[h].tolist() == _expected(lengths, targets, k1, k2, prefix)


def test_device_argument_and_default():
    offsets = offsets_from_lengths([3, 2])
    assert build_sla_func_tensor(1, 1, 1, offsets, 5).device == offsets.device
    assert build_sla_func_tensor(1, 1, 1, offsets, 5, device="cpu").device.type == "cpu"


def test_compile_and_export():
    def fn(x: torch.Tensor, offsets: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return build_sla_func_tensor(2, 3, 1, offsets, x.size(0), targets, 2).contiguous()

    offsets = offsets_from_lengths([5, 0, 7])
    targets = torch.tensor([1, 0, 2])
    x = torch.zeros(12, 4)
    eager = fn(x, offsets, targets)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(fn, fullgraph=True)(x, offsets, targets), eager)

    class Builder(torch.nn.Module):
        def forward(self, x, offsets, targets):
            return fn(x, offsets, targets)

    exported = torch.export.export(Builder(), (x, offsets, targets))
    assert torch.equal(exported.module()(x, offsets, targets), eager)


ERRORS = [
    (dict(sla_k1=-1), ValueError, r"sla_k1 must be >= 0, got -1"),
    (dict(sla_k2=-2), ValueError, r"sla_k2 must be >= 0, got -2"),
    (dict(contextual_seq_len=-1), ValueError, r"contextual_seq_len must be >= 0, got -1"),
    (dict(nheads=0), ValueError, r"nheads must be > 0, got 0"),
    (dict(seq_offsets=torch.tensor([0.0, 5.0])), TypeError, r"seq_offsets must be int32 or int64"),
    (
        dict(num_targets=torch.tensor([1, 2])),
        ValueError,
        r"num_targets must have B = 1 entries, got 2",
    ),
    (dict(num_targets=torch.tensor([1.0])), TypeError, r"num_targets must be int32 or int64"),
    (
        dict(num_targets=torch.tensor([6])),
        ValueError,
        r"num_targets\[b\] must be <= the length of sequence b .*, got num_targets\[0\] = 6 "
        r"for a length of 5",
    ),
    (dict(num_targets=torch.tensor([-1])), ValueError, r"num_targets must be >= 0"),
    (
        dict(num_targets=torch.tensor([1], device="meta")),
        ValueError,
        r"num_targets is on meta but seq_offsets is on cpu",
    ),
    (dict(total_q=6), ValueError, r"seq_offsets\[-1\] must equal total_q \(6\), got 5"),
    (
        dict(seq_offsets=torch.tensor([0, 6, 5]), total_q=5),
        ValueError,
        r"seq_offsets must be non-decreasing",
    ),
]


@pytest.mark.parametrize("over,exc,match", ERRORS, ids=[m[:30] for _, _, m in ERRORS])
def test_errors(over, exc, match):
    args = dict(nheads=2, sla_k1=1, sla_k2=1, seq_offsets=torch.tensor([0, 5]), total_q=5)
    args.update(over)
    with pytest.raises(exc, match=match):
        build_sla_func_tensor(**args)
