"""``torch.autocast`` for the matrix-product ops.

ATen runs its matrix products (``addmm``, ``bmm``, attention) in the autocast dtype and leaves
norms and elementwise ops alone. The tzrec ops that are matrix products (``addmm``, the HSTU
attentions, the STU projections, the jagged-dense product) do the same here, in the public
op and so for every backend: under ``torch.autocast`` for their device, their floating
inputs (float32, float16, bfloat16; float64 is left as ATen leaves it) are cast to the autocast
dtype before validation and backend selection, so a backend sees one dtype and chooses by
it. Outside autocast nothing changes. Gradients flow back through the casts to the original
dtypes.
"""

from __future__ import annotations

from typing import Any, Tuple

import torch

_CASTABLE = (torch.float32, torch.float16, torch.bfloat16)


def autocast_inputs(*tensors: Any) -> Tuple[Any, ...]:
    """``tensors`` as a matrix-product op receives them: cast to the autocast dtype while
    ``torch.autocast`` is on for their device, unchanged otherwise. Anything that is not a
    tensor (``None``, or a wrong argument left for validation to name) passes through."""
    first = next((t for t in tensors if isinstance(t, torch.Tensor)), None)
    if first is None or not torch.is_autocast_enabled(first.device.type):
        return tensors
    dtype = torch.get_autocast_dtype(first.device.type)
    return tuple(
        t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype in _CASTABLE else t
        for t in tensors
    )
