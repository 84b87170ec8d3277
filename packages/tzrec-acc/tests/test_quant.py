"""Quantized embedding tables and int8 dense layers, against float64 references."""

from __future__ import annotations

import pytest
import torch
from _models import ranking, retrieval

from tzrec_acc import aot, gr, quant


@pytest.mark.parametrize("dtype", ["int8", "int4"])
@pytest.mark.parametrize("width", [8, 7])  # odd widths pad the last int4 byte
def test_rowwise_integer_tables_are_within_half_a_step(dtype, width):
    weight = torch.randn(50, width) * torch.linspace(0.01, 3, 50).unsqueeze(1)
    table = quant.QuantizedEmbedding(weight, dtype)
    ids = torch.tensor([[0, 49], [7, 7]])
    got = table(ids)
    assert got.shape == (2, 2, width) and got.dtype == torch.float32
    w64 = weight.double()
    step = (w64.amax(1) - w64.amin(1)) / (255 if dtype == "int8" else 15)
    # half a step of rounding, plus the fp16 storage of scale and offset (2^-11 relative)
    bound = step / 2 + (w64.abs().amax(1) + step * 255) * 2.0**-11
    err = (got.double() - w64[ids]).abs().amax(-1)
    assert bool((err <= bound[ids]).all()), (err, bound[ids])
    storage = table.rows.element_size() * table.rows.numel()
    assert storage == 50 * (width if dtype == "int8" else (width + 1) // 2)


def test_fp16_table():
    weight = torch.randn(20, 6, dtype=torch.float64)
    table = quant.QuantizedEmbedding(weight, "fp16")
    got = table(torch.arange(20))
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, weight, rtol=2.0**-11, atol=0)


def test_table_errors():
    with pytest.raises(ValueError, match="dtype must be one of int8, int4, fp16, got 'int2'"):
        quant.QuantizedEmbedding(torch.ones(2, 2), "int2")
    with pytest.raises(ValueError, match=r"weight must be a \[N, D\] float tensor, got \(3,\)"):
        quant.QuantizedEmbedding(torch.ones(3), "int8")
    with pytest.raises(ValueError, match="has no nn.Embedding table to quantize"):
        quant.quantize_embeddings(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="dtype must be one of"):
        quant.quantize_embeddings(ranking(), "bf16")
    with pytest.raises(ValueError, match="has no linear layer to quantize"):
        quant.quantize_dense(torch.nn.ReLU())


def test_int8_embeddings_in_a_model_export_and_stay_close():
    model, reference = ranking(), ranking()
    quant.quantize_embeddings(model, "int8")
    assert isinstance(model.item_embeddings, quant.QuantizedEmbedding)
    args = gr.sample_inputs(model, batch=4)
    with torch.no_grad():
        want, got = reference(*args), model(*args)
    # the logits move by far less than their spread (measured: 0.7% of it)
    assert float((got - want).abs().max()) < 0.05 * float(want.std())
    program = aot.export(model, args, gr.dynamic_shapes(model, args))
    other = gr.sample_inputs(model, batch=6, seed=2)
    with torch.no_grad():
        torch.testing.assert_close(program.module()(*other), model(*other))


def test_int8_dense_layers_stay_close():
    model, reference = retrieval(), retrieval()
    quant.quantize_dense(model)
    kinds = {type(m).__name__ for m in model.modules()}
    assert "Linear" in kinds  # torch's dynamic quantized linear keeps the class name
    assert any("quantized" in type(m).__module__ for m in model.modules())
    args = gr.sample_inputs(model, batch=4)
    with torch.no_grad():
        want, got = reference(*args), model(*args)
    # L2-normalized outputs: per-row cosine stays near 1
    cosine = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert float(cosine.min()) > 0.99


def test_compare_reports_metric_change_and_latency():
    model, reference = ranking(), ranking()
    quant.quantize_embeddings(model, "int4")
    batches = [gr.sample_inputs(model, 4, seed=s) for s in range(2)]
    labels = [torch.randint(0, 2, (int(b[0]["candidate.sequence_length"].sum()),)) for b in batches]

    def accuracy(logits, y):
        return float(((logits[:, 0] > 0).long() == y).double().mean())

    report = quant.compare(reference, model, batches, accuracy, labels, repeats=2)
    assert report["metric_change"] == report["metric_quant"] - report["metric_float"]
    assert report["ms_float"] > 0 and report["ms_quant"] > 0 and report["max_abs_diff"] > 0
    with pytest.raises(ValueError, match="got 2 batches but 1 label tensors"):
        quant.compare(reference, model, batches, accuracy, labels[:1])
