"""Load test of ``tzrec_gr.serving.ServingSession``: a stream of requests at a target rate.

    python -m tzrec_bench.load_test                          # CPU, tiny model, ~10-20 s
    python -m tzrec_bench.load_test --device cuda --model ranking --max-batch 16

One session serves a stream of requests, open-loop: request i is due ``i / --rate`` seconds
after the start, whether or not the server has finished the ones before it, and its latency
is its completion time minus its due time, so a server that falls behind shows its queue in
the latency. The stream is drawn before the clock starts (``--seed``): each request names a
user drawn from a power law over ``--users`` users (probability of the r-th user
proportional to ``r ** -zipf``) and is either

* new events for that user (``--extend-fraction`` of the requests): ``session.extend``, the
  user's history grows (the session keeps the newest events the model takes);
* a scoring request: ``session.score`` of ``--candidates`` random candidates
  (``--model ranking``, HSTURanking) or ``session.recommend`` of the top ``--k`` items of the
  catalogue (``--model retrieval``, HSTURetrieval);

and a user's first request opens the user (``session.open``) with a ``--history``-event
starting history instead. Requests are served one at a time by default (B = 1); with
``--max-batch M`` the server takes up to M requests that are already due and serves them in
as few calls as it can (one call per kind, each user at most once per call, each user's
requests in stream order), as a micro-batching server does.

Reported: p50/p90/p99/max latency (ms), the achieved requests/s and events/s, requests
served against requests sent (all must be served: exit 1 otherwise), the session's CUDA
graphs on a GPU, and a correctness check: every ``--check-every``-th scoring request is
answered again, after the timed run, by the model's full forward over the user's whole
history at that moment (kept on the host by the load test, apart from the session) and the
served answer must equal it within the dtype's forward tolerance
(:func:`tzrec_ops.tolerances.tolerance`, the one the tzrec tests hold the backends to; exit 1
otherwise). The model has random weights (``--seed``): the check compares two ways of
computing the same function, which needs no training.
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
from typing import Any, Dict, Optional, Sequence

import torch

from tzrec_bench.load_test.run import (
    DTYPES,
    LoadTestResult,
    build_model,
    percentile,
    run_load_test,
)
from tzrec_bench.load_test.stream import Check, Request, make_stream

__all__ = [
    "CPU_DEFAULTS",
    "CUDA_DEFAULTS",
    "Check",
    "LoadTestResult",
    "Request",
    "build_model",
    "main",
    "make_stream",
    "percentile",
    "run_load_test",
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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tzrec_bench.load_test", description=__doc__.split("\n")[0]
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda. Default: cpu")
    p.add_argument("--model", choices=["ranking", "retrieval"], default="ranking")
    p.add_argument("--dtype", choices=list(DTYPES), help="default: fp32 on CPU, bf16 on CUDA")
    p.add_argument("--backend", help="ops backend (default: the best available)")
    p.add_argument("--dim", type=int, help="E (CPU 32, CUDA 512)")
    p.add_argument("--heads", type=int, help="H (CPU 2, CUDA 4)")
    p.add_argument("--layers", type=int, help="STU layers (CPU 2, CUDA 3)")
    p.add_argument("--items", type=int, help="catalogue size (CPU 1,000, CUDA 100,000)")
    p.add_argument("--no-time-encoding", action="store_true",
                   help="ranking without time encoding: extend runs only the new events")
    p.add_argument("--users", type=int, help="distinct users (CPU 200, CUDA 1,000)")
    p.add_argument("--zipf", type=float, default=1.1,
                   help="power-law exponent of the users' popularity. Default: 1.1")
    p.add_argument("--history", type=int, help="events of a user's starting history "
                   "(CPU 32, CUDA 1,000)")
    p.add_argument("--max-history", type=int, help="the most events the model takes; longer "
                   "histories keep their newest (CPU 128, CUDA 2,048)")
    p.add_argument("--events", type=int, default=4,
                   help="the most new events per extend request (1 to this). Default: 4")
    p.add_argument("--candidates", type=int, help="T candidates per ranking request (8)")
    p.add_argument("--k", type=int, default=10, help="top-K of a retrieval request. Default: 10")
    p.add_argument("--extend-fraction", type=float, default=0.5,
                   help="share of requests that are new events. Default: 0.5")
    p.add_argument("--rate", type=float, help="target requests/s (CPU 40, CUDA 200)")
    p.add_argument("--duration", type=float, help="seconds of requests at --rate (CPU 10, "
                   "CUDA 20)")
    p.add_argument("--requests", type=int, help="number of requests (instead of --duration)")
    p.add_argument("--max-batch", type=int, default=1,
                   help="the most due requests served together. Default: 1 (one at a time)")
    p.add_argument("--warmup", type=int, default=10,
                   help="requests served before the clock starts (untimed). Default: 10")
    p.add_argument("--check-every", type=int, default=50,
                   help="recompute every n-th scoring request with the full forward. "
                   "Default: 50")
    p.add_argument("--threads", type=int,
                   help="torch CPU threads (torch.set_num_threads). Default: torch's")
    p.add_argument("--seed", type=int, default=0)
    return p


def _resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the options left out from the device's defaults and check them all."""
    defaults = CUDA_DEFAULTS if torch.device(args.device).type == "cuda" else CPU_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.requests is None:
        args.requests = max(1, int(round(args.duration * args.rate)))
    positive = ("dim", "heads", "layers", "items", "users", "history", "max_history", "events",
                "candidates", "k", "requests", "max_batch", "check_every")
    for name in positive:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
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
    if args.model == "retrieval" and args.k > args.items:
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


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the load test; returns 0 when every request was served and every checked answer
    equals the full forward's within the tolerance, 1 otherwise, 2 on bad options."""
    parser = _parser()
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("load_test: no CUDA device; pass --device cpu", file=sys.stderr)
        return 2
    try:
        args = _resolve(args)
    except ValueError as exc:
        print(f"load_test: {exc}", file=sys.stderr)
        return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    name = "HSTURanking" if args.model == "ranking" else "HSTURetrieval"
    what = (f"{args.candidates} candidates" if args.model == "ranking" else f"top-{args.k} of "
            f"{args.items:,} items")
    print(f"load_test: {name} E={args.dim}, {args.heads} heads, {args.layers} layers, "
          f"{args.dtype}, backend {args.backend or 'auto'}, {device} ({_device_name(device)}), "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.users:,} users "
          f"(zipf {args.zipf}), histories "
          f"{args.history} events (at most {args.max_history}), +1..{args.events} per extend, "
          f"{what}; {args.requests:,} requests at {args.rate:g}/s, extend fraction "
          f"{args.extend_fraction}, max batch {args.max_batch}, warm-up {args.warmup}",
          flush=True)
    result = run_load_test(args, log=lambda line: print(line, flush=True))
    pct = result.percentiles()
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(result.kinds.items()))
    print(f"  requests: {result.served} served of {result.sent} sent ({kinds}) in "
          f"{result.calls} session calls, {len(result.errors)} failed")
    print("  latency (completion - due): " + ", ".join(f"{k} {v:.2f} ms" for k, v in pct.items()))
    rps = result.served / result.elapsed_s if result.elapsed_s > 0 else math.nan
    eps = result.events / result.elapsed_s if result.elapsed_s > 0 else math.nan
    print(f"  throughput: {rps:.1f} requests/s (target {args.rate:g}), {eps:.1f} events/s")
    if device.type == "cuda":
        print(f"  CUDA graphs: {_graph_line(result.graph_stats)}")
    tol = result.tolerance
    print(f"  correctness: {result.checks} scoring requests against the full forward, max "
          f"|served - full| {result.max_abs_diff:.3g}, worst {result.worst_ratio:.3g} of the "
          f"{args.dtype} tolerance (|d| <= {tol.atol:g} * max|full| + {tol.rtol:g} * |full|)")
    status = 0
    if result.served != result.sent:
        print(f"load_test: FAILED: {result.sent - result.served} requests dropped",
              file=sys.stderr)
        for error in result.errors[:3]:
            print(f"  {error}", file=sys.stderr)
        status = 1
    if result.checks == 0:
        print("load_test: FAILED: no scoring request was checked; lower --check-every or "
              "--extend-fraction, or send more --requests", file=sys.stderr)
        status = 1
    elif result.worst_ratio > 1.0:
        print(f"load_test: FAILED: served answers differ from the full forward by "
              f"{result.worst_ratio:.3g}x the {args.dtype} tolerance", file=sys.stderr)
        status = 1
    return status
