"""The service the load test's HTTP mode measures, in its own process:
``python -m tzrec_bench.benchmarks.load_test.server OPTIONS_JSON``.

It builds the load test's model (the same options and seed, so the same weights: its
digest is ``/info``'s ``model_fingerprint``), warms the session up as the in-process run
does, and serves it with :mod:`tzrec_bench.service` (the app ``tzrec-bench serve`` runs,
over :func:`~tzrec_bench.service.core.assemble_service`) with uvicorn on a free local port.
The log is empty: the load test sends each user's starting history as ``POST /events``
before the clock. The first line it prints is the warm-up's report, the second
``PORT <n>``; it serves until terminated, or until its standard input closes (the load
test holds it open: a load test killed leaves no server behind).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import socket
import sys
import threading
from typing import Any, Dict, Optional, Sequence

import numpy as np
import torch

from tzrec_bench.benchmarks.load_test.model import build_model, weights_digest
from tzrec_bench.benchmarks.load_test.run import warm_up
from tzrec_bench.data import SequenceDataset

__all__ = ["OPTIONS", "empty_log", "main"]

#: the load test's options the service needs (besides ``db``, ``max_wait_ms``, ``queue``)
OPTIONS = ("model_name", "device", "dtype", "backend", "dim", "heads", "layers", "items",
           "max_history", "history", "events", "candidates", "k", "no_time_encoding", "seed",
           "users", "max_batch", "threads", "no_encode_graphs")


def empty_log(num_items: int, actions: bool) -> SequenceDataset:
    """A log of no user over the catalogue ``0..num_items-1`` (raw id = model row)."""
    none = np.zeros(0, dtype=np.int64)
    return SequenceDataset(
        name="load test", offsets=np.zeros(1, dtype=np.int64), item_ids=none,
        timestamps=none, num_items=num_items, item_raw_ids=np.arange(num_items, dtype=np.int64),
        user_raw_ids=none, actions=none if actions else None)


def _impl(fast: str, default: str) -> str:
    """What uvicorn's ``auto`` picks: ``fast`` when it is installed."""
    return fast if importlib.util.find_spec(fast) else default


def _stop_when_stdin_closes() -> None:
    """SIGTERM to this process (uvicorn shuts down on it) once stdin reaches its end."""
    def watch() -> None:
        sys.stdin.read()
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: Optional[Sequence[str]] = None) -> int:
    import uvicorn

    from tzrec_bench.service.app import create_app
    from tzrec_bench.service.core import assemble_service, freeze_heap
    from tzrec_gr.serving import ServingSession
    from tzrec_gr.vocabulary import IdVocabularies, Vocabulary

    argv = sys.argv[1:] if argv is None else argv
    options: Dict[str, Any] = json.loads(argv[0])
    args = argparse.Namespace(**options)
    args.device = torch.device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model = build_model(args)
    vocabularies = IdVocabularies(users=Vocabulary(np.zeros(0, dtype=np.int64)),
                                  items=Vocabulary.dense(args.items), source="load test")
    session = ServingSession(model, device=args.device, vocabularies=vocabularies,
                             encode_graphs=not args.no_encode_graphs)
    report = warm_up(session, args, args.max_batch)
    service = assemble_service(
        session, None, empty_log(args.items, bool(session.server.needs_actions)), args.db,
        source="the load test's events", max_batch=args.max_batch,
        max_wait_ms=args.max_wait_ms, max_queue=args.queue, max_cached_users=args.users)
    service.info["model_fingerprint"] = weights_digest(model)
    freeze_heap()  # as tzrec-bench serve does once loaded
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY on the accepted connections only for a
    # socket of that protocol (as uvicorn's own binding gets); without it Nagle's algorithm
    # and the client's delayed ACK hold each answer's second write ~40 ms
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    print(f"service warm-up: {len(report['captured'])} CUDA graphs captured, "
          f"{len(report['encoded']) + len(report['extended'])} eager shapes run in "
          f"{report['seconds']:.1f} s; uvicorn {uvicorn.__version__} ({_impl('httptools', 'h11')}"
          f" HTTP, {_impl('uvloop', 'asyncio')} loop), torch {torch.get_num_threads()} "
          "threads", flush=True)
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    _stop_when_stdin_closes()
    config = uvicorn.Config(create_app(service), log_level="warning", access_log=False,
                            backlog=4096)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        service.engine.store.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
