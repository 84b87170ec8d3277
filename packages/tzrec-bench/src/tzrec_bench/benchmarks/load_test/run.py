"""The load test's timed run (one trial: one offered rate, one batch bound): a session serves
the stream, then the checked answers are computed again by the model's full forward."""

from __future__ import annotations

import argparse
import bisect
import collections
import contextlib
import dataclasses
import functools
import gc
import math
import time
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from tzrec_bench.benchmarks.load_test.model import DTYPES, Served, build_model
from tzrec_bench.benchmarks.load_test.stalls import StallReport, StallWatch
from tzrec_bench.benchmarks.load_test.stream import Check, Request, _calls, make_stream
from tzrec_bench.service.core import freeze_heap
from tzrec_bench.service.in_flight import InFlight
from tzrec_gr.features import (
    CANDIDATE_ITEM_ID,
    CANDIDATE_LENGTHS,
    CANDIDATE_TIMESTAMPS,
    QUERY_TIME,
    UIH_ACTIONS,
    UIH_ITEM_ID,
    UIH_LENGTHS,
    UIH_TIMESTAMPS,
)
from tzrec_gr.serving import Candidates, Histories, ServingSession
from tzrec_ops.tolerances import Tolerance, tolerance

__all__ = [
    "DTYPES",
    "LoadTestResult",
    "build_model",
    "call_class",
    "check_answers",
    "percentile",
    "run_load_test",
    "size_span",
    "warm_up",
]

#: one request's answer on the host (scores of candidates: the probabilities; top-k: ids and
#: scores)
Answer = Optional[Tuple[torch.Tensor, ...]]



@dataclasses.dataclass
class LoadTestResult:
    """What :func:`run_load_test` measured.

    Attributes:
        sent (int): timed requests in the stream.
        served (int): timed requests answered.
        latencies_ms (List[float]): per served timed request, completion minus due time.
        elapsed_s (float): from the first due time to the last completion.
        events (int): events sent by the timed requests (open and extend).
        kinds (Dict[str, int]): timed requests per kind.
        calls (int): session calls of the timed run.
        checks (int): scoring requests recomputed with the full forward.
        max_abs_diff (float): the largest |served - full forward| over them.
        worst_ratio (float): the largest |served - full forward| / allowed (<= 1 passes).
        tolerance (Tolerance): the one used.
        graph_stats (Dict[str, Any]): ``session.graph_stats()``.
        errors (List[str]): the session calls that raised (their requests are dropped).
        rate (float): the offered rate, requests/s.
        max_batch (int): the most due requests served together.
        stopped (bool): the trial stopped early, with ``stop_ms``: more requests were
            already later than it than its p99 allows; the rest were not sent.
        unfinished_ms (List[float]): when stopped, how late each due, unanswered request
            already was (lower bounds of their latencies).
        dropped (int): timed requests whose session call raised.
        call_ms (Dict[str, List[float]]): how long each timed session call held the host,
            by :func:`call_class` (where a slow server spends its time); its answers may
            reach the host later (the loop goes on meanwhile, see :func:`run_load_test`).
        stalls (StallReport | None): the requests slower than ``--stall-ms`` and what
            overlapped them (:mod:`~tzrec_bench.benchmarks.load_test.stalls`); None with
            ``--no-stall-report``.
        gc_frozen (bool): the heap was frozen out of the cyclic GC for the timed run.
    """

    sent: int
    served: int
    latencies_ms: List[float]
    elapsed_s: float
    events: int
    kinds: Dict[str, int]
    calls: int
    checks: int
    max_abs_diff: float
    worst_ratio: float
    tolerance: Tolerance
    graph_stats: Dict[str, Any]
    errors: List[str] = dataclasses.field(default_factory=list)
    rate: float = math.nan
    max_batch: int = 1
    stopped: bool = False
    unfinished_ms: List[float] = dataclasses.field(default_factory=list)
    dropped: int = 0
    call_ms: Dict[str, List[float]] = dataclasses.field(default_factory=dict)
    stalls: Optional[StallReport] = None
    gc_frozen: bool = False

    @property
    def passed(self) -> bool:
        """Nothing dropped and every check within the tolerance."""
        return self.served == self.sent and self.checks > 0 and self.worst_ratio <= 1.0

    @property
    def achieved(self) -> float:
        """Requests served per second (NaN for none)."""
        return self.served / self.elapsed_s if self.elapsed_s > 0 else math.nan

    def sustains(self, p99_ms: float) -> bool:
        """Whether the offered rate was kept: served to the end, nothing dropped and the
        p99 latency under ``p99_ms``."""
        return (
            not self.stopped
            and self.dropped == 0
            and self.served == self.sent
            and self.percentiles()["p99"] < p99_ms
        )

    def percentiles(self) -> Dict[str, float]:
        """p50, p90, p99 and max latency in ms (when stopped, over the served requests and
        the lower bounds of the unfinished ones)."""
        lat = self.latencies_ms + self.unfinished_ms
        return {
            "p50": percentile(lat, 50),
            "p90": percentile(lat, 90),
            "p99": percentile(lat, 99),
            "max": max(lat) if lat else math.nan,
        }

    def call_times(self) -> List[Tuple[str, int, float, float]]:
        """Per call class (see :func:`call_class`): (class, calls, mean ms, p99 ms)."""
        return [
            (name, len(ms), sum(ms) / len(ms), percentile(ms, 99))
            for name, ms in sorted(self.call_ms.items())
        ]


