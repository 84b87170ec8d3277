"""Ctrl-C during training: the loop stops at a step boundary and raises :class:`Interrupted`."""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path
from typing import Any, Iterator, List, Optional


class Interrupted(KeyboardInterrupt):
    """Ctrl-C ended the run at a step boundary (the same one on every rank under torchrun);
    ``checkpoint`` is where ``--resume`` goes on (None when no checkpoint could be written)."""

    def __init__(self, step: int, checkpoint: Optional[Path]) -> None:
        super().__init__(step)
        self.step = step
        self.checkpoint = checkpoint


@contextlib.contextmanager
def deferred_interrupts(enabled: bool) -> Iterator[List[bool]]:
    """While active, Ctrl-C (SIGINT) sets a flag (the yielded list's only item) instead of
    raising, so the loop can stop between steps; a second Ctrl-C raises at once. Off when
    not ``enabled`` and outside the main thread.

    Under torchrun the ranks run in sessions of their own, so a Ctrl-C reaches only
    torchrun, whose agent sends each rank one SIGINT (and SIGKILL 30 s later); the ranks
    may see it at different steps, and the loop agrees on the stop step through
    :class:`~tzrec_bench.train.distributed.AnyRankFlag`."""
    flag = [False]
    previous = None
    if enabled:
        def handler(signum: int, frame: Any) -> None:
            if flag[0]:
                raise KeyboardInterrupt
            flag[0] = True

        try:
            previous = signal.signal(signal.SIGINT, handler)
        except ValueError:  # not the main thread: Ctrl-C keeps its usual meaning
            previous = None
    try:
        yield flag
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
