"""Stalls of a timed trial: the requests slower than a threshold, and what happened while
each waited.

A request's latency is its completion minus its due time: the wait before its session call
began (behind earlier calls, or in a batch being formed) plus the call itself. A *stall* is
a request over ``--stall-ms`` (default: the p99 bound). :class:`StallWatch` records, cheaply
enough to stay on in every trial,

* Python's cyclic GC: every collection's generation, start and end (``gc.callbacks``);
* per session call: its kind, start and end, and how much each of these grew inside it:
  the session's CUDA graph captures and eager calls outside every bucket
  (:meth:`~tzrec_gr.serving.ServingSession.graph_counts`: a shape ``warm_up`` did not
  cover), Triton kernels built in this process (``triton.knobs.runtime``'s
  ``jit_post_compile_hook``: a JIT cache miss, compiled or loaded from the disk cache) and
  autotuned keys of the tzrec-ops kernels (the autotuners' caches; a new key benchmarks
  every config);
* the CUDA caching allocator over the trial (``torch.cuda.memory_stats``: retries after a
  failed ``cudaMalloc``, segments allocated and freed), read before and after the clock.

:func:`attribute` then gives each stall what overlapped its window (due to completion):
GC collections, calls that captured, compiled or tuned, and the longest call, and names its
first cause in this order: ``capture``, ``compile`` (Triton built or tuned a kernel),
``eager shape`` (a call outside every bucket), ``gc2`` (a full collection), ``slow call`` (a
call of at least half the threshold) or ``backlog`` (none of these: many ordinary calls,
the rate is above what the session serves).
"""

from __future__ import annotations

import bisect
import dataclasses
import gc
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["Call", "Collection", "StallReport", "StallWatch", "attribute"]

#: the allocator's counters read before and after a trial (torch.cuda.memory_stats keys)
ALLOCATOR_STATS = {
    "num_alloc_retries": "retries",
    "segment.all.allocated": "cudaMalloc",
    "segment.all.freed": "cudaFree",
}


@dataclasses.dataclass(frozen=True)
class Collection:
    """One cyclic-GC collection: its generation (0, 1, 2) and perf_counter start and end."""

    generation: int
    start: float
    end: float

    @property
    def ms(self) -> float:
        return (self.end - self.start) * 1e3


@dataclasses.dataclass(frozen=True)
class Call:
    """One timed session call: its class, perf_counter start and end, and what grew in it:
    CUDA graph ``captures``, ``eager`` calls outside every bucket, Triton kernels
    ``built`` and autotune keys ``tuned``."""

    kind: str
    began: float
    done: float
    captures: int = 0
    eager: int = 0
    built: int = 0
    tuned: int = 0

    @property
    def ms(self) -> float:
        return (self.done - self.began) * 1e3


#: the causes a stall is given, in the order they are tried
CAUSES = ("capture", "compile", "eager shape", "gc2", "slow call", "backlog")


