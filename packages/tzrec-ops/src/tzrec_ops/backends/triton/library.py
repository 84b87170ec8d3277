"""Importing this module registers every ``tzrec_ops::*_triton`` torch.library op.

That is all a process needs to load an exported program (or an AOTInductor package) whose
graph holds Triton-backend ops; no plugin discovery runs::

    import tzrec_ops.backends.triton.library  # noqa: F401
    program = torch.export.load("model.pt2")
"""

from tzrec_ops.backends.triton import (  # noqa: F401
    hstu_attention,
    hstu_compute,
    jagged_2d,
    layer_norm,
    mm,
    position,
)