def call_class(kind: str, users: Sequence[int], extended: set) -> str:
    """The class a session call's duration is reported under: its kind, and for a scoring
    call (``score``/``recommend``) whether one of its ``users`` got events since its last
    scoring call (``extended``), which a session that cannot extend incrementally pays for
    in that call by encoding the user's history again."""
    if kind in ("open", "extend") or not any(u in extended for u in users):
        return kind
    return f"{kind} after extend"


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, interpolated between the closest ranks
    (NaN for no values)."""
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(math.floor(pos))
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _joined(parts: List[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)``; a single request's tensor as it is (not copied)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _histories(group: List[Request]) -> Histories:
    return Histories(
        item_ids=_joined([r.item_ids for r in group]),
        lengths=torch.tensor([r.item_ids.numel() for r in group], dtype=torch.int64),
        timestamps=_joined([r.timestamps for r in group]),
        actions=_joined([r.actions for r in group]),
    )


@dataclasses.dataclass
class _Call:
    """A session call made, its answers on their way to the host."""

    group: List[Request]
    began: float
    flight: InFlight
    answers: Callable[[List[torch.Tensor]], List[Answer]]

    def settle(self) -> List[Answer]:
        """Each request's answer (on the host; waits for the device if needed)."""
        return self.answers(self.flight.wait())


def _serve(
    session: ServingSession, kind: str, group: List[Request], k: int, served: Served
) -> Tuple[InFlight, Callable[[List[torch.Tensor]], List[Answer]]]:
    """One session call for ``group``, without waiting for the device: its results on
    their way to the host, and how they make each request's answer (None for events)."""
    users = [r.user for r in group]
    if kind in ("open", "extend"):
        (session.open if kind == "open" else session.extend)(users, _histories(group))
        return InFlight(device=session.device), lambda _: [None] * len(group)
    if served.takes_k:
        top = session.recommend(users, k)
        return InFlight([top.ids, top.scores]), lambda host: [
            (host[0][b], host[1][b]) for b in range(len(group))
        ]
    counts = [r.item_ids.numel() for r in group]
    lengths = torch.tensor(counts, dtype=torch.int64)
    probs = session.score(users, Candidates(_joined([r.item_ids for r in group]), lengths))
    return InFlight([probs]), lambda host: [(rows,) for rows in host[0].split(counts)]


