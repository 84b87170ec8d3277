"""Gradients averaged over processes without DDP's hooks: what a captured step calls.

DDP reduces gradients from autograd hooks, bucket by bucket, as the backward produces
them; a CUDA graph records none of that bookkeeping. :class:`GradSync` does the same
arithmetic in a fixed sequence of tensor operations that a graph can record: after the
backward, the gradients are copied into one static flat buffer per dtype, divided by the
strategy's divisor (as DDP's reducer does before its all-reduce: the world size), summed by
one ``all_reduce`` and copied back. A parameter without a gradient on this rank (unused by
its batch) contributes zeros and gets the sum back, so every rank launches the same
collectives with the same sizes at every step, whatever its batch.

The sizes depend on the parameters only, never on the batch: ranks whose batches fall in
different token buckets still pair their collectives, provided each runs one reduction per
step.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist


class GradSync:
    """Sums the gradients of ``params`` over ``group`` and divides them by ``divisor``.

    Args:
        params: the parameters whose gradients are reduced (those requiring a gradient).
        divisor: what the summed gradients are divided by (DDP: the world size).
        group: the process group (default: the world's).
    """

    def __init__(self, params: Iterable[torch.Tensor], divisor: float,
                 group: Optional[dist.ProcessGroup] = None) -> None:
        self.divisor = divisor
        self.group = group
        grouped: Dict[Tuple[torch.dtype, torch.device], List[torch.Tensor]] = {}
        for param in params:
            if param.requires_grad:
                grouped.setdefault((param.dtype, param.device), []).append(param)
        #: one (parameters, flat buffer, views of the buffer shaped as the parameters) per
        #: dtype and device, made once: a captured step's collective reads a static address
        self.buckets: List[Tuple[List[torch.Tensor], torch.Tensor, List[torch.Tensor]]] = []
        for (dtype, device), members in grouped.items():
            flat = torch.zeros(sum(p.numel() for p in members), dtype=dtype, device=device)
            views, offset = [], 0
            for p in members:
                views.append(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
            self.buckets.append((members, flat, views))

    @property
    def numel(self) -> int:
        """Gradient elements reduced per step."""
        return sum(flat.numel() for _, flat, _ in self.buckets)

    def describe(self) -> str:
        """What one step reduces, for the log."""
        return (f"{self.numel:,} gradient values in {len(self.buckets)} all-reduce(s) per "
                f"step, divided by {self.divisor:g}")

    def __call__(self) -> None:
        """Reduces the gradients in place (after the backward, before clipping)."""
        for members, flat, views in self.buckets:
            for p in members:
                if p.grad is None:  # unused on this rank: zeros, and the sum comes back
                    p.grad = torch.zeros_like(p)
            grads = [p.grad for p in members]
            torch._foreach_copy_(views, grads)
            if self.divisor != 1:
                # before the sum, as DDP's reducer divides each bucket before its all-reduce
                flat.div_(self.divisor)
            dist.all_reduce(flat, group=self.group)
            torch._foreach_copy_(grads, views)
