"""Per-dtype tolerances: how far a computation in a low-precision dtype may stray from the
same computation in float64.

The reference runs on float64 copies of the *same* (already rounded) inputs, so the
tolerances cover only the error the computation adds: its accumulation precision,
intermediate roundings and the final cast to the input dtype. They do not cover input
quantization. The rule: for every element

    |actual - expected| <= atol * scale + rtol * |expected|

where ``scale = max(|expected|)`` (1 if ``expected`` is all zeros or empty). Stating ``atol`` in
units of the tensor's largest entry makes one number fit outputs and gradients whose magnitudes
differ by orders of magnitude (HSTU divides by the sequence length), while still catching any
element that is wrong by a visible fraction of the tensor's scale.

The backends' tests hold every kernel to these against the float64 oracle
(:func:`tzrec_ops.testing.tolerances.assert_close`); tools that compare two ways of computing
the same function at run time (tzrec-bench's serving load test) use the same table.
:func:`torch_tolerance` gives plain ``torch.testing.assert_close`` arguments for one tensor.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Tuple

import torch

__all__ = ["BACKWARD", "FORWARD", "TF32", "Tolerance", "tolerance", "torch_tolerance"]


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """``atol`` is relative to the largest oracle magnitude; ``rtol`` is per element."""

    atol: float
    rtol: float


# Forward outputs, backend in the given dtype vs float64 oracle.
FORWARD: Dict[torch.dtype, Tolerance] = {
    # float64 backends do the same maths in another order: only summation-order rounding
    # (~1e-16 per add, a few thousand adds) separates them from the oracle.
    torch.float64: Tolerance(atol=1e-10, rtol=1e-9),
    # fp32 accumulation (unit roundoff 6e-8) over up to ~4096 products grows to ~1e-6 of the
    # scale in the worst case; 1e-5 leaves headroom but still flags a single wrong term. Assumes
    # TF32 is off (see TF32 below).
    torch.float32: Tolerance(atol=1e-5, rtol=1e-4),
    # bf16 keeps 8 mantissa bits: the final cast alone is off by up to 2^-9 = 2e-3 relative,
    # and kernels that round the SiLU weights to bf16 before the value product add a similar
    # relative error per term, which partially cancels in the sum.
    torch.bfloat16: Tolerance(atol=1e-2, rtol=2e-2),
    # fp16 keeps 11 mantissa bits: half an ulp is 2^-11 = 4.9e-4 relative; same reasoning as
    # bf16 with 8x the precision.
    torch.float16: Tolerance(atol=2e-3, rtol=5e-3),
}

# Gradients: one more matmul chain than the forward (dA = dO V^T, then dS, then dQ/dK), and
# Triton kernels may accumulate dQ in the input dtype across key blocks.
BACKWARD: Dict[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(atol=1e-10, rtol=1e-9),
    # two chained fp32 reductions; still far below any real bug's footprint.
    torch.float32: Tolerance(atol=5e-5, rtol=1e-4),
    # up to three bf16 roundings per path (weights, dS, dQ read-modify-write): ~3x forward.
    torch.bfloat16: Tolerance(atol=3e-2, rtol=5e-2),
    # same chain at fp16 precision.
    torch.float16: Tolerance(atol=5e-3, rtol=1e-2),
}

# float32 inputs with TF32 matmuls (torch.backends.cuda.matmul.allow_tf32): TF32 keeps 10
# mantissa bits, 2^-11 = 4.9e-4 relative per product, like fp16 but without the output cast.
TF32 = Tolerance(atol=2e-3, rtol=5e-3)


def tolerance(dtype: torch.dtype, grad: bool = False) -> Tolerance:
    """The forward (or gradient) tolerance for a backend running in ``dtype``."""
    table = BACKWARD if grad else FORWARD
    if dtype not in table:
        raise ValueError(f"no tolerance is defined for {dtype}; known: {list(table)}")
    return table[dtype]


def _scale(expected: torch.Tensor) -> float:
    if expected.numel() == 0:
        return 1.0
    peak = float(expected.detach().abs().max())
    return peak if peak > 0 else 1.0


def torch_tolerance(
    expected: torch.Tensor, dtype: torch.dtype, grad: bool = False
) -> Tuple[float, float]:
    """``(atol, rtol)`` for ``torch.testing.assert_close`` against ``expected`` (the oracle)."""
    tol = tolerance(dtype, grad)
    return tol.atol * _scale(expected), tol.rtol
