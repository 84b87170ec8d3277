"""Quantized inference: embedding tables in int8 / int4 / fp16, dense layers in int8.

* :func:`quantize_embeddings` swaps every ``nn.Embedding`` for a
  :class:`QuantizedEmbedding`: each row stored in int8 or int4 with its own fp16 scale and
  offset (row-wise asymmetric, ``row ~ q * scale + offset``), or in fp16. Lookups return the
  dequantized rows in the table's original dtype, so the rest of the model is unchanged; the
  module is plain torch and exports (``torch.export`` / AOTInductor). tzrec-gr's models use
  ``nn.Embedding`` tables, so this is the path for them; torchrec's quantized modules need
  torchrec's ``EmbeddingCollection`` inputs (KeyedJaggedTensor), which these models do not
  take.
* :func:`quantize_dense` converts tzrec-gr's ``Linear`` layers (weights stored ``[in, out]``,
  run by the ``addmm`` op) to ``nn.Linear`` and applies torch's dynamic int8 quantization
  (``torch.ao.quantization.quantize_dynamic``): int8 weights, activations quantized per call.
  It runs on the CPU in eager mode; torch.export cannot trace its packed weights.

Error bounds (what the tests check): a row of an int8 table is within ``scale / 2`` of the
float row, int4 within ``scale / 2`` (with 15 steps instead of 255), fp16 within fp16's
rounding (relative 2^-11).
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable, Dict, Optional, Sequence

import torch
from torch import nn

from tzrec_ops.measure import median_ms

__all__ = [
    "EMBEDDING_DTYPES",
    "QuantizedEmbedding",
    "compare",
    "quantize_dense",
    "quantize_embeddings",
]

EMBEDDING_DTYPES = ("int8", "int4", "fp16")
_LEVELS = {"int8": 255, "int4": 15}


class QuantizedEmbedding(nn.Module):
    """A row-wise quantized copy of an embedding table (lookups only, no training).

    Args:
        weight (torch.Tensor): [N, D] the float table.
        dtype (str): ``"int8"``, ``"int4"`` or ``"fp16"``.

    Call Args:
        ids (torch.Tensor): integer ids of any shape.

    Returns:
        torch.Tensor: ``[*ids.shape, D]`` dequantized rows in the table's dtype.
    """

    def __init__(self, weight: torch.Tensor, dtype: str) -> None:
        super().__init__()
        if dtype not in EMBEDDING_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(EMBEDDING_DTYPES)}, got {dtype!r}")
        if weight.dim() != 2 or not weight.is_floating_point():
            raise ValueError(
                f"weight must be a [N, D] float tensor, got {tuple(weight.shape)} {weight.dtype}"
            )
        self.dtype = dtype
        self.out_dtype = weight.dtype
        self.embedding_dim = weight.shape[1]
        weight = weight.detach()
        if dtype == "fp16":
            self.register_buffer("rows", weight.to(torch.float16))
            return
        levels = _LEVELS[dtype]
        low = weight.amin(dim=1, keepdim=True)
        span = weight.amax(dim=1, keepdim=True) - low
        # the stored fp16 scale and offset are what dequantization uses, so quantize with them
        scale = (span / levels).clamp(min=1e-8).to(torch.float16)
        offset = low.to(torch.float16)
        q = torch.round((weight - offset.float()) / scale.float()).clamp(0, levels).to(torch.uint8)
        if dtype == "int4":
            if q.shape[1] % 2:
                q = torch.cat([q, q.new_zeros(q.shape[0], 1)], dim=1)
            q = q[:, 0::2] | (q[:, 1::2] << 4)  # two ids per byte, low nibble first
        self.register_buffer("rows", q)
        self.register_buffer("scale", scale)
        self.register_buffer("offset", offset)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.dtype == "fp16":
            return self.rows[ids].to(self.out_dtype)
        q = self.rows[ids]
        if self.dtype == "int4":
            q = torch.stack([q & 0xF, q >> 4], dim=-1).flatten(-2)[..., : self.embedding_dim]
        return (q.float() * self.scale[ids].float() + self.offset[ids].float()).to(self.out_dtype)

    def extra_repr(self) -> str:
        return f"{self.rows.shape[0]}, {self.embedding_dim}, dtype={self.dtype}"


def quantize_embeddings(model: nn.Module, dtype: str = "int8") -> nn.Module:
    """Replace every ``nn.Embedding`` of ``model`` (in place) by a :class:`QuantizedEmbedding`.

    Returns:
        nn.Module: ``model``.
    """
    if dtype not in EMBEDDING_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(EMBEDDING_DTYPES)}, got {dtype!r}")
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Embedding)]
    if not found:
        raise ValueError(f"{type(model).__name__} has no nn.Embedding table to quantize")
    for name, table in found:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, QuantizedEmbedding(table.weight, dtype))
    return model


def _as_nn_linear(layer: nn.Module) -> nn.Linear:
    """An ``nn.Linear`` computing what tzrec-gr's ``Linear`` (``x @ W + b``, W [in, out]) does."""
    out = nn.Linear(layer.in_features, layer.out_features)
    with torch.no_grad():
        out.weight.copy_(layer.weight.t())
        out.bias.copy_(layer.bias)
    return out


