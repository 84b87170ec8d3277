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


def _conversions_of_inputs(program) -> int:
    """Nodes of ``program`` that convert a floating user input (not a parameter) to another
    dtype."""
    names = set(program.graph_signature.user_inputs)
    inputs = {n for n in program.graph.nodes if n.op == "placeholder" and n.name in names}
    count = 0
    for node in program.graph.nodes:
        if node.op != "call_function" or not node.args or node.args[0] not in inputs:
            continue
        source, result = node.args[0].meta.get("val"), node.meta.get("val")
        if (
            isinstance(source, torch.Tensor)
            and isinstance(result, torch.Tensor)
            and source.is_floating_point()
            and source.dtype != result.dtype
        ):
            count += 1
    return count


def test_cast_keeps_a_serving_cache_from_being_converted_in_every_call():
    model = ranking()
    step, args, shapes = gr.serving_step(model, history=10, new=4, batch=3)
    half = HalfPrecision(step, "bf16").eval()
    cast = half.cast(args)
    keys = cast[0]
    assert all(k.dtype == torch.bfloat16 for k in keys)  # the cache's keys, per layer
    assert cast[2].dtype == args[2].dtype  # integer offsets pass unchanged
    float_cache = aot.export(half, args, (tuple(shapes),))
    half_cache = aot.export(half, cast, (tuple(shapes),))
    # a float32 cache is converted inside the step (every layer's keys and values) ...
    assert _conversions_of_inputs(float_cache) >= 2 * len(keys)
    # ... a cache already in the compute dtype is read as it is
    assert _conversions_of_inputs(half_cache) == 0
    with torch.no_grad():
        torch.testing.assert_close(half_cache.module()(*cast), half(*args))
