"""The attention kernels' schedule order: sequences by descending length, ties by index.

CPU runs use the Triton interpreter at small batches; ``pytest -m gpu`` checks real batches.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tzrec_ops.backends.triton import length_order as L  # noqa: E402
from tzrec_ops.jagged import offsets_from_lengths  # noqa: E402

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _expected(lengths):
    return torch.argsort(torch.tensor(lengths, dtype=torch.int64), descending=True, stable=True)


@settings(max_examples=15, deadline=None, derandomize=True)
@given(
    lengths=st.lists(st.integers(0, 6), min_size=0, max_size=200),
    offsets_dtype=st.sampled_from([torch.int32, torch.int64]),
)
def test_length_order_matches_stable_descending_argsort(lengths, offsets_dtype):
    # lengths from a small range: many ties, which must keep index order
    offsets = offsets_from_lengths(lengths, offsets_dtype).to(DEVICE)
    order = L.length_order(offsets)
    assert order.dtype == torch.int32 and order.shape == (len(lengths),)
    assert torch.equal(order.cpu().long(), _expected(lengths))


def test_length_order_over_several_compare_steps():
    # more sequences than one compare step holds, with a partial last step and many ties
    batch = L._BLOCK_J + 37
    g = torch.Generator().manual_seed(batch)
    lengths = torch.randint(0, 9, (batch,), generator=g).tolist()
    order = L.length_order(offsets_from_lengths(lengths, torch.int64).to(DEVICE))
    assert torch.equal(order.cpu().long(), _expected(lengths))


def test_length_order_past_the_ranked_batch_limit_uses_argsort(monkeypatch):
    monkeypatch.setattr(L, "MAX_RANKED_BATCH", 3)
    lengths = [2, 5, 5, 0, 7, 5]
    order = L.length_order(offsets_from_lengths(lengths, torch.int64).to(DEVICE))
    assert order.dtype == torch.int32
    assert torch.equal(order.cpu().long(), _expected(lengths))


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [512, 1024, 4096])
def test_length_order_at_benchmark_batches(batch):
    g = torch.Generator().manual_seed(batch)
    lengths = torch.randint(230, 256, (batch,), generator=g).tolist()
    order = L.length_order(offsets_from_lengths(lengths, torch.int64).to(DEVICE))
    assert torch.equal(order.cpu().long(), _expected(lengths))
