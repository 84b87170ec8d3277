"""Registers the ``pytorch`` reference backend."""

from __future__ import annotations

from typing import List

from tzrec_ops.contract import Backend, mirrored_op_table
from tzrec_ops.hookspecs import hookimpl

_PACKAGE = "tzrec_ops.backends.pytorch"


@hookimpl
def tzrec_ops_register_backends() -> List[Backend]:
    return [
        Backend(
            name="pytorch",
            priority=0,
            # the fast path hstu_preprocess_and_attention is left out: it runs unfused here
            ops=mirrored_op_table(_PACKAGE, fast_paths=False),
            description="reference implementation in plain torch; any device, any dtype",
        )
    ]
