"""The sustained rate: trials of the load test at several offered rates, and the highest rate
at which the p99 latency stays under a bound with nothing dropped.

A trial (:func:`~tzrec_bench.benchmarks.load_test.run.run_load_test`) serves a stream of the
same seed (``--requests`` requests, or ``--duration`` seconds of them at the trial's rate) at
one offered rate and one batch bound on one warmed-up session; it *sustains* the rate when
every request is served, none is dropped and the p99 latency is under ``--p99-ms``.
A trial stops early once more of its requests are already later than the bound than its
p99 allows (it cannot pass any more), so an overloaded trial costs little time.

Two ways to choose the rates:

* ``--rates R1,R2,...``: those rates, lowest first;
* ``--search``: from ``--rate``, double while the trial passes (halve while it fails), up to
  ``--max-rate``; then bisect (geometric midpoints) between the highest passing and the
  lowest failing rate until they are within ``--search-precision`` of each other, at most
  ``--max-trials`` trials in all.

The sustained rate is the highest passing rate tried. A trial of d seconds at a rate r above
the capacity c ends with a queue of ``d (r - c)`` requests, ``d (r - c) / c`` seconds of
waiting, so it passes only if that stays under the bound: the reported rate overstates the
capacity by at most a factor ``1 + bound / d`` (1.7% for 3 s trials and a 50 ms bound).
"""

from __future__ import annotations

import argparse
import copy
import math
from typing import Any, Callable, List, Optional, Sequence

from tzrec_bench.benchmarks.load_test.run import LoadTestResult, run_load_test
from tzrec_gr.serving import ServingSession

__all__ = ["search_rates", "sustained", "sweep_rates", "table"]

Log = Optional[Callable[[str], Any]]
#: runs one trial of options ``args`` with the p99 bound ``stop_ms`` (the HTTP mode's);
#: default: :func:`run_load_test` on the session
Runner = Callable[[argparse.Namespace, float], LoadTestResult]


def _trial(
    args: argparse.Namespace,
    session: Optional[ServingSession],
    max_batch: int,
    rate: float,
    p99_ms: float,
    log: Log,
    run: Optional[Runner] = None,
) -> LoadTestResult:
    trial = copy.copy(args)
    trial.rate, trial.max_batch = rate, max_batch
    if not getattr(args, "fixed_requests", True):  # --duration seconds at this rate
        trial.requests = max(1, int(round(args.duration * rate)))
    if run is None:
        result = run_load_test(trial, session, stop_ms=p99_ms)
    else:
        result = run(trial, p99_ms)
    if log:
        log("  " + row(result, p99_ms))
        if result.stalls is not None:
            log("    " + result.stalls.line())
    return result


def sweep_rates(
    args: argparse.Namespace,
    session: Optional[ServingSession],
    max_batch: int,
    rates: Sequence[float],
    p99_ms: float,
    log: Log = None,
    run: Optional[Runner] = None,
) -> List[LoadTestResult]:
    """One trial at each of ``rates``, lowest first (``run``: how, default on
    ``session``)."""
    return [_trial(args, session, max_batch, r, p99_ms, log, run) for r in sorted(set(rates))]


def _round(rate: float) -> float:
    return float(f"{rate:.3g}")


def search_rates(
    args: argparse.Namespace,
    session: Optional[ServingSession],
    max_batch: int,
    p99_ms: float,
    log: Log = None,
    run: Optional[Runner] = None,
) -> List[LoadTestResult]:
    """Trials from ``args.rate`` by doubling (or halving), then bisection (see the module
    docstring), each on ``session`` or by ``run``; returns them in the order run."""
    trials: List[LoadTestResult] = []
    passing: Optional[float] = None
    failing: Optional[float] = None
    rate = args.rate
    lowest = args.rate / 64
    while len(trials) < args.max_trials:
        result = _trial(args, session, max_batch, rate, p99_ms, log, run)
        trials.append(result)
        if result.sustains(p99_ms):
            passing = rate if passing is None else max(passing, rate)
        else:
            failing = rate if failing is None else min(failing, rate)
        if passing is None:
            if rate / 2 < lowest:
                break
            rate = _round(rate / 2)
        elif failing is None:
            if rate >= args.max_rate:
                break
            rate = min(_round(rate * 2), args.max_rate)
        else:
            if failing <= passing * (1 + args.search_precision):
                break
            rate = _round(math.sqrt(passing * failing))
            if rate in (passing, failing):
                break
    return trials


def sustained(trials: Sequence[LoadTestResult], p99_ms: float) -> Optional[float]:
    """The highest offered rate among ``trials`` that was sustained, or None."""
    rates = [t.rate for t in trials if t.sustains(p99_ms)]
    return max(rates) if rates else None


def row(result: LoadTestResult, p99_ms: float) -> str:
    """One trial as a line of :func:`table`."""
    pct = result.percentiles()
    mark = ">=" if result.stopped else ""
    if result.sustains(p99_ms):
        verdict = "sustained"
    elif result.dropped:
        verdict = f"{result.dropped} dropped"
    elif result.stopped:
        verdict = f"stopped: p99 >= {p99_ms:g} ms"
    else:
        verdict = f"p99 >= {p99_ms:g} ms"
    p50, p99 = (f"{mark}{pct[k]:.1f}" for k in ("p50", "p99"))
    return (
        f"{result.rate:>10,.0f} {result.achieved:>10,.1f} {p50:>10} {p99:>10} "
        f"{result.dropped:>7} {result.served:>7,}/{result.sent:<7,} {verdict}"
    )


def table(trials: Sequence[LoadTestResult], p99_ms: float) -> List[str]:
    """The trials as lines: offered and achieved requests/s, p50 and p99 latency (ms;
    ``>=`` marks the lower bounds of a stopped trial), requests dropped, served of sent,
    and whether the rate was sustained; lowest rate first."""
    head = (
        f"{'offered/s':>10} {'achieved/s':>10} {'p50 ms':>10} {'p99 ms':>10} "
        f"{'dropped':>7} {'served/sent':<15} result"
    )
    return [head] + [row(t, p99_ms) for t in sorted(trials, key=lambda t: t.rate)]
