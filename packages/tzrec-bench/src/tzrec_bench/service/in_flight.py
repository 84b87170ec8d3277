"""Results on their way from the device to the host, so that a serving loop goes on to its
next call while the device finishes this one.

A serving call only queues device work (the session reads nothing back in a steady-state
call); reading its answer with ``.cpu()`` would make the host wait for that work, idle,
before it prepares the next call. :class:`InFlight` instead queues the copies (into pinned
memory, non-blocking) behind the call's work and records an event after them: the caller
polls :meth:`InFlight.ready` between calls and takes the answers with :meth:`InFlight.wait`
once they are there. Stream order keeps this exact: a later call's work (a graph replay
that overwrites its static outputs, say) runs after the copies queued before it.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

__all__ = ["InFlight"]


class InFlight:
    """``tensors`` copied to the host behind the work queued so far on ``device``'s current
    stream (CPU tensors are taken as they are).

    Args:
        tensors: the results (none: only mark the work queued so far, e.g. an append).
        device: the device whose work to wait for. Default: the first CUDA tensor's
            (none: nothing to wait for).
    """

    def __init__(
        self, tensors: Sequence[torch.Tensor] = (), device: Optional[torch.device] = None
    ) -> None:
        self._host = [t.detach().to("cpu", non_blocking=True) for t in tensors]
        if device is None:
            device = next((t.device for t in tensors if t.is_cuda), None)
        self._event: Optional[torch.cuda.Event] = None
        if device is not None and torch.device(device).type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(device))

    def ready(self) -> bool:
        """Whether the results are on the host (never waits)."""
        return self._event is None or self._event.query()

    def wait(self) -> List[torch.Tensor]:
        """The results on the host, waiting for them if needed."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host
