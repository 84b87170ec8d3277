"""Registers the ``triton`` and ``triton_tma`` backends (their refusals: :mod:`.refusals`)."""

from __future__ import annotations

import importlib.util
from typing import List, Optional

import torch

from tzrec_ops.backends.triton.refusals import (
    TMA_OPS,
    call_rejection,
    interpreting,
    tma_call_rejection,
)
from tzrec_ops.contract import Backend, mirrored_op_table
from tzrec_ops.hookspecs import hookimpl

__all__ = ["call_rejection", "interpreting", "tma_call_rejection", "tzrec_ops_register_backends"]

_PACKAGE = "tzrec_ops.backends.triton"


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


@hookimpl
def tzrec_ops_register_backends() -> List[Backend]:
    ops = mirrored_op_table(_PACKAGE)
    tma_ops = {**ops, **{op: f"{_PACKAGE}.hstu_attention:{op}_tma" for op in TMA_OPS}}
    # triton ranks above triton_tma: descriptor loads made the attention backward slower on
    # short sequences and were within the run-to-run spread on long ones (figures in
    # docs/tzrec-ops-measurements.md).
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
            description=(
                "Triton kernels with tensor descriptors (TMA), compute capability >= 9.0; "
                "attention in bfloat16 only (see refusals.tma_call_rejection)"
            ),
        ),
    ]