@dataclasses.dataclass
class StallReport:
    """What :func:`attribute` found in one trial.

    Attributes:
        threshold_ms (float): a stall is a request slower than this.
        requests (int): timed requests served.
        stalls (int): of them, slower than ``threshold_ms``.
        causes (Dict[str, int]): stalls per first cause (:data:`CAUSES`).
        gc2 (int): stalls whose window a full (gen-2) collection overlapped.
        gc_max_ms (Dict[int, float]): the longest collection of each generation in the trial.
        gc_counts (Dict[int, int]): collections of each generation in the trial.
        captures, built, tuned, eager (int): graph captures, Triton kernels built,
            autotune keys and eager calls outside every bucket in the trial's calls.
        wait_ms, call_ms (List[float]): each stall's wait before its call began and its
            own call's duration.
        longest_call (Optional[Call]): the longest call in any stall's window.
        allocator (Dict[str, int]): growth of :data:`ALLOCATOR_STATS` over the trial
            (empty off CUDA).
    """

    threshold_ms: float
    requests: int = 0
    stalls: int = 0
    causes: Dict[str, int] = dataclasses.field(default_factory=dict)
    gc2: int = 0
    gc_max_ms: Dict[int, float] = dataclasses.field(default_factory=dict)
    gc_counts: Dict[int, int] = dataclasses.field(default_factory=dict)
    captures: int = 0
    built: int = 0
    tuned: int = 0
    eager: int = 0
    wait_ms: List[float] = dataclasses.field(default_factory=list)
    call_ms: List[float] = dataclasses.field(default_factory=list)
    longest_call: Optional[Call] = None
    allocator: Dict[str, int] = dataclasses.field(default_factory=dict)

    def line(self) -> str:
        """The summary printed under a trial."""
        gc_max = self.gc_max_ms.get(2, 0.0)
        young = max(self.gc_max_ms.get(0, 0.0), self.gc_max_ms.get(1, 0.0))
        parts = [
            f"stalls > {self.threshold_ms:g} ms: {self.stalls} of {self.requests}",
            f"GC gen2 {self.gc_counts.get(2, 0)} in the trial (max {gc_max:.1f} ms), "
            f"overlapping {self.gc2} stalls; gen0/1 {self.gc_counts.get(0, 0)}/"
            f"{self.gc_counts.get(1, 0)} (max {young:.1f} ms)",
            f"new captures {self.captures}, Triton kernels built {self.built}, autotuned "
            f"keys {self.tuned}, eager calls outside buckets {self.eager}",
        ]
        if self.stalls:
            parts.append(
                f"stalls' wait / own call: mean {_mean(self.wait_ms):.1f} / "
                f"{_mean(self.call_ms):.1f} ms, max {max(self.wait_ms):.1f} / "
                f"{max(self.call_ms):.1f} ms"
            )
            if self.longest_call is not None:
                parts.append(f"longest call in their windows {self.longest_call.ms:.1f} ms "
                             f"({self.longest_call.kind})")
            parts.append("causes: " + ", ".join(
                f"{c} {self.causes[c]}" for c in CAUSES if self.causes.get(c)))
        if self.allocator:
            parts.append("allocator: " + ", ".join(
                f"+{n} {name}" for name, n in self.allocator.items()))
        return "; ".join(parts)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _overlaps(start: float, end: float, low: float, high: float) -> bool:
    return start < high and end > low


def attribute(
    requests: Sequence[Tuple[float, float, float]],
    calls: Sequence[Call],
    collections: Sequence[Collection],
    threshold_ms: float,
    allocator: Optional[Dict[str, int]] = None,
) -> StallReport:
    """The stalls among ``requests`` ((due, began, done) perf_counter times of each served
    request: due, its call's start, its completion) and what overlapped each one's window
    ``[due, done]``: ``calls`` and GC ``collections`` of the trial (see the module
    docstring for the causes)."""
    report = StallReport(threshold_ms=threshold_ms, requests=len(requests),
                         allocator=dict(allocator or {}))
    for c in collections:
        report.gc_counts[c.generation] = report.gc_counts.get(c.generation, 0) + 1
        report.gc_max_ms[c.generation] = max(report.gc_max_ms.get(c.generation, 0.0), c.ms)
    for call in calls:
        report.captures += call.captures
        report.built += call.built
        report.tuned += call.tuned
        report.eager += call.eager
    bound = threshold_ms / 1e3
    # the trial's calls run one after another: sorted by start, they are sorted by end too
    ordered = sorted(calls, key=lambda c: c.began)
    starts = [c.began for c in ordered]
    ends = [c.done for c in ordered]
    for due, began, done in requests:
        if done - due <= bound:
            continue
        report.stalls += 1
        report.wait_ms.append((began - due) * 1e3)
        report.call_ms.append((done - began) * 1e3)
        window = ordered[bisect.bisect_right(ends, due): bisect.bisect_left(starts, done)]
        full = any(c.generation == 2 and _overlaps(c.start, c.end, due, done)
                   for c in collections)
        report.gc2 += full
        longest = max(window, key=lambda c: c.ms, default=None)
        if longest is not None and (report.longest_call is None
                                    or longest.ms > report.longest_call.ms):
            report.longest_call = longest
        if any(c.captures for c in window):
            cause = "capture"
        elif any(c.built or c.tuned for c in window):
            cause = "compile"
        elif any(c.eager for c in window):
            cause = "eager shape"
        elif full:
            cause = "gc2"
        elif longest is not None and longest.ms >= threshold_ms / 2:
            cause = "slow call"
        else:
            cause = "backlog"
        report.causes[cause] = report.causes.get(cause, 0) + 1
    return report


