"""Every call the Triton backends refuse, and why: the one place these rules live.

The registry asks :func:`call_rejection` / :func:`tma_call_rejection` (the backends'
``supports`` checks) before it picks a backend, so a refused call goes to another backend or
fails with the reason. The backend functions call :func:`raise_if_refused` with the same rules,
for callers that reach them directly (tests, benchmarks). Imports no Triton.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

import torch

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# ops whose triton_tma implementation differs from the pointer-load one
TMA_OPS = ("hstu_mha", "delta_hstu_mha")
# the one dtype those ops read through descriptors (see :func:`tma_call_rejection`)
TMA_ATTENTION_DTYPE = torch.bfloat16


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def option_rejection(op: str, call: Mapping[str, Any]) -> Optional[str]:
    """The options no Triton kernel implements (a reason), or ``None``."""
    if op == "hstu_mha" and call.get("dropout_pr", 0.0) > 0.0:
        return f"dropout_pr={call['dropout_pr']} is not supported (needs 0.0)"
    if call.get("min_full_attn_seq_len", 0) > 0:
        return (
            f"min_full_attn_seq_len={call['min_full_attn_seq_len']} is not supported (needs 0)"
        )
    if call.get("attn_func") not in (None, False):
        return "attn_func (arbitrary masks) is not supported"
    if op == "hstu_preprocess_and_attention" and call.get("prefill"):
        # the public op sends prefill calls down its unfused path, which returns k and v
        return "prefill=True is not supported by the fused kernel (needs False)"
    return None


def call_rejection(op: str, call: Mapping[str, Any]) -> Optional[str]:
    """Why backend ``triton`` cannot run this call (device, dtype, options), or ``None``."""
    device = call.get("device")
    if device is not None:
        device = torch.device(device)
        if device.type != "cuda" and not (interpreting() and device.type == "cpu"):
            return f"tensors are on {device}, needs CUDA tensors"
    dtype = call.get("dtype")
    if dtype is not None and dtype not in DTYPES:
        return f"dtype {dtype} is not supported (needs float32, bfloat16 or float16)"
    return option_rejection(op, call)


def tma_call_rejection(op: str, call: Mapping[str, Any]) -> Optional[str]:
    """:func:`call_rejection`, plus: the descriptor attention kernels take bfloat16 only.

    On an H200 (torch 2.11, triton 3.6) every bf16 comparison with the oracle passed, while
    fp16 and fp32 inputs through descriptors failed it for plain causal masks (cause not
    found yet); those dtypes run correctly on backend ``triton``.
    """
    reason = call_rejection(op, call)
    dtype = call.get("dtype")
    if reason is None and op in TMA_OPS and dtype not in (None, TMA_ATTENTION_DTYPE):
        return (
            f"dtype {dtype} is not supported by the descriptor (TMA) attention kernels "
            "(bfloat16 only); use backend 'triton'"
        )
    return reason


def raise_if_refused(op: str, **options: Any) -> None:
    """``ValueError`` naming the option when a Triton kernel cannot run ``op`` with it."""
    reason = option_rejection(op, options)
    if reason is not None:
        raise ValueError(f"{op} on the triton backends: {reason}")


def reject_unsupported_attention(
    dropout_pr: float,
    training: bool,
    min_full_attn_seq_len: int,
    attn_func: Optional[torch.Tensor],
) -> None:
    """:func:`raise_if_refused` for ``hstu_mha``'s arguments (dropout only counts in training)."""
    raise_if_refused(
        "hstu_mha",
        dropout_pr=float(dropout_pr) if training else 0.0,
        min_full_attn_seq_len=min_full_attn_seq_len,
        attn_func=attn_func is not None,
    )
