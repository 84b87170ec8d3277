"""The module named by this package's ``tzrec_ops`` entry point: one hook, one backend.

Announcing the backend imports none of its kernels: ``ops`` maps each op to a
``"module:function"`` string that tzrec-ops imports the first time the op runs here.
"""

from __future__ import annotations

from typing import Any, List, Mapping, Optional

import tzrec_ops
from tzrec_ops.registry import Backend

BACKEND_NAME = "example"


def unavailable() -> Optional[str]:
    """``None``: plain torch runs everywhere. A real backend checks its hardware/library here."""
    return None


def rejection(op: str, call: Mapping[str, Any]) -> Optional[str]:
    """Why this backend cannot run one call, or ``None``; tzrec-ops shows the reason."""
    dtype = call.get("dtype")
    if dtype is not None and not dtype.is_floating_point:
        return f"dtype {dtype} is not supported (needs a floating-point dtype)"
    return None


@tzrec_ops.hookimpl
def tzrec_ops_register_backends() -> List[Backend]:
    return [
        Backend(
            name=BACKEND_NAME,
            # below the built-in pytorch backend (0): chosen only when asked for by name or
            # by TZREC_OPS_BACKEND. A real accelerated backend would pick a higher priority.
            priority=-10,
            ops={"addmm": "tzrec_ops_backend_example.kernels:addmm"},
            availability=unavailable,
            supports=rejection,
            description="example third-party backend: addmm in plain torch",
        )
    ]
