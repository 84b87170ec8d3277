"""Micro-batching: concurrent requests gathered into one call of a handler, on one thread.

Requests wait in a bounded queue (:class:`Overloaded` when it is full: never unbounded
memory). One worker thread takes the oldest, then keeps taking until ``max_batch``
requests are gathered or ``max_wait_s`` has passed since the first, and hands the batch to
the handler, which answers each request (a value, or an exception for that request alone).
Batches run one after another in arrival order, so each user's requests are answered in
the order they came; the handler keeps that order inside a batch (see
:func:`split_in_order`). An answer may itself be a future (an append's commit, which the
store's writer thread does): its request is answered when that future is done, and the
worker goes on to the next batch meanwhile.

The batcher knows nothing of HTTP or of the model: the service's handler calls the serving
session, and a load test can drive :meth:`Batcher.submit` directly to measure the batching
apart from the HTTP layer. ``on_batch`` (if given) is told each batch's size and the
seconds its handler took.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, List, Optional, Sequence

__all__ = ["Batcher", "Overloaded", "Pending", "split_in_order"]


class Overloaded(RuntimeError):
    """The queue is full: the request was not taken (the caller answers 503)."""


@dataclass
class Pending:
    """A request waiting in the queue, with the future its answer is set on."""

    request: Any
    future: Future = field(default_factory=Future)


Handler = Callable[[List[Any]], Sequence[Any]]


class Batcher:
    """Gather requests into batches for ``handler`` on one worker thread.

    Args:
        handler: ``requests -> answers`` (one per request, in order; an exception instance
            is set on that request's future instead of a value, a future's outcome when
            it is done). An exception raised by
            the handler itself fails every request of the batch.
        max_batch: the most requests per handler call (>= 1).
        max_wait_s: how long the first request of a batch waits for more (>= 0).
        max_queue: the most requests waiting (>= 1); more are refused with Overloaded.
        on_batch: called with ``(size, seconds)`` after each handler call.
    """

    def __init__(self, handler: Handler, *, max_batch: int = 32, max_wait_s: float = 0.002,
                 max_queue: int = 1024,
                 on_batch: Optional[Callable[[int, float], None]] = None) -> None:
        for name, value, low in (("max_batch", max_batch, 1), ("max_queue", max_queue, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if not max_wait_s >= 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s!r}")
        self.handler = handler
        self.max_batch = max_batch
        self.max_wait_s = float(max_wait_s)
        self.max_queue = max_queue
        self.on_batch = on_batch
        self._queue: "queue.Queue[Optional[Pending]]" = queue.Queue(maxsize=max_queue)
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "Batcher":
        """Start the worker thread (idempotent); returns self."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="tzrec-batcher",
                                            daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Answer what is queued, then stop the worker."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    @property
    def running(self) -> bool:
        """The worker thread runs."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def depth(self) -> int:
        """Requests waiting now."""
        return self._queue.qsize()

    def submit(self, request: Any) -> Future:
        """Queue ``request``; its answer comes on the returned future.

        Raises:
            Overloaded: the queue holds ``max_queue`` requests already.
            RuntimeError: the batcher is not started.
        """
        if self._thread is None:
            raise RuntimeError("the batcher is not started")
        pending = Pending(request)
        try:
            self._queue.put_nowait(pending)
        except queue.Full:
            raise Overloaded(f"{self.max_queue} requests are waiting already") from None
        return pending.future

    def _gather(self, first: Pending) -> List[Pending]:
        batch = [first]
        deadline = time.perf_counter() + self.max_wait_s
        while len(batch) < self.max_batch:
            left = deadline - time.perf_counter()
            try:
                item = self._queue.get(timeout=left) if left > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:  # stop: answer this batch, then end
                self._queue.put(None)
                break
            batch.append(item)
        return batch

    def _work(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = self._gather(first)
            started = time.perf_counter()
            try:
                answers = list(self.handler([p.request for p in batch]))
                if len(answers) != len(batch):
                    raise RuntimeError(f"the handler answered {len(answers)} of "
                                       f"{len(batch)} requests")
            except Exception as exc:  # the batch fails; the worker goes on
                answers = [exc] * len(batch)
            # reported before anyone is answered, so a caller's next look at the metrics
            # already counts the batch that answered it
            if self.on_batch is not None:
                self.on_batch(len(batch), time.perf_counter() - started)
            for pending, answer in zip(batch, answers):
                _settle(pending.future, answer)


def _settle(future: Future, answer: Any) -> None:
    """Answer ``future`` with ``answer``: a value, an exception, or a future's outcome
    (once that future is done, on whichever thread completes it)."""
    if isinstance(answer, Future):
        answer.add_done_callback(lambda done: _settle(
            future, done.exception() if done.exception() is not None else done.result()))
    elif isinstance(answer, BaseException):
        future.set_exception(answer)
    else:
        future.set_result(answer)


def split_in_order(requests: Sequence[Any], key: Callable[[Any], Hashable],
                   user: Callable[[Any], Hashable]) -> List[List[int]]:
    """Runs of consecutive requests that one session call can answer together: the same
    ``key`` (the kind of call and its options) and no user twice. A user's later request
    starts a new run, so answering the runs in order keeps every user's order.

    Returns:
        the runs, as lists of indices into ``requests``, in order.
    """
    runs: List[List[int]] = []
    run_key: Any = object()
    users: set = set()
    for i, request in enumerate(requests):
        k, u = key(request), user(request)
        if not runs or k != run_key or u in users:
            runs.append([])
            run_key, users = k, set()
        runs[-1].append(i)
        users.add(u)
    return runs
