"""tzrec-acc: export and acceleration for tzrec models.

FX tracing helpers, export graph passes, AOTInductor packages, TensorRT, quantization and
mixed precision, for tzrec-gr's models. Importing ``tzrec_acc`` loads nothing but this file;
each name below imports its module on first use. TensorRT (``tzrec-acc[tensorrt]``) and
tzrec-gr (``tzrec-acc[gr]``) are loaded by the features that need them.

Modules: :mod:`~tzrec_acc.settings` (environment toggles), :mod:`~tzrec_acc.fx` (tracing),
:mod:`~tzrec_acc.passes` (graph passes), :mod:`~tzrec_acc.aot` (torch.export, AOTInductor,
parity), :mod:`~tzrec_acc.gr` (tzrec-gr models: inputs, dynamic shapes, serving steps),
:mod:`~tzrec_acc.tensorrt`, :mod:`~tzrec_acc.quant`, :mod:`~tzrec_acc.precision`,
:mod:`~tzrec_acc.checkpoint` (rebuild a saved model), :mod:`~tzrec_acc.serving` (one
session API over a checkpoint or a package) and :mod:`~tzrec_acc.cli`. Its
benchmark is tzrec-bench's ``python -m tzrec_bench.benchmarks.export``.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "export": "aot",
    "compile_package": "aot",
    "save_program": "aot",
    "run_in_fresh_process": "aot",
    "parity": "aot",
    "symbolic_trace": "fx",
    "traceable": "fx",
    "mark_sparse": "fx",
    "mark_dense": "fx",
    "split_sparse_dense": "passes",
    "eliminate_dead_code": "passes",
    "prune_unused_attributes": "passes",
    "OperatorMap": "passes",
    "map_operators": "passes",
    "sample_inputs": "gr",
    "dynamic_shapes": "gr",
    "serving_step": "gr",
    "quantize_embeddings": "quant",
    "quantize_dense": "quant",
    "HalfPrecision": "precision",
    "load_checkpoint": "checkpoint",
    "load_model": "checkpoint",
    "load_session": "serving",
}
_MODULES = (
    "aot",
    "checkpoint",
    "cli",
    "fx",
    "gr",
    "passes",
    "precision",
    "quant",
    "serving",
    "settings",
    "tensorrt",
)

__all__ = ["__version__", *sorted(_EXPORTS), *_MODULES]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"tzrec_acc.{_EXPORTS[name]}"), name)
    if name in _MODULES:
        return importlib.import_module(f"tzrec_acc.{name}")
    raise AttributeError(f"module 'tzrec_acc' has no attribute {name!r}")


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))
