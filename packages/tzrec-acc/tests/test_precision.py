"""Half-precision inference wrapper against the float64 model."""

from __future__ import annotations

import pytest
import torch
from _models import ranking

from tzrec_acc import aot, gr
from tzrec_acc.precision import HalfPrecision


@pytest.mark.parametrize("dtype, tolerance", [("bf16", 0.1), ("fp16", 0.02)])
def test_half_precision_ranking_is_close_to_float64(dtype, tolerance):
    model = ranking()
    reference = ranking().double()
    half = HalfPrecision(model, dtype).eval()
    (batch,) = gr.sample_inputs(model, batch=4)
    with torch.no_grad():
        got = half(batch)
        want = reference({k: v.double() if v.is_floating_point() else v for k, v in batch.items()})
    assert got.dtype == torch.float32
    assert half.model.item_embeddings.weight.dtype == half.dtype
    assert model.item_embeddings.weight.dtype == torch.float32  # the original is unchanged
    # errors relative to the logits' spread (measured: bf16 1.7%, fp16 0.3%)
    assert float((got.double() - want).abs().max()) < tolerance * float(want.std())


def test_wrapper_exports():
    half = HalfPrecision(ranking(), "bf16").eval()
    model = half.model
    args = gr.sample_inputs(model, batch=3)
    program = aot.export(half, args, (tuple(gr.dynamic_shapes(model, args)),))
    other = gr.sample_inputs(model, batch=5, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(program.module()(*other), half(*other))


def test_bad_dtype():
    with pytest.raises(ValueError, match="dtype must be one of fp16, bf16, got 'fp8'"):
        HalfPrecision(ranking(), "fp8")
    with pytest.raises(ValueError, match="got torch.float32"):
        HalfPrecision(ranking(), torch.float32)
