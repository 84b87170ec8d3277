"""Registers the ``triton`` and ``triton_tma`` backends."""

from __future__ import annotations

import importlib.util
import os
from typing import Any, List, Mapping, Optional

import torch

from tzrec_ops.hookspecs import hookimpl
from tzrec_ops.registry import Backend

_MODULE = "tzrec_ops.backends.triton"

# op name -> implementing module (each module defines a function named like the op)
_OPS = {
    "hstu_mha": "hstu_attention",
    "delta_hstu_mha": "hstu_attention",
    "addmm": "mm",
    "layer_norm": "layer_norm",
    "rms_norm": "layer_norm",
    "swish_layer_norm": "layer_norm",
    "layer_norm_mul_dropout": "layer_norm",
    "group_norm_mul_dropout": "layer_norm",
    "concat_2D_jagged": "jagged",
    "split_2D_jagged": "jagged",
    "jagged_dense_bmm_broadcast_add": "jagged",
    "add_positional_embeddings": "position",
    "add_timestamp_positional_embeddings": "position",
    "hstu_compute_uqvk": "hstu_compute",
    "hstu_compute_output": "hstu_compute",
    "hstu_preprocess_and_attention": "hstu_compute",
}
# ops whose triton_tma implementation differs from the pointer-load one
_TMA_OPS = {
    "hstu_mha": "hstu_attention:hstu_mha_tma",
    "delta_hstu_mha": "hstu_attention:delta_hstu_mha_tma",
}

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def interpreter_not_automatic() -> Optional[str]:
    """The CPU interpreter is a debugging aid: it runs only when asked for by name."""
    if interpreting() and not torch.cuda.is_available():
        return "the Triton CPU interpreter is used only when requested by name"
    return None


def triton_unavailable() -> Optional[str]:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install 'tzrec-ops[triton]')"
    if interpreting():
        return None
    if not torch.cuda.is_available():
        return "no CUDA/ROCm device is visible (set TRITON_INTERPRET=1 to run on the CPU)"
    return None


def tma_unavailable() -> Optional[str]:
    reason = triton_unavailable()
    if reason is not None:
        return reason
    if interpreting():
        return "tensor descriptors are not supported by the Triton interpreter"
    if torch.version.hip is not None:
        return "TMA needs an NVIDIA GPU (this is ROCm)"
    major, minor = torch.cuda.get_device_capability()
    if major < 9:
        return f"TMA needs compute capability >= 9.0, this GPU is {major}.{minor}"
    import triton.language as tl

    if not hasattr(tl, "make_tensor_descriptor"):
        return "this triton has no tl.make_tensor_descriptor (needs triton >= 3.4)"
    return None


def call_rejection(op: str, call: Mapping[str, Any]) -> Optional[str]:
    """Why a Triton backend cannot run this call (device, dtype, unsupported options)."""
    device = call.get("device")
    if device is not None:
        device = torch.device(device)
        if device.type != "cuda" and not (interpreting() and device.type == "cpu"):
            return f"tensors are on {device}, needs CUDA tensors"
    dtype = call.get("dtype")
    if dtype is not None and dtype not in _DTYPES:
        return f"dtype {dtype} is not supported (needs float32, bfloat16 or float16)"
    if call.get("dropout_pr", 0.0) > 0.0 and op in ("hstu_mha",):
        return f"dropout_pr={call['dropout_pr']} is not supported (needs 0.0)"
    if call.get("min_full_attn_seq_len", 0) > 0:
        return (
            f"min_full_attn_seq_len={call['min_full_attn_seq_len']} is not supported (needs 0)"
        )
    if call.get("attn_func") not in (None, False):
        return "attn_func (arbitrary masks) is not supported"
    return None


def tma_call_rejection(op: str, call: Mapping[str, Any]) -> Optional[str]:
    """:func:`call_rejection`, plus: the descriptor attention kernels take bfloat16 only.

    On an H200 (torch 2.11, triton 3.6) every bf16 comparison with the oracle passed, while
    fp16 and fp32 inputs through descriptors failed it for plain causal masks (cause not
    found yet); those dtypes run correctly on backend ``triton``.
    """
    reason = call_rejection(op, call)
    dtype = call.get("dtype")
    if reason is None and op in _TMA_OPS and dtype not in (None, torch.bfloat16):
        return (
            f"dtype {dtype} is not supported by the descriptor (TMA) attention kernels "
            "(bfloat16 only); use backend 'triton'"
        )
    return reason


@hookimpl
def tzrec_ops_register_backends() -> List[Backend]:
    ops = {op: f"{_MODULE}.{module}:{op}" for op, module in _OPS.items()}
    tma_ops = dict(ops)
    tma_ops.update({op: f"{_MODULE}.{target}" for op, target in _TMA_OPS.items()})
    # triton ranks above triton_tma: on an H200 (torch 2.11, triton 3.6; B=512, H=4, d=128,
    # bf16; two runs of the hstu_attention benchmark) descriptor loads changed the forward by
    # -1%..+4% and the backward by -8%..+4% at N >= 1024, about the run-to-run spread, but made
    # the backward 18-28% slower at N <= 512.
    return [
        Backend(
            name="triton",
            priority=20,
            ops=ops,
            availability=triton_unavailable,
            supports=call_rejection,
            automatic=interpreter_not_automatic,
            description="Triton kernels with pointer loads (CUDA, ROCm, CPU interpreter)",
        ),
        Backend(
            name="triton_tma",
            priority=10,
            ops=tma_ops,
            availability=tma_unavailable,
            supports=tma_call_rejection,
            description="Triton kernels with tensor descriptors (TMA), compute capability >= 9.0",
        ),
    ]
