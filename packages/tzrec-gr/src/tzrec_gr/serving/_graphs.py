"""CUDA graphs of a serving session's hot steps, one per padded bucket of request shapes.

Two kinds share this machinery: the ranking ``score`` (:mod:`._score_graphs`, buckets of
users, cached tokens and candidates) and the retrieval ``recommend`` of opened users
(:mod:`._recommend_graphs`, buckets of users, k and seen items).

A graph replays fixed kernels on fixed buffers, so each bucket owns static inputs, sized
for the bucket's largest request; a request that fits is copied into them (padded), the
graph replayed and the real rows read back. Every buffer and the graphs' scratch memory
are built from the model's own sizes, so a graph can be captured before any request
(``ServingSession.warm_up``, from synthetic inputs) or on the first request of its bucket.
All graphs of a session capture into one memory pool (:class:`GraphPool`): they replay
one at a time on one stream, so they can share their scratch memory.

Capturing needs CUDA; everything else here (bucket choice, buffers, padding, the step run
eagerly on the buffers) runs on any device, which is how the CPU tests check it.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

__all__ = [
    "Bucket",
    "Entry",
    "GraphPool",
    "GraphSet",
    "check_buckets",
    "fit",
    "fit_sizes",
    "powers_of_two_up_to",
    "product",
]

Bucket = Tuple[int, ...]


def powers_of_two_up_to(bound: int, start: int = 1) -> Tuple[int, ...]:
    """``start, 2 * start, ...`` below ``bound``, then ``bound``."""
    out: List[int] = []
    value = start
    while value < bound:
        out.append(value)
        value *= 2
    out.append(bound)
    return tuple(out)


def fit(value: int, buckets: Sequence[int]) -> Optional[int]:
    """The smallest of the (sorted) ``buckets`` that holds ``value``, or None."""
    for b in buckets:
        if value <= b:
            return b
    return None


def fit_sizes(
    name: str, values: Optional[Sequence[int]], buckets: Sequence[int]
) -> Tuple[int, ...]:
    """The buckets the request sizes ``values`` fall in (None: every bucket).

    Raises:
        ValueError: a size fits no bucket (named).
    """
    if values is None:
        return tuple(buckets)
    fitted = []
    for i, v in enumerate(values):
        b = fit(v, buckets)
        if b is None:
            raise ValueError(
                f"{name}[{i}] = {v} fits no bucket (the largest is {max(buckets)}); give "
                "the session larger buckets"
            )
        fitted.append(b)
    return tuple(fitted)


def check_buckets(name: str, values: Optional[Sequence[int]]) -> None:
    """Raise ValueError unless ``values`` is None or a non-empty sequence of ints >= 1."""
    if values is None:
        return
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
        raise ValueError(f"{name} must be a non-empty sequence of ints >= 1, got {values!r}")
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
        raise ValueError(f"{name} must be ints >= 1, got {values!r}")


class GraphPool:
    """One CUDA graph memory pool, created on first use and shared by a session's graphs."""

    def __init__(self) -> None:
        self._handle: Optional[Any] = None

    def handle(self) -> Any:
        if self._handle is None:
            self._handle = torch.cuda.graph_pool_handle()
        return self._handle


@dataclasses.dataclass
class Entry:
    """One bucket's graph; subclasses add the static buffers."""

    bucket: Bucket
    graph: Optional[Any] = None
    out: Any = None
    capture_ms: float = 0.0
    memory_bytes: int = 0
    replays: int = 0
    warm_up: bool = False  # captured by warm_up, before any request


