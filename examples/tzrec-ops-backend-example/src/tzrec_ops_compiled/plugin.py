"""The module named by this package's ``tzrec_ops`` entry point: one hook, one backend.

Announcing the backend imports none of its kernels: ``ops`` maps each op to a
``"module:function"`` string that tzrec-ops imports the first time the op runs here.
"""

from __future__ import annotations

import os
import shutil
from typing import Any, List, Mapping, Optional

import torch

import tzrec_ops
from tzrec_ops.contract import Backend, op_table

BACKEND_NAME = "compiled"


def unavailable() -> Optional[str]:
    """``None`` where Inductor can build CPU kernels: it needs a C++ compiler (``$CXX``,
    else g++, c++ or clang++ on the PATH). Cheap: imports nothing of Inductor."""
    candidates = [os.environ.get("CXX", ""), "g++", "c++", "clang++"]
    if any(name and shutil.which(name) for name in candidates):
        return None
    return "torch.compile needs a C++ compiler to build CPU kernels (set CXX or install g++)"


def rejection(op: str, call: Mapping[str, Any]) -> Optional[str]:
    """Why this backend cannot run one call exactly, or ``None``; tzrec-ops shows the reason.

    Every option the kernels do not implement is refused here, so the call goes to another
    backend (or fails with this reason when ``compiled`` was asked for by name).
    """
    device = torch.device(call["device"])
    if device.type != "cpu":
        return f"tensors are on {device}; this backend is built and tested for the CPU"
    if not call["dtype"].is_floating_point:
        return f"dtype {call['dtype']} is not supported (needs a floating-point dtype)"
    if op == "hstu_mha":
        if call["dropout_pr"] > 0.0:
            return f"dropout_pr={call['dropout_pr']} is not supported (needs 0.0)"
        if call["min_full_attn_seq_len"] > 0:
            return (
                f"min_full_attn_seq_len={call['min_full_attn_seq_len']} is not supported "
                "(needs 0)"
            )
        if call["attn_func"]:
            return "attn_func (arbitrary masks) is not supported"
    return None


@tzrec_ops.hookimpl
def tzrec_ops_register_backends() -> List[Backend]:
    return [
        Backend(
            name=BACKEND_NAME,
            # below the built-in pytorch backend (0): chosen only when asked for by name or by
            # TZREC_OPS_BACKEND, because the first call of each new option set compiles
            # (seconds); a backend without that cost would rank itself higher
            priority=-10,
            ops=op_table(
                "tzrec_ops_compiled",
                {"attention": ["hstu_mha"], "norms": ["layer_norm"]},
            ),
            availability=unavailable,
            supports=rejection,
            description="HSTU attention and layer norm compiled with torch.compile (CPU)",
        )
    ]
