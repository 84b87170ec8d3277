"""The load test's HTTP mode (``--http``): the same open-loop stream sent to the service
(:mod:`tzrec_bench.service`, the app ``tzrec-bench serve`` runs) over real connections.

The service runs in its own process (:mod:`~tzrec_bench.benchmarks.load_test.server`, as
in production: its event loop, batcher thread and model do not share the client's
interpreter), with the load test's model (same options and seed; the weights' digest is
compared), its warm-up, ``--max-batch`` (the largest given) and ``--max-wait-ms``, and a
SQLite database (``--http-db``; default ``temp``, a new file in a temporary folder: events
are committed to disk before they are acknowledged, as in production; ``:memory:`` keeps
them in memory, which measures the HTTP layer without the disk; a comma list runs the HTTP
trials once per database).

A trial (:func:`run_http_trial`) draws the stream of the in-process trial at the same rate
and seed (:func:`~tzrec_bench.benchmarks.load_test.stream.make_stream`), with the users
renamed per trial (user ``u`` of trial ``t`` is ``t * --users + u``) so that each trial
starts from its own starting histories. Before the clock, each user's starting history is
sent as ``POST /events`` and one scoring request opens the user in the session (the
in-process trial's ``session.open``), then ``--warmup`` requests are served. On the clock,
request ``i`` is sent at ``start + i / rate`` through an ``httpx.AsyncClient`` pool of
``--connections`` connections, whether or not earlier requests were answered (open loop);
only a user's own requests wait for that user's previous answer, as a client of one user
would (and as the in-process server keeps each user's order). Latency is the answer's
arrival minus the due time. Events are ``POST /events``, scoring requests ``GET
/recommend?user=&k=`` or ``POST /score {user, candidates}``.

A request answered with another status than 200, or not answered (a connection error, a
timeout), is counted as dropped and its first lines kept: never silently lost. The
client's own lag (send time minus due time) is reported: when its p99 is large, the client,
not the service, set the rate.

The answer check: every ``--check-every``-th scoring request's answer through HTTP is
computed again by the full forward over the user's history at that moment
(:func:`~tzrec_bench.benchmarks.load_test.run.check_answers`), with the dtype's
tolerance: the same check the in-process answers pass, but for a top-k answer every item of
the user's whole history is left out (the service's ``exclude_seen``, as ``predict``),
where the session leaves out the items of the events it holds.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from tzrec_bench.benchmarks.load_test.run import LoadTestResult, check_answers, percentile
from tzrec_bench.benchmarks.load_test.server import OPTIONS
from tzrec_bench.benchmarks.load_test.stream import Check, Request, make_stream

__all__ = ["HttpResult", "ServiceProcess", "run_http_trial", "start_service"]

#: events per ``POST /events`` (the service's bound)
MAX_EVENTS = 1024
#: seconds a request may take before it counts as dropped
REQUEST_TIMEOUT_S = 60.0

Log = Optional[Callable[[str], Any]]
Call = Tuple[str, str, Dict[str, Any]]


@dataclasses.dataclass
class HttpResult(LoadTestResult):
    """A trial through HTTP: :class:`LoadTestResult` (``calls`` and ``call_ms`` empty: the
    service's calls are its own) and the client's lag.

    Attributes:
        send_lag_ms (List[float]): per timed request, the time it was sent minus its due
            time (the client's own delay, before any wait for the user's previous answer).
        refused (int): requests answered 503 (the service's queue was full: its answer to
            overload, counted in ``dropped`` but not in ``errors``).
    """

    send_lag_ms: List[float] = dataclasses.field(default_factory=list)
    refused: int = 0


class ServiceProcess:
    """The service's process (:func:`start_service`): ``url``, ``info()``, ``metrics()``,
    ``stop()``."""

    def __init__(self, process: subprocess.Popen, url: str) -> None:
        self.process = process
        self.url = url

    def get(self, path: str) -> Any:
        import httpx

        response = httpx.get(self.url + path, timeout=REQUEST_TIMEOUT_S)
        response.raise_for_status()
        return response

    def info(self) -> Dict[str, Any]:
        """``GET /info``."""
        return self.get("/info").json()

    def mean_batch(self) -> float:
        """Requests per batch of the service's batcher so far (its Prometheus metrics)."""
        values = {}
        for line in self.get("/metrics").text.splitlines():
            name, _, value = line.partition(" ")
            if name in ("tzrec_batch_size_sum", "tzrec_batch_size_count"):
                values[name] = float(value)
        count = values.get("tzrec_batch_size_count", 0.0)
        return values.get("tzrec_batch_size_sum", math.nan) / count if count else math.nan

    def stop(self) -> None:
        """Terminate the process (killed when it does not end within 30 s)."""
        if self.process.poll() is None:
            self.process.terminate()
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_service(args: argparse.Namespace, max_batch: int, db: str, log: Log = None,
                  ready_timeout_s: float = 60.0) -> ServiceProcess:
    """Start the service's process for the load test's options, once it answers
    ``/readyz``.

    Raises:
        RuntimeError: the process ended before it listened, or was not ready in time.
    """
    import httpx

    options = {name: getattr(args, name) for name in OPTIONS}
    options.update(device=str(args.device), max_batch=max_batch, db=db,
                   max_wait_ms=args.max_wait_ms, queue=args.queue)
    process = subprocess.Popen(
        [sys.executable, "-m", "tzrec_bench.benchmarks.load_test.server", json.dumps(options)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # stdin: see server.py
    assert process.stdout is not None
    port = None
    for line in process.stdout:  # the warm-up's report, then the port
        if line.startswith("PORT "):
            port = int(line.split()[1])
            break
        if log:
            log("  " + line.rstrip())
    if port is None:
        status = process.wait()
        raise RuntimeError(f"the service's process ended (status {status}) before it "
                           "listened; its error is above")
    service = ServiceProcess(process, f"http://127.0.0.1:{port}")
    deadline = time.perf_counter() + ready_timeout_s
    while True:
        try:
            if httpx.get(service.url + "/readyz", timeout=5.0).status_code == 200:
                return service
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.perf_counter() > deadline:
            service.stop()
            raise RuntimeError(f"the service at {service.url} was not ready within "
                               f"{ready_timeout_s:g} s (status {process.returncode})")
        time.sleep(0.05)


class _Failed(Exception):
    """A request the service did not answer with 200 (the message says what came;
    ``status``: the HTTP status, None for no answer)."""

    def __init__(self, message: str, status: Optional[int] = None) -> None:
        super().__init__(message)
        self.status = status


class _Client:
    """The requests of one trial's stream over one connection pool."""

    def __init__(self, args: argparse.Namespace, client: Any, offset: int) -> None:
        self.args = args
        self.client = client
        self.offset = offset

    def calls(self, req: Request) -> List[Call]:
        """The HTTP calls of a request (an event list longer than the service takes: in
        parts, in order)."""
        user = self.offset + req.user
        if req.kind == "score":
            if self.args.served.takes_k:
                return [("GET", "/recommend", {"params": {"user": user, "k": self.args.k}})]
            return [("POST", "/score", {"json": {"user": user,
                                                 "candidates": req.item_ids.tolist()}})]
        out = []
        for start in range(0, req.item_ids.numel(), MAX_EVENTS):
            part = slice(start, start + MAX_EVENTS)
            body = {"user": user, "items": req.item_ids[part].tolist(),
                    "timestamps": req.timestamps[part].tolist()}
            if self.args.served.actions:
                body["actions"] = req.actions[part].tolist()
            out.append(("POST", "/events", {"json": body}))
        return out

    def answer(self, body: Dict[str, Any]) -> Tuple[torch.Tensor, ...]:
        """A scoring answer as the in-process trial holds it: top-k (ids [k] with -1 after
        the last, scores [k]) or probabilities [T, tasks]."""
        if self.args.served.takes_k:
            k, ids = self.args.k, body["items"]
            return (torch.tensor(ids + [-1] * (k - len(ids)), dtype=torch.int64),
                    torch.tensor(body["scores"] + [-math.inf] * (k - len(ids)),
                                 dtype=torch.float64))
        return (torch.tensor(list(body["scores"].values()), dtype=torch.float64).t(),)

    async def send(self, req: Request) -> Optional[Tuple[torch.Tensor, ...]]:
        """Send the request's calls in order; its answer (None for events).

        Raises:
            _Failed: a status other than 200, or no answer.
        """
        import httpx

        response = None
        for method, path, kwargs in self.calls(req):
            try:
                response = await self.client.request(method, path, **kwargs)
            except httpx.HTTPError as exc:
                raise _Failed(f"{method} {path}: {type(exc).__name__}: {exc}") from None
            if response.status_code != 200:
                raise _Failed(f"{method} {path}: HTTP {response.status_code}: "
                              f"{response.text[:200]}", response.status_code)
        if req.kind != "score" or response is None:
            return None
        try:
            return self.answer(response.json())
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise _Failed(f"{method} {path}: an answer of another form "
                          f"({type(exc).__name__}: {exc}): {response.text[:200]}") from None


def _opener(args: argparse.Namespace, req: Request) -> Request:
    """A scoring request for the user of an ``open`` (which opens it in the session)."""
    cands = torch.zeros(0, dtype=torch.int64)
    if not args.served.takes_k:
        cands = torch.arange(args.candidates, dtype=torch.int64) % args.items
    empty = torch.zeros(0, dtype=torch.int64)
    return Request(req.index, req.user, "score", cands, empty, empty)


async def _trial(args: argparse.Namespace, url: str, offset: int, stop_ms: Optional[float],
                 transport: Any, connections: int, log: Log) -> Dict[str, Any]:
    import httpx

    stream, checks = make_stream(args, args.warmup + args.requests)
    by_index = {c.request.index: c for c in checks}
    opens = [r for r in stream if r.kind == "open"]
    rest = stream[len(opens):]
    warm, timed = rest[: args.warmup], rest[args.warmup:]
    errors: List[str] = []
    refused = [0]

    def failed(req: Request, exc: _Failed) -> None:
        if exc.status == 503:  # overload, answered as designed: the trial is not sustained
            refused[0] += 1
            return
        errors.append(f"{req.kind} of user {offset + req.user} (request {req.index}): {exc}")

    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    async with httpx.AsyncClient(base_url=url, limits=limits, transport=transport,
                                 timeout=REQUEST_TIMEOUT_S) as http:
        client = _Client(args, http, offset)
        gate = asyncio.Semaphore(connections)

        async def untimed(req: Request) -> None:
            async with gate:
                try:
                    answer = await client.send(req)
                except _Failed as exc:
                    failed(req, exc)
                    return
            if req.index in by_index and req.kind == "score":
                by_index[req.index].served = answer

        await asyncio.gather(*(untimed(r) for r in opens))
        await asyncio.gather(*(untimed(_opener(args, r)) for r in opens))
        for req in warm:
            await untimed(req)
        if log:
            log(f"  {len(opens)} users' histories sent and opened and {len(warm)} requests "
                f"served; the clock starts ({len(timed)} requests at {args.rate:g}/s over "
                f"{connections} connections)")
        n = len(timed)
        done = [False] * n
        latencies: List[float] = []
        lags: List[float] = []
        counts = {"served": 0, "dropped": 0, "late": 0}
        bound_s = math.inf if stop_ms is None else stop_ms / 1e3
        last_done = start = time.perf_counter()
        due = [start + i / args.rate for i in range(n)]

        async def one(i: int, req: Request, before: Optional[asyncio.Task]) -> None:
            nonlocal last_done
            if before is not None:
                await asyncio.wait([before])
            try:
                answer = await client.send(req)
            except _Failed as exc:
                counts["dropped"] += 1
                failed(req, exc)
                return
            finally:
                done[i] = True
            last_done = time.perf_counter()
            latency = last_done - due[i]
            latencies.append(latency * 1e3)
            counts["late"] += latency > bound_s
            counts["served"] += 1
            if req.index in by_index:
                by_index[req.index].served = answer

        tasks: List[asyncio.Task] = []
        tails: Dict[int, asyncio.Task] = {}
        allowed = 0.01 * n + 2  # this many late requests put the p99 above the bound
        oldest = 0  # the first request not answered
        stopped = False
        unfinished: List[float] = []
        for i, req in enumerate(timed):
            wait = due[i] - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            lags.append((time.perf_counter() - due[i]) * 1e3)
            task = asyncio.create_task(one(i, req, tails.get(req.user)))
            tails[req.user] = task
            tasks.append(task)
            if stop_ms is not None and i % 16 == 15:
                while oldest <= i and done[oldest]:
                    oldest += 1
                now = time.perf_counter()
                waiting = [j for j in range(oldest, i + 1) if not done[j]]
                if counts["late"] + sum(due[j] < now - bound_s for j in waiting) >= allowed:
                    stopped = True
                    unfinished = [(now - due[j]) * 1e3 for j in waiting]
                    break
        if stopped:  # what the trial measured; the service answers the rest before the next
            kept = (list(latencies), dict(counts), last_done)
            _, left = await asyncio.wait(tasks, timeout=REQUEST_TIMEOUT_S)
            for task in left:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            latencies, counts, last_done = kept
        else:
            await asyncio.gather(*tasks)
    kinds: Dict[str, int] = {}
    for req in timed:
        kinds[req.kind] = kinds.get(req.kind, 0) + 1
    return dict(sent=n, served=counts["served"], dropped=counts["dropped"],
                latencies_ms=latencies, elapsed_s=last_done - start, send_lag_ms=lags,
                events=sum(r.item_ids.numel() for r in timed if r.kind == "extend"),
                kinds=kinds, errors=errors, stopped=stopped, unfinished_ms=unfinished,
                checks=checks, refused=refused[0])


def run_http_trial(args: argparse.Namespace, url: str, model: torch.nn.Module, *,
                   offset: int, stop_ms: Optional[float] = None, transport: Any = None,
                   connections: int = 64, log: Log = None) -> HttpResult:
    """One trial of ``args`` (its rate, requests, seed) through HTTP to the service at
    ``url`` (see the module docstring), its users numbered from ``offset``; the checked
    answers against ``model``'s full forward (the service's model: same weights).

    Args:
        stop_ms: stop once more requests are later than this than a p99 under it allows
            (as :func:`~tzrec_bench.benchmarks.load_test.run.run_load_test`).
        transport: an httpx transport (tests); default: TCP.
    """
    out = asyncio.run(_trial(args, url, offset, stop_ms, transport, connections, log))
    checks: List[Check] = out.pop("checks")
    tol, max_abs, worst = check_answers(model, checks, args, whole_history=True)
    return HttpResult(**out, calls=0, checks=sum(c.served is not None for c in checks),
                      max_abs_diff=max_abs, worst_ratio=worst, tolerance=tol, graph_stats={},
                      rate=args.rate, max_batch=args.max_batch, call_ms={})


def lag_line(result: HttpResult) -> str:
    """The client's send lag: p50, p99, max (ms)."""
    lags = result.send_lag_ms
    return (f"client send lag (sent - due): p50 {percentile(lags, 50):.2f} ms, p99 "
            f"{percentile(lags, 99):.2f} ms, max {max(lags, default=math.nan):.2f} ms")


def _print_trial(result: HttpResult, args: argparse.Namespace) -> None:
    """The detailed report of one trial through HTTP."""
    pct = result.percentiles()
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(result.kinds.items()))
    print(f"  requests: {result.served} answered of {result.sent} sent ({kinds}), "
          f"{result.dropped} dropped (failed or not answered)")
    print("  latency (answer - due): " + ", ".join(f"{k} {v:.2f} ms" for k, v in pct.items()))
    print(f"  throughput: {result.achieved:.1f} requests/s (target {args.rate:g})")
    verdict = "sustained" if result.sustains(args.p99_ms) else "not sustained"
    print(f"  {verdict}: p99 {pct['p99']:.2f} ms against the {args.p99_ms:g} ms bound, "
          f"{result.dropped} dropped")


def run_http_mode(args: argparse.Namespace, model: torch.nn.Module,
                  in_process: Dict[int, Optional[float]], several: bool, log: Log) -> int:
    """The HTTP mode after the in-process trials, once per ``--http-db``: the service
    started, the same trials (one rate, ``--rates`` or ``--search`` from the in-process
    sustained rate) through HTTP with the largest ``--max-batch``, the figures beside
    ``in_process`` (the in-process sustained rate, or achieved rate at one rate, by batch
    bound) and their ratio; then the answer check. Returns 0, or 1 when a request failed
    (other than a 503), no answer was checked or one is outside the tolerance."""
    results: List[HttpResult] = []
    for db in args.http_db:
        found = _one_service(args, model, in_process, several, log, db)
        if found is None:
            return 1
        results.extend(found)
    return _verdict(args, results)


def _one_service(args: argparse.Namespace, model: torch.nn.Module,
                 in_process: Dict[int, Optional[float]], several: bool, log: Log,
                 db: str) -> Optional[List[HttpResult]]:
    """:func:`run_http_mode`'s trials on one service over the database ``db`` (``temp``:
    a new file in a temporary folder); None when its model is not the in-process one."""
    import copy
    import itertools
    import os
    import shutil
    import tempfile

    from tzrec_bench.benchmarks.load_test.model import weights_digest
    from tzrec_bench.benchmarks.load_test.search import (
        search_rates,
        sustained,
        sweep_rates,
        table,
    )

    max_batch = max(args.max_batches)
    folder = None
    if db == "temp":
        folder = tempfile.mkdtemp(prefix="tzrec-load-test-")
        db = os.path.join(folder, "events.sqlite")
    label = f"HTTP ({'no database file' if db == ':memory:' else 'events on disk'})"
    print(f"  {label}: the service in its own process (max batch {max_batch}, max wait "
          f"{args.max_wait_ms:g} ms, queue {args.queue}, database {db}), "
          f"{args.connections} client connections (httpx)", flush=True)
    trial_no = itertools.count()
    results: List[HttpResult] = []

    def run(trial: argparse.Namespace, stop_ms: Optional[float]) -> HttpResult:
        result = run_http_trial(trial, service.url, model, offset=next(trial_no) * args.users,
                                stop_ms=stop_ms, connections=args.connections,
                                log=None if several else log)
        results.append(result)
        return result

    service = start_service(args, max_batch, db, log)
    try:
        if service.info()["model_fingerprint"] != weights_digest(model):
            print("load_test: FAILED: the service's model has other weights than the "
                  "in-process one", file=sys.stderr)
            return None
        if several:
            http_args = copy.copy(args)
            http_args.rate = in_process.get(max_batch) or args.rate
            log(f"  {label}, max batch {max_batch}: trials")
            log("  " + table([], args.p99_ms)[0])
            if args.search:
                search_rates(http_args, None, max_batch, args.p99_ms, log, run=run)
            else:
                sweep_rates(args, None, max_batch, args.rates, args.p99_ms, log, run=run)
            print(f"  {label}, max batch {max_batch}, by rate:")
            for line in table(results, args.p99_ms):
                print("  " + line)
            http_rate = sustained(results, args.p99_ms)
            shown = min(results, key=lambda t: t.rate) if http_rate is None else next(
                t for t in results if t.rate == http_rate)
            print(f"  at {shown.rate:,.0f}/s: {lag_line(shown)}")
        else:
            trial = copy.copy(args)
            trial.max_batch = max_batch
            print(f"  {label}, max batch {max_batch}:", flush=True)
            shown = run(trial, None)
            _print_trial(shown, trial)
            print(f"  {lag_line(shown)}")
            http_rate = shown.achieved
        print(f"  service batches: {service.mean_batch():.2f} requests per call on average")
    finally:
        service.stop()
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
    _ratio_line(args, label, in_process.get(max_batch), http_rate, max_batch, several)
    return results


def _ratio_line(args: argparse.Namespace, label: str, in_process: Optional[float],
                http_rate: Optional[float], max_batch: int, several: bool) -> None:
    what = (f"sustained (p99 < {args.p99_ms:g} ms, nothing dropped)" if several
            else f"achieved at {args.rate:g}/s offered (--search measures the sustained "
            "rates the target is about)")
    if not in_process or not http_rate or math.isnan(http_rate):
        print(f"  {label} / in-process, max batch {max_batch}: no ratio ({http_rate or 'no'} "
              f"against {in_process or 'no'} requests/s {what})")
        return
    ratio = http_rate / in_process
    target = ("met" if 1 - ratio <= 0.2 else "not met") if args.device.type == "cuda" else \
        "applies on a GPU"
    cost = (f"{label} costs {100 * (1 - ratio):.1f}% of the in-process rate "
            f"(target <= 20%: {target})" if ratio <= 1 else "no cost measured: the trials "
            "through HTTP served more (the machine's load differed between the two)")
    print(f"  {label} / in-process, max batch {max_batch}: {http_rate:,.1f} / {in_process:,.1f} "
          f"requests/s {what} = {ratio:.3f}: {cost}", flush=True)


def _verdict(args: argparse.Namespace, results: List[HttpResult]) -> int:
    checks = sum(r.checks for r in results)
    worst = max((r.worst_ratio for r in results), default=0.0)
    max_abs = max((r.max_abs_diff for r in results), default=0.0)
    print(f"  HTTP answers: {checks} scoring requests against the full forward (a top-k "
          f"leaves out every item of the user's history), max |served - full| "
          f"{max_abs:.3g}, worst {worst:.3g} of the {args.dtype} tolerance")
    errors = [e for r in results for e in r.errors]
    refused = sum(r.refused for r in results)
    if refused:
        print(f"  through HTTP {refused} requests were answered 503 (the service's queue "
              "full: counted as dropped in their trials)")
    status = 0
    if errors:
        dropped = sum(r.dropped for r in results)
        print(f"load_test: FAILED: through HTTP {len(errors)} requests failed ({dropped} of "
              "them timed: dropped)", file=sys.stderr)
        for error in errors[:3]:
            print(f"  {error}", file=sys.stderr)
        status = 1
    if checks == 0:
        print("load_test: FAILED: no answer through HTTP was checked", file=sys.stderr)
        status = 1
    elif worst > 1.0:
        print(f"load_test: FAILED: answers through HTTP differ from the full forward by "
              f"{worst:.3g}x the {args.dtype} tolerance", file=sys.stderr)
        status = 1
    return status
