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