def quantize_dense(model: nn.Module) -> nn.Module:
    """Dynamic int8 quantization of every linear layer of ``model`` (in place, CPU, eager).

    tzrec-gr's ``Linear`` layers become ``nn.Linear`` first; the STU layers' own projections
    (run by the fused HSTU ops) stay float.

    Returns:
        nn.Module: ``model``.
    """
    gr_layers = _gr_linear_type()
    replaced = 0
    for name, module in list(model.named_modules()):
        if gr_layers is not None and isinstance(module, gr_layers):
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, attr, _as_nn_linear(module))
            replaced += 1
    if not replaced and not any(isinstance(m, nn.Linear) for m in model.modules()):
        raise ValueError(f"{type(model).__name__} has no linear layer to quantize")
    with warnings.catch_warnings():
        # torch marks torch.ao.quantization deprecated in favour of torchao; it is the tool
        # torch itself ships, and its warnings would repeat on every call
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*quantize_per_tensor.*")
        return torch.ao.quantization.quantize_dynamic(
            model, {nn.Linear}, dtype=torch.qint8, inplace=True
        )


def _gr_linear_type() -> Optional[type]:
    try:
        from tzrec_gr.layers import Linear
    except ImportError:
        return None
    return Linear


def compare(
    reference: nn.Module,
    quantized: nn.Module,
    batches: Sequence[tuple],
    metric: Callable[[torch.Tensor, torch.Tensor], float],
    labels: Sequence[torch.Tensor],
    repeats: int = 5,
) -> Dict[str, float]:
    """Metric and latency of ``quantized`` against ``reference`` on the same batches.

    Args:
        reference, quantized: the float and quantized models (eval mode).
        batches: argument tuples.
        metric: ``metric(outputs, labels) -> float`` (e.g. an AUC).
        labels: one label tensor per batch.
        repeats: timed calls per batch (the median is reported).

    Returns:
        dict: ``metric_float``, ``metric_quant``, ``metric_change`` (quant - float),
        ``max_abs_diff`` of the outputs, ``ms_float``, ``ms_quant`` (median per batch,
        summed over batches).
    """
    if len(batches) != len(labels):
        raise ValueError(f"got {len(batches)} batches but {len(labels)} label tensors")
    out: Dict[str, float] = {"ms_float": 0.0, "ms_quant": 0.0, "max_abs_diff": 0.0}
    ref_outs, quant_outs = [], []
    with torch.no_grad():
        for args in batches:
            ref_outs.append(reference(*args))
            quant_outs.append(quantized(*args))
            for key, model in (("ms_float", reference), ("ms_quant", quantized)):
                # exactly `repeats` timed calls after one warm-up (rep_ms=0 adds none)
                call = functools.partial(model, *args)
                out[key] += median_ms(call, "cpu", rep_ms=0, min_calls=repeats)
    for r, q in zip(ref_outs, quant_outs):
        out["max_abs_diff"] = max(out["max_abs_diff"], float((r.float() - q.float()).abs().max()))
    all_labels = torch.cat(list(labels))
    out["metric_float"] = float(metric(torch.cat(ref_outs), all_labels))
    out["metric_quant"] = float(metric(torch.cat(quant_outs), all_labels))
    out["metric_change"] = out["metric_quant"] - out["metric_float"]
    return out
