"""Registers the ``pytorch`` reference backend."""

from __future__ import annotations

from typing import List

from tzrec_ops.contract import Backend, op_table
from tzrec_ops.hookspecs import hookimpl

_PACKAGE = "tzrec_ops.backends.pytorch"

# implementing module -> the ops it defines (each function is named like its op); every op
# but the fast path hstu_preprocess_and_attention, which runs unfused here
_MODULES = {
    "hstu_attention": ("hstu_mha", "delta_hstu_mha"),
    "mm": ("addmm",),
    "layer_norm": (
        "layer_norm",
        "rms_norm",
        "swish_layer_norm",
        "layer_norm_mul_dropout",
        "group_norm_mul_dropout",
    ),
    "jagged": ("concat_2D_jagged", "split_2D_jagged", "jagged_dense_bmm_broadcast_add"),
    "position": ("add_positional_embeddings", "add_timestamp_positional_embeddings"),
    "hstu_compute": ("hstu_compute_uqvk", "hstu_compute_output"),
}


@hookimpl
def tzrec_ops_register_backends() -> List[Backend]:
    return [
        Backend(
            name="pytorch",
            priority=0,
            ops=op_table(_PACKAGE, _MODULES),
            description="reference implementation in plain torch; any device, any dtype",
        )
    ]
