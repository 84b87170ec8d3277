"""Mixed-precision inference: run a model in fp16 or bf16, inputs and outputs as before.

:class:`HalfPrecision` holds a copy of the model with its floating parameters and buffers in
the half dtype, casts the floating tensors of each call's arguments (in nested dicts, lists
and tuples) to it, and casts floating outputs back to float32. Integer inputs (ids,
lengths, timestamps) pass unchanged. tzrec-gr's layers compute in their input's dtype, so
the whole forward runs in half precision; its ops accumulate in fp32 internally. The
wrapper exports like the model (``torch.export``, AOTInductor).

bf16 keeps fp32's range with 8 bits of mantissa; fp16 has 11 bits but overflows past 65504.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

__all__ = ["DTYPES", "HalfPrecision"]

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, dict):
        return {k: _cast(v, dtype) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    return value


class HalfPrecision(nn.Module):
    """``model`` run in ``dtype`` (``"fp16"``/``"bf16"`` or the torch dtype).

    Args:
        model (nn.Module): the float model; it is copied, not changed.
        dtype (str | torch.dtype): the compute dtype.
        output_dtype (torch.dtype): floating outputs are cast to it. Default: float32.
    """

    def __init__(
        self, model: nn.Module, dtype: Any = "bf16", output_dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        resolved = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
        if resolved not in DTYPES.values():
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        self.dtype = resolved
        self.output_dtype = output_dtype
        self.model = copy.deepcopy(model).to(resolved)
        self.model.train(model.training)

    def cast(self, value: Any) -> Any:
        """``value`` (a tensor, or nested dicts, lists and tuples of them) with its floating
        tensors in the compute dtype, as :meth:`forward` casts its arguments.

        Inputs that are reused call after call, such as a serving cache's keys and values,
        belong in the compute dtype once, before the calls: a float32 one is converted again
        in every call, which reads and writes the whole tensor each time."""
        return _cast(value, self.dtype)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.model(*self.cast(args), **self.cast(kwargs))
        return _cast(out, self.output_dtype)
