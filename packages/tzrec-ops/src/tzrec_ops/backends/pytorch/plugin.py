"""Registers the ``pytorch`` reference backend."""

from __future__ import annotations

from typing import List

from tzrec_ops.hookspecs import hookimpl
from tzrec_ops.registry import Backend

_MODULE = "tzrec_ops.backends.pytorch"

# op name -> implementing module (each module defines a function named like the op)
_OPS = {
    "hstu_mha": "hstu_attention",
    "delta_hstu_mha": "hstu_attention",
}


@hookimpl
def tzrec_ops_register_backends() -> List[Backend]:
    return [
        Backend(
            name="pytorch",
            priority=0,
            ops={op: f"{_MODULE}.{module}:{op}" for op, module in _OPS.items()},
            description="reference implementation in plain torch; any device, any dtype",
        )
    ]
