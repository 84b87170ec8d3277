"""Time one op call in one mode and measure the memory it takes.

``fwd`` times the call under ``torch.no_grad``; ``bwd`` runs the forward once with autograd
and times ``torch.autograd.grad`` of its outputs (a fixed random upstream gradient) with
respect to the case's inputs, keeping the graph. One untimed call first (autotuning, the
value checks' first look at the index tensors), then the timed ones with the project's
timer, :func:`tzrec_ops.measure.median_ms`: ``triton.testing.do_bench`` medians on CUDA
(warm-up 25 ms, ``rep`` ms, architecture §6) when triton is installed, else the median of
calls timed one by one (CUDA events, or on the CPU the wall clock) for at least ``rep`` ms
and 3 calls. Peak memory is ``torch.cuda.max_memory_allocated`` over the timed calls, above
what was allocated before the forward (for ``bwd`` it includes the saved activations); on the
CPU it is not measured.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch

from tzrec_bench.benchmarks.opbench.cases import Case
from tzrec_ops.measure import median_ms


@dataclass(frozen=True)
class Measurement:
    """One mode of one case: median ms, peak MiB above the inputs (None on the CPU), the
    epoch-seconds window of the timed calls, and the bytes of the tensors it reads and
    writes at the least (inputs and outputs; for ``bwd`` also their gradients)."""

    ms: float
    peak_mib: Optional[float]
    window: Tuple[float, float]
    traffic_bytes: int


def outputs(result: Any) -> List[torch.Tensor]:
    """The tensors an op returned (one tensor, or a tuple that may hold non-tensors)."""
    if isinstance(result, torch.Tensor):
        return [result]
    return [t for t in result if isinstance(t, torch.Tensor)]


def _bytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(case: Case, mode: str, device: torch.device, rep_ms: float) -> Measurement:
    """Times ``case`` in ``mode`` (``"fwd"`` or ``"bwd"``)."""
    cuda = device.type == "cuda"
    _sync(device)
    base = torch.cuda.memory_allocated(device) if cuda else 0
    in_bytes = _bytes(case.inputs)
    with case.context():
        if mode == "fwd":
            def run() -> Any:
                with torch.no_grad():
                    return case.call(*case.inputs)

            traffic = in_bytes + _bytes(outputs(run()))  # the untimed first call
        else:
            outs = [o for o in outputs(case.call(*case.inputs)) if o.requires_grad]
            grads = [torch.randn_like(o) * 0.1 for o in outs]

            def run() -> Any:
                return torch.autograd.grad(outs, case.inputs, grads, retain_graph=True,
                                           allow_unused=True)

            run()
            traffic = _bytes(grads) + 2 * in_bytes
        _sync(device)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        start = time.time()
        ms = median_ms(run, device, rep_ms)
        window = (start, time.time())
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20 if cuda else None
    return Measurement(ms, peak, window, traffic)