class GraphSet:
    """The captured graphs of one step, per bucket (see the module docstring).

    Subclasses set :attr:`kind` and :attr:`fields` (the bucket's named dimensions) and
    define :meth:`new_entry` (zeroed static buffers), :meth:`fill_synthetic` (inputs valid
    for a capture) and :meth:`step` (the step on the buffers, what is captured).

    Args:
        pool (GraphPool): the memory pool, shared with the session's other graphs.
        max_graphs (int): the most graphs captured; later buckets run eager.
    """

    kind = ""
    fields: Tuple[str, ...] = ()

    def __init__(self, pool: GraphPool, max_graphs: int) -> None:
        self.pool = pool
        self.max_graphs = max_graphs
        self.entries: Dict[Bucket, Entry] = {}
        self.failed: Dict[Bucket, str] = {}
        self.captures = 0
        self.replays = 0
        self.eager_calls = 0

    # -- subclass hooks -------------------------------------------------------------------

    def new_entry(self, bucket: Bucket) -> Entry:
        raise NotImplementedError

    def fill_synthetic(self, entry: Entry) -> None:
        raise NotImplementedError

    def step(self, entry: Entry) -> Any:
        raise NotImplementedError

    def warm_up_buckets(self, sizes: Dict[str, Any], exclude_seen: bool) -> List[Bucket]:
        """The buckets of ``ServingSession.warm_up``'s sizes (``batch_sizes``, ``lengths``,
        ``candidates``, ``k``; None: every configured value)."""
        raise NotImplementedError

    def before_capture(self, entry: Entry) -> None:
        """Called right before the capture's eager warm-up runs."""

    # -- buckets --------------------------------------------------------------------------

    def smallest_bucket(self, *sizes: Tuple[int, Sequence[int]]) -> Optional[Bucket]:
        """The bucket of each ``(size, sorted bucket values)`` pair fitted in turn
        (:func:`fit`), or None where a size fits none or the bucket is not
        :meth:`available` (then the call runs eager)."""
        bucket = tuple(fit(size, values) for size, values in sizes)
        if any(b is None for b in bucket):
            return None
        return bucket if self.available(bucket) else None  # type: ignore[arg-type]

    def available(self, bucket: Bucket) -> bool:
        """Whether ``bucket`` has a graph or room for one (and its capture never failed)."""
        if bucket in self.failed:
            return False
        return bucket in self.entries or len(self.entries) < self.max_graphs

    def entry(self, bucket: Bucket) -> Entry:
        """The bucket's entry: the captured one, else new zeroed buffers (not kept yet)."""
        found = self.entries.get(bucket)
        return found if found is not None else self.new_entry(bucket)

    def describe(self, bucket: Bucket) -> Dict[str, int]:
        return dict(zip(self.fields, bucket))

    # -- capture and replay ---------------------------------------------------------------

    def _capture(self, entry: Entry) -> None:
        self.before_capture(entry)
        torch.cuda.synchronize()
        reserved = torch.cuda.memory_reserved()
        started = time.perf_counter()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # autotuning and lazy allocations, outside the capture
                self.step(entry)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool.handle()):
            out = self.step(entry)
        torch.cuda.synchronize()
        entry.graph, entry.out = graph, out
        entry.capture_ms = (time.perf_counter() - started) * 1e3
        entry.memory_bytes += max(torch.cuda.memory_reserved() - reserved, 0)
        self.captures += 1

    def captured(self, entry: Entry, strict: bool) -> bool:
        """Capture ``entry``'s graph unless it has one, and keep the entry; False when the
        capture failed (recorded; ``strict``: raise instead)."""
        if entry.graph is not None:
            return True
        try:
            self._capture(entry)
        except Exception as exc:  # an op that cannot be captured: run eager from now on
            if strict:
                raise
            self.failed[entry.bucket] = f"{type(exc).__name__}: {exc}"
            return False
        self.entries[entry.bucket] = entry
        return True

    def replayed(self, bucket: Optional[Bucket], run: Callable[[Bucket], Any]) -> Any:
        """``run(bucket)`` (a request replayed in ``bucket``'s graph, None when its capture
        failed) for a request that fits ``bucket``; None otherwise or then, counted as an
        eager call (the caller runs it eager)."""
        out = None if bucket is None else run(bucket)
        if out is None:
            self.eager_calls += 1
        return out

    def replay(self, entry: Entry) -> Any:
        """Replay the entry's graph on its buffers; returns its static output."""
        entry.graph.replay()
        entry.replays += 1
        self.replays += 1
        return entry.out

    @torch.no_grad()
    def warm_up(self, buckets: Sequence[Bucket], strict: bool) -> Dict[str, Any]:
        """Capture ``buckets``' graphs from synthetic inputs, in order, while there is room.

        Returns:
            Dict[str, Any]: ``captured`` (buckets captured now), ``present`` (captured
            before), ``skipped`` (no room left under ``max_graphs``), ``failed`` (bucket ->
            error), ``capture_ms`` and ``memory_bytes`` (of the captures made now).
        """
        report = self.no_report()
        for bucket in dict.fromkeys(buckets):  # once each, in order
            name = self.describe(bucket)
            if bucket in self.entries:
                report["present"].append(name)
                continue
            if not self.available(bucket):
                key = "failed" if bucket in self.failed else "skipped"
                if key == "failed":
                    report["failed"][_label(name)] = self.failed[bucket]
                else:
                    report["skipped"].append(name)
                continue
            entry = self.new_entry(bucket)
            self.fill_synthetic(entry)
            entry.warm_up = True
            if self.captured(entry, strict):
                report["captured"].append(name)
                report["capture_ms"] += entry.capture_ms
                report["memory_bytes"] += entry.memory_bytes
            else:
                report["failed"][_label(name)] = self.failed[bucket]
        return report

    @staticmethod
    def no_report() -> Dict[str, Any]:
        """A :meth:`warm_up` report of nothing captured."""
        return {
            "captured": [],
            "present": [],
            "skipped": [],
            "failed": {},
            "capture_ms": 0.0,
            "memory_bytes": 0,
        }

    @staticmethod
    def no_stats() -> Dict[str, Any]:
        """:meth:`stats` of a session without graphs."""
        return {
            "step": None,
            "captures": 0,
            "replays": 0,
            "eager_calls": 0,
            "capture_ms": 0.0,
            "memory_bytes": 0,
            "graphs": [],
            "failed": {},
        }

    def stats(self) -> Dict[str, Any]:
        graphs = [
            {
                "bucket": self.describe(e.bucket),
                "capture_ms": e.capture_ms,
                "memory_bytes": e.memory_bytes,
                "replays": e.replays,
                "warm_up": e.warm_up,
            }
            for e in self.entries.values()
        ]
        return {
            "step": self.kind,
            "captures": self.captures,
            "replays": self.replays,
            "eager_calls": self.eager_calls,
            "capture_ms": sum(g["capture_ms"] for g in graphs),
            "memory_bytes": sum(g["memory_bytes"] for g in graphs),
            "graphs": graphs,
            "failed": dict(self.failed),
        }


def _label(name: Dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in name.items())


def product(*dims: Sequence[int]) -> List[Bucket]:
    """Every bucket of the given dimensions, the first dimension slowest, smallest first."""
    return [tuple(b) for b in itertools.product(*(sorted(set(d)) for d in dims))]