class _TritonBuilds:
    """Counts Triton kernels built in this process through ``jit_post_compile_hook``,
    chained to a hook already set (Triton keeps one)."""

    def __init__(self) -> None:
        self.count = 0
        self._knobs: Any = None
        self._previous: Any = None

    def _hook(self, **kwargs: Any) -> Any:
        self.count += 1
        return None if self._previous is None else self._previous(**kwargs)

    def install(self) -> None:
        try:
            from triton import knobs
        except ImportError:  # no Triton (or one without knobs): nothing is built by it
            return
        self._knobs = knobs
        self._previous = knobs.runtime.jit_post_compile_hook
        knobs.runtime.jit_post_compile_hook = self._hook

    def remove(self) -> None:
        if self._knobs is not None and self._knobs.runtime.jit_post_compile_hook == self._hook:
            self._knobs.runtime.jit_post_compile_hook = self._previous
        self._knobs = None


def _tuned_keys() -> Callable[[], int]:
    """A counter of the keys the tzrec-ops Triton kernels' autotuners have tuned
    (``tzrec_ops.backends.triton.autotune.tuned_keys``), or a constant 0 without Triton."""
    try:
        from tzrec_ops.backends.triton.autotune import tuned_keys
    except ImportError:
        return lambda: 0
    return tuned_keys


class StallWatch:
    """Records a trial's GC collections, its session calls (with what grew in each) and the
    allocator's counters (:func:`attribute` reads them): ``with StallWatch(session) as
    watch:`` around the timed run, ``watch.call(kind, run)`` for each call."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self.collections: List[Collection] = []
        self.calls: List[Call] = []
        self.allocator: Dict[str, int] = {}
        self._gc_start: Dict[int, float] = {}
        self._builds = _TritonBuilds()
        self._tuned = _tuned_keys()
        self._memory: Dict[str, int] = {}

    def _on_gc(self, phase: str, info: Dict[str, Any]) -> None:
        now = time.perf_counter()
        generation = int(info.get("generation", -1))
        if phase == "start":
            self._gc_start[generation] = now
        else:
            self.collections.append(
                Collection(generation, self._gc_start.pop(generation, now), now))

    def _allocator(self) -> Dict[str, int]:
        device = self.session.device
        if device.type != "cuda":
            return {}
        stats = torch.cuda.memory_stats(device)
        return {name: int(stats.get(key, 0)) for key, name in ALLOCATOR_STATS.items()}

    def __enter__(self) -> "StallWatch":
        self._memory = self._allocator()
        self._builds.install()
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        self._builds.remove()
        after = self._allocator()
        self.allocator = {name: after[name] - self._memory.get(name, 0) for name in after}

    def call(self, kind: str, run: Callable[[], Any]) -> Tuple[Any, float, float]:
        """``run()`` timed and recorded as a call of class ``kind``; returns its result and
        its perf_counter start and end."""
        captures, eager = self.session.graph_counts()
        built, tuned = self._builds.count, self._tuned()
        began = time.perf_counter()
        try:
            out = run()
        finally:
            done = time.perf_counter()
            captures_now, eager_now = self.session.graph_counts()
            self.calls.append(Call(kind, began, done, captures_now - captures,
                                   eager_now - eager, self._builds.count - built,
                                   self._tuned() - tuned))
        return out, began, done

    def report(self, requests: Sequence[Tuple[float, float, float]],
               threshold_ms: float) -> StallReport:
        """:func:`attribute` of ``requests`` over what was recorded."""
        return attribute(requests, self.calls, self.collections, threshold_ms, self.allocator)
