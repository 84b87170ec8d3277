"""Every environment toggle of tzrec-acc, read when asked (never at import time).

=================  ==========================  =================================================
variable           values (default first)      meaning
=================  ==========================  =================================================
``ENABLE_AOT``     ``0`` / ``1``               export as an AOTInductor package (``.pt2``)
``ENABLE_TRT``     ``0`` / ``1``               compile the dense part with TensorRT
``QUANT_EMB``      ``FP32`` / ``FP16`` /       storage of the item embedding tables of an
                   ``INT8`` / ``INT4``         exported model (``0`` = ``FP32``, ``1`` = ``INT8``)
``QUANT_EC_EMB``   as ``QUANT_EMB``            storage of torchrec ``EmbeddingCollection``
                                               (sequence) tables
``INPUT_TILE``     ``0`` / ``2`` / ``3``       serve one user against many items: ``2`` feeds the
                                               user features once and tiles them over the items,
                                               ``3`` also looks the user embeddings up once
``TF32_MATMUL``    ``0`` / ``1``               ``torch.backends.cuda.matmul.allow_tf32``
``TF32_CUDNN``     ``0`` / ``1``               ``torch.backends.cudnn.allow_tf32``
=================  ==========================  =================================================

The names follow the seed system's (TorchEasyRec's) switches. Its quantization defaults to
int8; here every toggle defaults to off, so an export is float unless asked. A bad value
raises ``ValueError`` naming the variable, what it holds and what it may hold. TF32 is
applied only by :func:`apply_tf32`, never by reading the settings.

``INPUT_TILE`` is read and checked here for the serving code that tiles features; tzrec-gr's
models take each user's candidates as a jagged batch already, so tzrec-acc's own exports do
not tile.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Optional

import torch

__all__ = [
    "QUANT_DTYPES",
    "Settings",
    "apply_tf32",
    "enable_aot",
    "enable_trt",
    "input_tile",
    "quant_ec_emb",
    "quant_emb",
    "read",
    "tf32_cudnn",
    "tf32_matmul",
]

QUANT_DTYPES = ("fp32", "fp16", "int8", "int4")
_QUANT_ALIASES = {"0": "fp32", "1": "int8"}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
_TILE_MODES = (0, 2, 3)


def _env(environ: Optional[Mapping[str, str]]) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def _flag(name: str, environ: Optional[Mapping[str, str]]) -> bool:
    raw = _env(environ).get(name, "0")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name} must be 0 or 1 (or true/false, yes/no, on/off), got {raw!r}")


def _quant(name: str, environ: Optional[Mapping[str, str]]) -> str:
    raw = _env(environ).get(name, "fp32")
    value = _QUANT_ALIASES.get(raw.strip(), raw.strip().lower())
    if value not in QUANT_DTYPES:
        raise ValueError(
            f"{name} must be one of {', '.join(d.upper() for d in QUANT_DTYPES)} "
            f"(or 0 / 1), got {raw!r}"
        )
    return value


def enable_aot(environ: Optional[Mapping[str, str]] = None) -> bool:
    """``ENABLE_AOT``: export an AOTInductor package. Default False."""
    return _flag("ENABLE_AOT", environ)


def enable_trt(environ: Optional[Mapping[str, str]] = None) -> bool:
    """``ENABLE_TRT``: compile with TensorRT (needs ``tzrec-acc[tensorrt]``). Default False."""
    return _flag("ENABLE_TRT", environ)


def quant_emb(environ: Optional[Mapping[str, str]] = None) -> str:
    """``QUANT_EMB``: ``"fp32"`` (no quantization), ``"fp16"``, ``"int8"`` or ``"int4"``."""
    return _quant("QUANT_EMB", environ)


def quant_ec_emb(environ: Optional[Mapping[str, str]] = None) -> str:
    """``QUANT_EC_EMB``: as :func:`quant_emb`, for torchrec ``EmbeddingCollection`` tables."""
    return _quant("QUANT_EC_EMB", environ)


def input_tile(environ: Optional[Mapping[str, str]] = None) -> int:
    """``INPUT_TILE``: 0 (off), 2 (tile user features) or 3 (also user embeddings)."""
    raw = _env(environ).get("INPUT_TILE", "0")
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value not in _TILE_MODES:
        raise ValueError(f"INPUT_TILE must be one of 0, 2, 3, got {raw!r}")
    return value


def tf32_matmul(environ: Optional[Mapping[str, str]] = None) -> bool:
    """``TF32_MATMUL``: allow TF32 in CUDA matmuls (applied by :func:`apply_tf32`)."""
    return _flag("TF32_MATMUL", environ)


def tf32_cudnn(environ: Optional[Mapping[str, str]] = None) -> bool:
    """``TF32_CUDNN``: allow TF32 in cuDNN convolutions (applied by :func:`apply_tf32`)."""
    return _flag("TF32_CUDNN", environ)


@dataclasses.dataclass(frozen=True)
class Settings:
    """A snapshot of every toggle (see the module docstring)."""

    enable_aot: bool
    enable_trt: bool
    quant_emb: str
    quant_ec_emb: str
    input_tile: int
    tf32_matmul: bool
    tf32_cudnn: bool


def read(environ: Optional[Mapping[str, str]] = None) -> Settings:
    """Every toggle from ``environ`` (default: ``os.environ``), each checked."""
    return Settings(
        enable_aot=enable_aot(environ),
        enable_trt=enable_trt(environ),
        quant_emb=quant_emb(environ),
        quant_ec_emb=quant_ec_emb(environ),
        input_tile=input_tile(environ),
        tf32_matmul=tf32_matmul(environ),
        tf32_cudnn=tf32_cudnn(environ),
    )


def apply_tf32(matmul: Optional[bool] = None, cudnn: Optional[bool] = None) -> tuple[bool, bool]:
    """Set torch's TF32 switches; None reads ``TF32_MATMUL`` / ``TF32_CUDNN``.

    Returns:
        (bool, bool): the previous (matmul, cudnn) values, to restore them.
    """
    previous = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = tf32_matmul() if matmul is None else bool(matmul)
    torch.backends.cudnn.allow_tf32 = tf32_cudnn() if cudnn is None else bool(cudnn)
    return previous
