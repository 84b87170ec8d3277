"""Load test of ``tzrec_gr.serving.ServingSession``: a stream of requests at a target rate,
and the sustained rate (the highest at which the p99 latency stays under a bound).

    python -m tzrec_bench.benchmarks.load_test      # CPU, tiny model, ~10-20 s
    python -m tzrec_bench.benchmarks.load_test --device cuda --max-batch 32,1 --search
    python -m tzrec_bench.benchmarks.load_test --device cuda --max-batch 32 --search --http

One session serves a stream of requests, open-loop: request i is due ``i / --rate`` seconds
after the start, whether or not the server has finished the ones before it, and its latency
is its completion time minus its due time, so a server that falls behind shows its queue in
the latency. The stream is drawn before the clock starts (``--seed``): each request names a
user drawn from a power law over ``--users`` users (probability of the r-th user
proportional to ``r ** -zipf``) and is either

* new events for that user (``--extend-fraction`` of the requests): ``session.extend``, the
  user's history grows (the session keeps the newest events the model takes);
* a scoring request: the call the model's server answers, ``session.score`` of
  ``--candidates`` random candidates (``--model hstu-ranking``) or ``session.recommend`` of
  the top ``--k`` items of the catalogue (``--model hstu-retrieval``).

``--model`` names a registered model that has a server (:mod:`tzrec_gr.models.registry`,
:func:`tzrec_gr.serving.server.server_for`), or a task, ``ranking`` (the default) or
``retrieval``, for that task's first such model; everything the load test needs to know of
the model (what a request carries, whether histories carry actions, whether times are
encoded) it asks of the model's server (:mod:`~tzrec_bench.benchmarks.load_test.model`).

Before the clock, the session's ``warm_up`` captures the CUDA graphs of every request shape
and runs the eager calls once per shape (Triton autotuning happens there), the users the
stream names are opened (``session.open``, a ``--history``-event starting history each) and
``--warmup`` requests are served. Requests are served one at a time with ``--max-batch 1``
(B = 1); with ``--max-batch M`` the server takes up to M requests that are already due and
serves them in as few calls as it can (one call per kind, each user at most once per call,
each user's requests in stream order), as a micro-batching server does. ``--max-batch
32,1`` measures both on one session. Whole histories (``open``, the re-encode after an
extend of a model that encodes time) are encoded from CUDA graphs on a GPU;
``--no-encode-graphs`` encodes them eagerly, for the same run without them.

One rate (``--rate``) prints the detailed report: p50/p90/p99/max latency (ms), the achieved
requests/s and events/s, requests served against sent, the session's CUDA graphs on a GPU
and the correctness check. ``--rates`` or ``--search`` run trials at several rates
(:mod:`~tzrec_bench.benchmarks.load_test.search`) and print a table per batch bound (offered and
achieved rate, p50, p99, dropped) and the sustained rate: the highest offered rate served
with nothing dropped and p99 under ``--p99-ms``.

Each trial also prints its stall report (:mod:`~tzrec_bench.benchmarks.load_test.stalls`;
``--no-stall-report`` leaves it out): the requests slower than ``--stall-ms`` (default the
p99 bound), the GC collections, graph captures, Triton kernels built or tuned and eager calls
outside the buckets that overlapped them, their wait against their own call's time, and the
allocator's retries and segments over the trial. Before each trial's clock the heap (the
stream, the session, its users) is collected and frozen out of the cyclic GC
(``gc.freeze``, as ``tzrec-bench serve`` does once loaded), so that a full collection in
the timed run walks only the objects made since; ``--no-gc-freeze`` leaves it in, for
measuring what that changes.

``--http`` then runs the same trials through HTTP against the service of ``tzrec-bench
serve`` in its own process (:mod:`~tzrec_bench.benchmarks.load_test.http`) and prints its
figures beside the in-process ones, with their ratio (the share of the in-process rate the
HTTP layer costs) and the same check of its answers.

The correctness check: every ``--check-every``-th scoring request is answered again, after
the timed run, by the model's full forward over the user's whole history at that moment
(kept on the host by the load test, apart from the session) and the served answer must
equal it within the dtype's forward tolerance (:func:`tzrec_ops.tolerances.tolerance`, the
one the tzrec tests hold the backends to). Exit 1 when a request is dropped (a session call
raised) or an answer is outside the tolerance, 2 on bad options. The model has random
weights (``--seed``): the check compares two ways of computing the same function, which
needs no training.
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import math
import platform
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from tzrec_bench.benchmarks.load_test.model import (
    DTYPES,
    Served,
    build_model,
    model_choices,
    probe,
    resolve_model,
)
from tzrec_bench.benchmarks.load_test.run import (
    LoadTestResult,
    call_class,
    percentile,
    run_load_test,
    size_span,
    warm_up,
)
from tzrec_bench.benchmarks.load_test.search import search_rates, sustained, sweep_rates, table
from tzrec_bench.benchmarks.load_test.stream import Check, Request, make_stream
from tzrec_gr.serving import ServingSession
from tzrec_ops.commandline import ArgumentParser
from tzrec_ops.devices import add_device_option

__all__ = [
    "CPU_DEFAULTS",
    "CUDA_DEFAULTS",
    "Check",
    "LoadTestResult",
    "Request",
    "Served",
    "build_model",
    "call_class",
    "main",
    "make_stream",
    "percentile",
    "run_load_test",
    "search_rates",
    "size_span",
    "sustained",
    "sweep_rates",
    "table",
    "warm_up",
]

#: defaults of the options left out, on the CPU (a tiny model, ~10-20 s) and on a GPU (the
#: serving benchmark's model: HSTURanking E=512, 4 heads, 3 layers, bf16)
CPU_DEFAULTS: Dict[str, Any] = {
    "dtype": "fp32", "dim": 32, "heads": 2, "layers": 2, "items": 1000, "users": 200,
    "history": 32, "max_history": 128, "candidates": 8, "rate": 40.0, "duration": 10.0,
}
CUDA_DEFAULTS: Dict[str, Any] = {
    "dtype": "bf16", "dim": 512, "heads": 4, "layers": 3, "items": 100_000, "users": 1000,
    "history": 1000, "max_history": 2048, "candidates": 8, "rate": 200.0, "duration": 20.0,
}


def _comma_list(kind: type, what: str) -> Callable[[str], List[Any]]:
    """An argparse type: values of ``kind`` separated by commas, with a clear error."""

    def parse(text: str) -> List[Any]:
        try:
            return [kind(v) for v in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {what} separated by commas, got {text!r}"
            ) from None

    return parse


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="python -m tzrec_bench.benchmarks.load_test", description=__doc__.split("\n")[0]
    )
    add_device_option(p, "cpu", "A GPU sets the defaults of the options left out to "
                      "CUDA_DEFAULTS, else CPU_DEFAULTS.")
    p.add_argument("--model", choices=model_choices(), default="ranking",
                   help="a registered model with a server, or a task (its first such model). "
                   "Default: ranking")
    p.add_argument("--dtype", choices=list(DTYPES), help="default: fp32 on CPU, bf16 on CUDA")
    p.add_argument("--backend", help="ops backend (default: the best available)")
    p.add_argument("--dim", type=int, help="E (CPU 32, CUDA 512)")
    p.add_argument("--heads", type=int, help="H (CPU 2, CUDA 4)")
    p.add_argument("--layers", type=int, help="STU layers (CPU 2, CUDA 3)")
    p.add_argument("--items", type=int, help="catalogue size (CPU 1,000, CUDA 100,000)")
    p.add_argument("--no-time-encoding", action="store_true",
                   help="a model without time encoding (where it has one): extend runs only "
                   "the new events")
    p.add_argument("--no-encode-graphs", action="store_true",
                   help="encode whole histories (open, re-encodes after extend) eagerly, not "
                   "from CUDA graphs (ServingSession(encode_graphs=False))")
    p.add_argument("--users", type=int, help="distinct users (CPU 200, CUDA 1,000)")
    p.add_argument("--zipf", type=float, default=1.1,
                   help="power-law exponent of the users' popularity. Default: 1.1")
    p.add_argument("--history", type=int, help="events of a user's starting history "
                   "(CPU 32, CUDA 1,000)")
    p.add_argument("--max-history", type=int, help="the most events the model takes; longer "
                   "histories keep their newest (CPU 128, CUDA 2,048)")
    p.add_argument("--events", type=int, default=4,
                   help="the most new events per extend request (1 to this). Default: 4")
    p.add_argument("--candidates", type=int, help="T candidates per scoring request of a "
                   "model that scores candidates (8)")
    p.add_argument("--k", type=int, default=10, help="top-K of a scoring request of a model "
                   "that ranks the catalogue. Default: 10")
    p.add_argument("--extend-fraction", type=float, default=0.5,
                   help="share of requests that are new events. Default: 0.5")
    p.add_argument("--rate", type=float, help="target requests/s (CPU 40, CUDA 200)")
    p.add_argument("--duration", type=float, help="seconds of requests per trial, at its "
                   "rate (CPU 10, CUDA 20)")
    p.add_argument("--requests", type=int, help="requests per trial (instead of --duration)")
    p.add_argument("--max-batch", type=_comma_list(int, "integers"), default=[1],
                   help="the most due requests served together; a comma list (32,1) measures "
                   "each on one session. Default: 1 (one at a time)")
    p.add_argument("--p99-ms", type=float, default=50.0,
                   help="the p99 latency bound of a sustained rate, ms. Default: 50")
    p.add_argument("--rates", type=_comma_list(float, "numbers"),
                   help="comma list of offered rates (requests/s), one trial each")
    p.add_argument("--search", action="store_true",
                   help="find the sustained rate: from --rate, double (halve) while trials "
                   "pass (fail), then bisect")
    p.add_argument("--max-rate", type=float, default=100_000.0,
                   help="the highest rate --search tries. Default: 100,000")
    p.add_argument("--search-precision", type=float, default=0.1,
                   help="--search stops when the lowest failing rate is within this fraction "
                   "above the highest passing one. Default: 0.1")
    p.add_argument("--max-trials", type=int, default=12,
                   help="the most trials of one --search. Default: 12")
    p.add_argument("--stall-ms", type=float,
                   help="report, per trial, the requests slower than this and what overlapped "
                   "them: GC collections, CUDA graph captures, Triton builds and autotuning, "
                   "eager calls outside the buckets, the allocator. Default: --p99-ms")
    p.add_argument("--no-stall-report", action="store_true",
                   help="leave the stall report out (it times every session call)")
    p.add_argument("--no-gc-freeze", action="store_true",
                   help="leave the heap in the cyclic GC's generations during the timed run "
                   "(by default it is frozen out of them before the clock, as tzrec-bench "
                   "serve does after loading; for measuring what that changes)")
    p.add_argument("--warmup", type=int, default=10,
                   help="requests served before the clock starts (untimed). Default: 10")
    p.add_argument("--check-every", type=int, default=50,
                   help="recompute every n-th scoring request with the full forward. "
                   "Default: 50")
    p.add_argument("--threads", type=int,
                   help="torch CPU threads (torch.set_num_threads). Default: torch's")
    p.add_argument("--seed", type=int, default=0)
    http = p.add_argument_group(
        "HTTP mode", "the same trials through HTTP to the service (tzrec_bench.service) "
        "in its own process, beside the in-process figures (needs tzrec-bench[serve] and "
        "httpx)")
    http.add_argument("--http", action="store_true",
                      help="also run the trials through HTTP and print the ratio of the "
                      "rates")
    http.add_argument("--connections", type=int, default=64,
                      help="the client's connection pool. Default: 64")
    http.add_argument("--max-wait-ms", type=float, default=2.0,
                      help="how long the service's batcher waits for more requests. "
                      "Default: 2")
    http.add_argument("--queue", type=int, default=1024,
                      help="requests the service queues before answering 503. "
                      "Default: 1024")
    http.add_argument("--http-db", metavar="DB", type=_comma_list(str, "databases"),
                      default=["temp"],
                      help="the service's SQLite database: temp (a new file in a temporary "
                      "folder), :memory: (none on disk: the HTTP layer alone) or a path; a "
                      "comma list runs the HTTP trials once per database. Default: temp")
    return p


def _resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the options left out from the device's defaults, check them all and resolve
    ``--model``: ``model_name`` (its registered name) and ``served`` (:class:`Served`, its
    server's facts)."""
    defaults = CUDA_DEFAULTS if args.device.type == "cuda" else CPU_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.fixed_requests = args.requests is not None
    if args.requests is None:
        args.requests = max(1, int(round(args.duration * args.rate)))
    if not args.duration > 0:
        raise ValueError(f"--duration must be > 0, got {args.duration}")
    if isinstance(args.max_batch, int):  # (a caller's namespace may hold one bound)
        args.max_batch = [args.max_batch]
    args.max_batches = list(dict.fromkeys(args.max_batch))
    for m in args.max_batches:
        if m < 1:
            raise ValueError(f"--max-batch must be >= 1, got {m}")
    args.max_batch = args.max_batches[0]
    args.open_batch = min(max(args.max_batches), 64)
    positive = ("dim", "heads", "layers", "items", "users", "history", "max_history", "events",
                "candidates", "k", "requests", "check_every", "max_trials")
    for name in positive:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.stall_ms is None:
        args.stall_ms = args.p99_ms
    args.stall_report = not args.no_stall_report
    args.gc_freeze = not args.no_gc_freeze
    for name in ("p99_ms", "max_rate", "search_precision", "stall_ms"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.rates is not None and args.search:
        raise ValueError("--rates and --search exclude each other; give one")
    for r in args.rates or []:
        if not r > 0:
            raise ValueError(f"--rates must be > 0, got {r:g}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    for name in ("connections", "queue"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if not args.max_wait_ms >= 0:
        raise ValueError(f"--max-wait-ms must be >= 0, got {args.max_wait_ms}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    if not args.rate > 0:
        raise ValueError(f"--rate must be > 0, got {args.rate}")
    if not 0 <= args.extend_fraction <= 1:
        raise ValueError(f"--extend-fraction must be in [0, 1], got {args.extend_fraction}")
    if args.zipf < 0:
        raise ValueError(f"--zipf must be >= 0, got {args.zipf}")
    if args.dim % args.heads:
        raise ValueError(f"--dim ({args.dim}) must be a multiple of --heads ({args.heads})")
    if args.history > args.max_history:
        raise ValueError(
            f"--history ({args.history}) must be at most --max-history ({args.max_history})"
        )
    if args.http:
        from tzrec_bench.service import require_http
        from tzrec_ops.extras import require

        try:
            require_http()
            require("httpx", "tzrec-bench[test]", "the load test's --http")
        except ImportError as exc:
            raise ValueError(f"--http: {exc}") from None
    args.model_name = resolve_model(args.model)
    args.served = probe(args)
    if args.served.takes_k and args.k > args.items:
        raise ValueError(f"--k ({args.k}) must be at most --items ({args.items})")
    return args


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _graph_line(stats: Dict[str, Any]) -> str:
    if not stats.get("enabled"):
        return "off"
    graphs = stats.get("graphs", [])
    capture_ms = sum(g.get("capture_ms", 0.0) for g in graphs)
    memory = sum(g.get("memory_bytes", 0) for g in graphs) / 2**20
    return (f"{stats['captures']} captured ({capture_ms:.1f} ms, {memory:.1f} MiB), "
            f"{stats['replays']} replays, {stats['eager_calls']} eager calls, "
            f"{len(stats.get('failed', {}))} failed")


def _versions(device: torch.device) -> str:
    """torch, triton (and CUDA) and the tzrec packages' versions, for the header."""
    parts = [f"torch {torch.__version__}"]
    try:
        import triton

        parts.append(f"triton {triton.__version__}")
    except ImportError:
        parts.append("triton not installed")
    if device.type == "cuda":
        parts.append(f"CUDA {torch.version.cuda}")
    for dist in ("tzrec-ops", "tzrec-gr", "tzrec-bench"):
        try:
            parts.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            parts.append(f"{dist} (source tree)")
    parts.append(f"Python {platform.python_version()}")
    return ", ".join(parts)


def _call_line(result: LoadTestResult) -> str:
    """The trial's session calls by class: count, mean and p99 duration."""
    return "session calls (count, mean / p99 ms): " + "; ".join(
        f"{name} {n}, {mean:.2f} / {p99:.2f}" for name, n, mean, p99 in result.call_times()
    )


def _report(args: argparse.Namespace, result: LoadTestResult, device: torch.device) -> None:
    """The detailed report of one trial."""
    pct = result.percentiles()
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(result.kinds.items()))
    print(f"  requests: {result.served} served of {result.sent} sent ({kinds}) in "
          f"{result.calls} session calls, {len(result.errors)} failed")
    print("  latency (completion - due): " + ", ".join(f"{k} {v:.2f} ms" for k, v in pct.items()))
    eps = result.events / result.elapsed_s if result.elapsed_s > 0 else math.nan
    print(f"  throughput: {result.achieved:.1f} requests/s (target {args.rate:g}), "
          f"{eps:.1f} events/s")
    print(f"  {_call_line(result)}")
    if result.stalls is not None:
        print(f"  {result.stalls.line()}")
    verdict = "sustained" if result.sustains(args.p99_ms) else "not sustained"
    print(f"  {verdict}: p99 {pct['p99']:.2f} ms against the {args.p99_ms:g} ms bound, "
          f"{result.dropped} dropped")
    if device.type == "cuda":
        stats = result.graph_stats
        encode = _graph_line(stats.get("encode", {}))
        print(f"  CUDA graphs: {_graph_line(stats)}; encode: {encode}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the load test; returns 0 when every request was served (none dropped) and every
    checked answer equals the full forward's within the tolerance, 1 otherwise, 2 on bad
    options. A rate that is not sustained is a measurement, not a failure."""
    parser = _parser()
    args = parser.parse_args(argv)
    device = args.device
    try:
        args = _resolve(args)
    except ValueError as exc:
        print(f"load_test: {exc}", file=sys.stderr)
        return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    several = args.search or args.rates is not None
    served: Served = args.served
    name = served.model_class
    what = (f"{args.candidates} candidates" if served.candidates else f"top-{args.k} of "
            f"{args.items:,} items")
    trial = (f"{args.requests:,} requests" if args.fixed_requests or not several
             else f"{args.duration:g} s of requests per trial")
    timed = "time encoding" if served.time_encoded else ""
    rates = ("--search from " + f"{args.rate:g}/s" if args.search else
             "rates " + ",".join(f"{r:g}" for r in args.rates) + "/s" if args.rates else
             f"{args.rate:g}/s")
    print(f"load_test: {name} E={args.dim}, {args.heads} heads, {args.layers} layers, "
          f"{args.dtype}{', ' + timed if timed else ''}, backend {args.backend or 'auto'}, "
          f"{device} ({_device_name(device)}), {_versions(device)}, "
          f"{torch.get_num_threads()} threads; {args.users:,} users "
          f"(zipf {args.zipf}), histories "
          f"{args.history} events (at most {args.max_history}), +1..{args.events} per extend, "
          f"{what}; {trial} at {rates}, extend fraction "
          f"{args.extend_fraction}, max batch {','.join(map(str, args.max_batches))}, "
          f"warm-up {args.warmup}, p99 bound {args.p99_ms:g} ms", flush=True)

    def log(line: str) -> None:
        print(line, flush=True)

    session = ServingSession(
        build_model(args), device=device, encode_graphs=not args.no_encode_graphs
    )
    report = warm_up(session, args, max(args.max_batches))
    encode = report["encode_graphs"]
    print(f"  warm-up before the clock: {len(report['captured'])} CUDA graphs captured "
          f"({report['capture_ms'] / 1e3:.1f} s) and {len(encode['captured'])} of the "
          f"encode ({encode['capture_ms'] / 1e3:.1f} s), {len(report['encoded'])} encodings and "
          f"{len(report['extended'])} extends run ({report['encode_seconds']:.1f} s), "
          f"{report['seconds']:.1f} s in all"
          + (f"; {report['reason']}" if report["reason"] else ""), flush=True)
    results: List[LoadTestResult] = []
    in_process: Dict[int, Optional[float]] = {}  # the rate of each bound, for --http
    for max_batch in args.max_batches:
        if several:
            print(f"  max batch {max_batch}: trials of {trial}")
            log("  " + table([], args.p99_ms)[0])
            if args.search:
                trials = search_rates(args, session, max_batch, args.p99_ms, log)
            else:
                trials = sweep_rates(args, session, max_batch, args.rates, args.p99_ms, log)
            print(f"  max batch {max_batch}, by rate:")
            for line in table(trials, args.p99_ms):
                print("  " + line)
            best = sustained(trials, args.p99_ms)
            failing = [t.rate for t in trials if not t.sustains(args.p99_ms)
                       and (best is None or t.rate > best)]
            above = f", {min(failing):,.0f}/s is not" if failing else ""
            if best is None:
                print(f"  sustained rate, max batch {max_batch}: none of the "
                      f"{len(trials)} rates tried (p99 < {args.p99_ms:g} ms, nothing "
                      f"dropped; the lowest was {min(t.rate for t in trials):,.0f}/s)")
            else:
                print(f"  sustained rate, max batch {max_batch}: {best:,.0f} requests/s "
                      f"(p99 < {args.p99_ms:g} ms, nothing dropped; {len(trials)} trials"
                      f"{above})", flush=True)
            shown = min(trials, key=lambda t: t.rate) if best is None else next(
                t for t in trials if t.rate == best)
            print(f"  at {shown.rate:,.0f}/s, {_call_line(shown)}")
            results.extend(trials)
            in_process[max_batch] = best
        else:
            trial = copy.copy(args)
            trial.max_batch = max_batch
            print(f"  max batch {max_batch}:", flush=True)
            result = run_load_test(trial, session, log=log)
            _report(trial, result, device)
            results.append(result)
            in_process[max_batch] = result.achieved
    if device.type == "cuda":
        stats = session.graph_stats()
        encode = _graph_line(stats.get("encode", {}))
        print(f"  CUDA graphs: {_graph_line(stats)}; encode: {encode}")
    checks = sum(r.checks for r in results)
    worst = max((r.worst_ratio for r in results), default=0.0)
    max_abs = max((r.max_abs_diff for r in results), default=0.0)
    tol = results[0].tolerance
    print(f"  correctness: {checks} scoring requests against the full forward, max "
          f"|served - full| {max_abs:.3g}, worst {worst:.3g} of the "
          f"{args.dtype} tolerance (|d| <= {tol.atol:g} * max|full| + {tol.rtol:g} * |full|)")
    status = 0
    errors = [e for r in results for e in r.errors]
    dropped = sum(r.dropped for r in results)
    if errors:
        print(f"load_test: FAILED: {dropped} requests dropped ({len(errors)} session calls "
              "raised)", file=sys.stderr)
        for error in errors[:3]:
            print(f"  {error}", file=sys.stderr)
        status = 1
    if checks == 0:
        print("load_test: FAILED: no scoring request was checked; lower --check-every or "
              "--extend-fraction, or send more --requests", file=sys.stderr)
        status = 1
    elif worst > 1.0:
        print(f"load_test: FAILED: served answers differ from the full forward by "
              f"{worst:.3g}x the {args.dtype} tolerance", file=sys.stderr)
        status = 1
    if args.http:
        from tzrec_bench.benchmarks.load_test.http import run_http_mode

        status = max(status, run_http_mode(args, session.model, in_process, several, log))
    return status
