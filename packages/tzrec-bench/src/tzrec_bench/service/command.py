"""``tzrec-bench serve``: a trained model's recommendations by user id over HTTP.

::

    tzrec-bench serve runs/hstu --data events.csv --port 8000
    curl 'http://127.0.0.1:8000/recommend?user=17&k=10'

Exit status: 2 for a bad option, a missing ``serve`` extra, a damaged checkpoint, a model
the service cannot answer by user id, or a database made for other data; 1 for a missing
checkpoint or a missing or malformed event log (by ``tzrec-bench``'s main); 0 when the
server stops.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Dict

__all__ = ["DEFAULT_DB", "add_parser", "run", "service_options"]

#: the database's file name beside the checkpoint, without --db
DEFAULT_DB = "service-events.sqlite"


def add_parser(subparsers: argparse._SubParsersAction, formatter: type) -> argparse.ArgumentParser:
    """The ``serve`` subcommand's parser."""
    p = subparsers.add_parser(
        "serve",
        help="serve a trained model's recommendations by user id over HTTP (the serve extra)",
        description=(
            "Serve a model trained by `tzrec-bench train` over HTTP: GET /recommend?user=ID"
            "&k=10 (models whose predictions are the top k), POST /score {user, candidates} "
            "(models that score candidates), POST /events {user, items, timestamps?} (kept "
            "in a SQLite database, committed before the answer), /healthz, /readyz, /info, "
            "/metrics (Prometheus) and the OpenAPI docs at /docs. Users' histories are the "
            "event log's (read as training read it) plus the stored events; ids are the "
            "log's raw ids. Needs: pip install 'tzrec-bench[serve]'."
        ),
        epilog=(
            "examples:\n"
            "  tzrec-bench serve runs/hstu --data events.csv --port 8000\n"
            "  curl 'http://127.0.0.1:8000/recommend?user=17&k=10'\n"
            "  curl -X POST http://127.0.0.1:8000/events -H 'content-type: application/json' "
            "-d '{\"user\": 17, \"items\": [3, 5]}'"
        ),
        formatter_class=formatter,
    )
    p.add_argument("checkpoint", metavar="RUN_OR_CHECKPOINT",
                   help="a run's --out-dir (its best.pt, else checkpoint.pt) or a .pt file")
    p.add_argument("--data", metavar="LOG",
                   help="the event log of the users' histories, read with the run's "
                   "--columns and --min-events (default: the run's --data)")
    p.add_argument("--db", metavar="PATH",
                   help=f"the SQLite database of appended events (default: {DEFAULT_DB} "
                   "beside the checkpoint)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--max-batch", type=int, default=32,
                   help="most requests per call of the model")
    p.add_argument("--max-wait-ms", type=float, default=2.0,
                   help="how long a request waits for others to batch with")
    p.add_argument("--queue", type=int, default=1024,
                   help="most requests waiting; more are answered 503 with Retry-After")
    p.add_argument("--max-cached-users", type=int, default=100_000,
                   help="users whose encoded histories stay in memory (least recently "
                   "used dropped, encoded again when asked for)")
    p.add_argument("--max-pending", metavar="N", type=int, default=4096,
                   help="appended events (POST /events) waiting for the database's writer; "
                   "more are answered 503 with Retry-After")
    p.add_argument("--no-encode-graphs", action="store_true",
                   help="encode whole histories (a user's first request, re-encodes after new "
                   "events) eagerly instead of from CUDA graphs on a GPU")
    p.add_argument("--no-warm-up", action="store_true",
                   help="start listening without capturing the CUDA graphs of every batch "
                   "size first (the first request of each size then waits for its capture)")
    p.add_argument("--device", default="cpu",
                   help="where the model runs: cpu, cuda, cuda:1... or auto")
    p.add_argument("--backend", metavar="NAME",
                   help="tzrec-ops backend to serve with (default: the one saved)")
    return p


def _fail(parser: argparse.ArgumentParser, message: str) -> int:
    print(f"{parser.prog}: error: {message}", file=sys.stderr)
    return 2


def _check(args: argparse.Namespace) -> None:
    """ValueError naming the first bad option."""
    if not 1 <= args.port <= 65535:
        raise ValueError(f"--port must be in [1, 65535], got {args.port}")
    for option, value in (("--max-batch", args.max_batch), ("--queue", args.queue),
                          ("--max-cached-users", args.max_cached_users),
                          ("--max-pending", args.max_pending)):
        if value < 1:
            raise ValueError(f"{option} must be >= 1, got {value}")
    if not args.max_wait_ms >= 0:
        raise ValueError(f"--max-wait-ms must be >= 0, got {args.max_wait_ms}")


def service_options(args: argparse.Namespace) -> Dict[str, Any]:
    """:func:`~tzrec_bench.service.core.open_service`'s options from the checked ``args``."""
    return dict(backend=args.backend, max_batch=args.max_batch, max_wait_ms=args.max_wait_ms,
                max_queue=args.queue, max_cached_users=args.max_cached_users,
                encode_graphs=not args.no_encode_graphs, max_pending=args.max_pending)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Runs ``serve`` until the server stops; returns the exit status."""
    from tzrec_bench.service import require_http
    from tzrec_gr.checkpoint import resolve_checkpoint
    from tzrec_gr.serving.files import PredictError, pick_device

    try:
        _check(args)
        require_http()
        device = pick_device(args.device)
    except (ValueError, ImportError, PredictError) as exc:
        return _fail(parser, str(exc))
    import uvicorn

    from tzrec_bench.service.app import create_app
    from tzrec_bench.service.core import ServiceError, freeze_heap, open_service
    from tzrec_bench.service.store import StoreMismatch

    db = args.db or str(Path(resolve_checkpoint(args.checkpoint)).parent / DEFAULT_DB)
    try:
        service = open_service(args.checkpoint, args.data, db, device=device,
                               **service_options(args))
    except (ServiceError, StoreMismatch) as exc:
        return _fail(parser, str(exc))
    for note in service.notes:
        print(f"{parser.prog}: note: {note}", file=sys.stderr)
    info: Any = service.info
    print(f"{parser.prog}: {info['model']} ({info['task']}) from {info['checkpoint']}, "
          f"users of {info['data']}, events in {db}; http://{args.host}:{args.port} "
          "(docs at /docs)", flush=True)
    if not args.no_warm_up:
        report = service.warm_up()
        print(f"{parser.prog}: warm-up: {len(report['captured'])} CUDA graph(s) captured in "
              f"{report['seconds']:.1f} s" + (f" ({report['reason']})" if report["reason"] else ""),
              flush=True)
    freeze_heap()  # what is loaded now stays: full GC collections while serving skip it
    try:
        uvicorn.run(create_app(service), host=args.host, port=args.port, log_level="warning")
    finally:
        service.engine.store.close()
    return 0