def _reference(
    model: torch.nn.Module, check: Check, k: int, device: torch.device, served: Served,
    whole_history: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(served values, the full forward's values at the same places), float64 on the host.
    A top-k answer leaves out the items of the history the model reads (the session's
    rule), or with ``whole_history`` those of every event of the user (the service's)."""
    assert check.served is not None
    n = check.item_ids.numel()
    ids, times = check.item_ids.to(device), check.timestamps.to(device)
    lengths = torch.tensor([n], dtype=torch.int64, device=device)
    with torch.no_grad():
        if served.takes_k:
            seen = check.seen if whole_history else check.item_ids
            return _top_k_reference(model, check, k, ids, lengths, times, seen)
        cands = check.request.item_ids
        t = cands.numel()
        query = check.timestamps[-1:].to(device)  # the session's query time: newest event
        batch = {
            UIH_ITEM_ID: ids, UIH_LENGTHS: lengths, UIH_TIMESTAMPS: times,
            CANDIDATE_ITEM_ID: cands.to(device),
            CANDIDATE_LENGTHS: torch.tensor([t], dtype=torch.int64, device=device),
            CANDIDATE_TIMESTAMPS: query.repeat(t), QUERY_TIME: query,
        }
        if served.actions:
            batch[UIH_ACTIONS] = check.actions.to(device)
        want = torch.sigmoid(model(batch).float()).double().cpu()
        return check.served[0].double(), want


def _top_k_reference(
    model: torch.nn.Module, check: Check, k: int, ids: torch.Tensor, lengths: torch.Tensor,
    times: torch.Tensor, seen_ids: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`_reference` of a top-k answer: the exact scores of the served ids, and the
    exact top-k scores (``seen_ids`` excluded) in rank order."""
    assert check.served is not None
    user = model.user_embedding(ids, lengths, times)[0].double()
    items = model.item_embedding(torch.arange(model.num_items, device=ids.device)).double()
    scores = (items @ user).cpu()
    seen = torch.zeros(model.num_items, dtype=torch.bool)
    seen[seen_ids] = True
    scores[seen] = -math.inf
    best = scores.topk(k).values
    served_ids, served_scores = check.served
    valid = served_ids >= 0
    # the served scores at their ids, and in rank order against the exact top-K
    got = torch.cat([served_scores[valid].double(), served_scores[valid].double()])
    want = torch.cat([scores[served_ids[valid]], best[valid]])
    return got, want


def check_answers(
    model: torch.nn.Module, checks: Sequence[Check], args: argparse.Namespace,
    whole_history: bool = False,
) -> Tuple[Tolerance, float, float]:
    """The served answers of ``checks`` against the full forward (:func:`_reference`, with
    ``whole_history`` as there): the dtype's tolerance, the largest |served - full| and the
    worst ratio of a difference to what the tolerance allows (<= 1: within it)."""
    device = torch.device(args.device)
    tol = tolerance(DTYPES[args.dtype])
    max_abs = worst = 0.0
    for check in checks:
        if check.served is None:  # dropped or not sent: counted by the caller
            continue
        got, want = _reference(model, check, args.k, device, args.served, whole_history)
        if got.shape != want.shape:
            if got.numel() != want.numel():
                raise ValueError(f"request {check.request.index}: an answer of "
                                 f"{got.numel()} values, the full forward's {want.numel()}")
            got = got.reshape(want.shape)
        diff = (got - want).abs()
        allowed_diff = tol.atol * float(want.abs().max()) + tol.rtol * want.abs()
        max_abs = max(max_abs, float(diff.max()))
        worst = max(worst, float((diff / allowed_diff.clamp(min=1e-300)).max()))
    return tol, max_abs, worst


def size_span(low: int, high: int) -> List[int]:
    """``low``, the powers of two strictly between ``low`` and ``high``, and ``high``: the
    sizes whose warm-up covers every size in ``[low, high]`` (kernels are tuned per power of
    two)."""
    sizes = {low, high}
    power = 1
    while power < high:
        if power > low:
            sizes.add(power)
        power *= 2
    return sorted(sizes)


def warm_up(
    session: ServingSession, args: argparse.Namespace, max_batch: int
) -> Dict[str, Any]:
    """``session.warm_up`` for the requests of ``args`` with up to ``max_batch`` users per
    call: the CUDA graphs of their buckets, and the eager calls (encoding whole histories,
    incremental extends) at the shapes they take, so that nothing is captured or tuned
    inside the timed run. Returns the session's report."""
    histories = size_span(args.history, args.max_history)
    server = session.server
    sizes: Dict[str, Any] = {
        "batch_sizes": list(range(1, min(max_batch, 64) + 1)),
        "lengths": sorted({server.warm_up_length(n) for n in histories}),
        # the scoring call's size (k, candidates) is given by the option of that name
        server.request_size: [getattr(args, server.request_size)],
    }
    return session.warm_up(**sizes, histories=histories, events=list(range(1, args.events + 1)))


@contextlib.contextmanager
def _gc_frozen(on: bool) -> Iterator[None]:
    """With ``on``, the heap frozen out of the cyclic GC (:func:`freeze_heap`: the stream,
    the session and its users, made before the clock) for the timed run, and given back to
    it after (the trial's garbage is collected before the next trial freezes again)."""
    if on:
        freeze_heap()
    try:
        yield
    finally:
        if on:
            gc.unfreeze()


def _late(served_late: int, due: List[float], first: int, now: float, bound_s: float) -> int:
    """Requests known to be later than ``bound_s``: ``served_late`` plus the unanswered ones
    from ``first`` on that were due more than ``bound_s`` ago."""
    return served_late + max(bisect.bisect_right(due, now - bound_s) - first, 0)


def run_load_test(
    args: argparse.Namespace,
    session: Optional[ServingSession] = None,
    log: Any = None,
    *,
    stop_ms: Optional[float] = None,
) -> LoadTestResult:
    """Run the load test of ``args`` (the command's options, see :func:`main`): one trial
    at ``args.rate`` with up to ``args.max_batch`` requests per call.

    Before the clock: the stream's users are opened (``session.open``, up to
    ``args.open_batch`` at a time) and ``args.warmup`` of its requests served. Then its
    requests are served open-loop, each due at ``start + i / rate``. The loop does not wait
    for the device after a call: the call's results are copied to the host behind its work
    (:class:`~tzrec_bench.service.in_flight.InFlight`) while the loop makes the next
    calls, and a request is done when the loop, looking between calls (or waiting, when
    nothing is due), finds its answer on the host.

    Args:
        args: parsed and resolved options (:func:`main` resolves them).
        session: the session to load, warmed up by the caller (:func:`warm_up`); default:
            a new one over :func:`build_model`, warmed up here.
        log: a ``print``-like callable for progress lines. Default: none.
        stop_ms (float | None): stop the trial as soon as more requests are later than this
            than a p99 under it allows (its p99 is then above it whatever follows), leaving
            the rest unsent (``stopped``). None: serve every request. Default: None.

    Returns:
        LoadTestResult: latencies, throughput, counts and the correctness check.
    """
    device = torch.device(args.device)
    if session is None:
        session = ServingSession(
            build_model(args),
            device=device,
            encode_graphs=not args.no_encode_graphs,
        )
        report = warm_up(session, args, args.max_batch)
        if log:
            log(f"  warm-up: {len(report['captured'])} graphs captured, "
                f"{len(report['encoded']) + len(report['extended'])} eager shapes run in "
                f"{report['seconds']:.1f} s" + (f" ({report['reason']})" if report["reason"]
                                                else ""))
    stream, checks = make_stream(args, args.warmup + args.requests)
    by_index = {c.request.index: c for c in checks}
    opens = [r for r in stream if r.kind == "open"]
    rest = stream[len(opens):]
    warm, timed = rest[: args.warmup], rest[args.warmup:]
    first = timed[0].index if timed else 0
    errors: List[str] = []
    dropped = 0

    def serve(kind: str, group: List[Request]) -> Optional[_Call]:
        nonlocal dropped
        began = time.perf_counter()
        try:
            return _Call(group, began, *_serve(session, kind, group, args.k, args.served))
        except Exception as exc:  # the server drops these requests and goes on
            errors.append(f"{kind} of users {[r.user for r in group]} (requests "
                          f"{[r.index for r in group]}): {type(exc).__name__}: {exc}")
            if group and group[0].index >= first:
                dropped += len(group)
            return None

    def serve_now(kind: str, group: List[Request]) -> None:
        call = serve(kind, group)
        for req, answer in zip(group, call.settle() if call is not None else []):
            if req.index in by_index:
                by_index[req.index].served = answer

    open_batch = max(getattr(args, "open_batch", args.max_batch), 1)
    for i in range(0, len(opens), open_batch):
        serve_now("open", opens[i: i + open_batch])
    for kind, group in _calls(warm, args.max_batch):
        serve_now(kind, group)
    if log:
        log(f"  {len(opens)} users opened and {len(warm)} requests served; the clock starts "
            f"({len(timed)} requests at {args.rate:g}/s, max batch {args.max_batch})")
    latencies: List[float] = []
    served = calls = late = 0
    stopped = False
    unfinished: List[float] = []
    bound_s = math.inf if stop_ms is None else stop_ms / 1e3
    allowed = 0.01 * len(timed) + 2  # this many late requests put the p99 above the bound
    scoring = session.server.call
    extended = set()  # users with events since their last scoring call
    for req in warm:
        (extended.add if req.kind == "extend" else extended.discard)(req.user)
    call_ms: Dict[str, List[float]] = {}
    windows: List[Tuple[float, float, float]] = []  # (due, call start, done) per request
    # calls whose answers are on their way to the host, oldest first (the device runs
    # them in this order); a request is done when its answer is seen on the host, which
    # the loop looks for between calls, so no latency is counted short
    in_flight: Deque[_Call] = collections.deque()
    watch = StallWatch(session) if getattr(args, "stall_report", True) else None
    frozen = bool(getattr(args, "gc_freeze", True))

    def settle(wait: bool) -> None:
        """Answer the calls whose results are on the host (``wait``: every call)."""
        nonlocal done, served, late
        while in_flight and (wait or in_flight[0].flight.ready()):
            call = in_flight.popleft()
            answers = call.settle()
            done = time.perf_counter()
            for req, answer in zip(call.group, answers):
                due_at = due[req.index - first]
                latency = done - due_at
                latencies.append(latency * 1e3)
                windows.append((due_at, call.began, done))
                late += latency > bound_s
                served += 1
                if req.index in by_index:
                    by_index[req.index].served = answer

    with _gc_frozen(frozen), watch if watch is not None else contextlib.nullcontext():
        start = time.perf_counter()
        due = [start + i / args.rate for i in range(len(timed))]
        done = start
        nxt = 0
        while nxt < len(timed):
            now = time.perf_counter()
            if due[nxt] > now:
                settle(wait=True)  # nothing is due: take every answer first
                now = time.perf_counter()
                if due[nxt] > now:
                    time.sleep(due[nxt] - now)
                    now = time.perf_counter()
            stop = nxt
            while stop < len(timed) and stop - nxt < args.max_batch and due[stop] <= now:
                stop += 1
            stop = max(stop, nxt + 1)
            for kind, group in _calls(timed[nxt:stop], args.max_batch):
                users = [r.user for r in group]
                name = call_class(scoring if kind == "score" else kind, users, extended)
                if watch is None:
                    call = serve(kind, group)
                    returned = time.perf_counter()
                else:
                    call, _, returned = watch.call(name, functools.partial(serve, kind, group))
                if call is not None:
                    call_ms.setdefault(name, []).append((returned - call.began) * 1e3)
                    in_flight.append(call)
                if kind == "extend":
                    extended.update(users)
                else:
                    extended.difference_update(users)
                calls += 1
                settle(wait=False)
            nxt = stop
            if stop_ms is not None and nxt < len(timed):
                now = time.perf_counter()
                waiting = sum(now - due[r.index - first] > bound_s
                              for call in in_flight for r in call.group)
                if _late(late + waiting, due, nxt, now, bound_s) >= allowed:
                    stopped = True
                    settle(wait=True)
                    now = time.perf_counter()
                    waiting_due = due[nxt: bisect.bisect_right(due, now)]
                    unfinished = [(now - d) * 1e3 for d in waiting_due]
                    break
        settle(wait=True)
    elapsed = done - start
    stalls = None
    if watch is not None:
        stall_ms = getattr(args, "stall_ms", None) or getattr(args, "p99_ms", 50.0)
        stalls = watch.report(windows, stall_ms)
    if log:
        log(f"  {served} requests served in {elapsed:.2f} s"
            + (" (stopped: the p99 bound is already exceeded)" if stopped else "")
            + f"; checking {sum(c.served is not None for c in checks)} answers against the "
            "full forward")
    tol, max_abs, worst = check_answers(session.model, checks, args)
    kinds: Dict[str, int] = {}
    for req in timed:
        kinds[req.kind] = kinds.get(req.kind, 0) + 1
    return LoadTestResult(
        sent=len(timed),
        served=served,
        latencies_ms=latencies,
        elapsed_s=elapsed,
        events=sum(r.item_ids.numel() for r in timed if r.kind == "extend"),
        kinds=kinds,
        calls=calls,
        checks=sum(c.served is not None for c in checks),
        max_abs_diff=max_abs,
        worst_ratio=worst,
        tolerance=tol,
        graph_stats=session.graph_stats(),
        errors=errors,
        rate=args.rate,
        max_batch=args.max_batch,
        stopped=stopped,
        unfinished_ms=unfinished,
        dropped=dropped,
        call_ms=call_ms,
        stalls=stalls,
        gc_frozen=frozen,
    )
