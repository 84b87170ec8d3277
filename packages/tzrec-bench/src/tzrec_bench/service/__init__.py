"""``tzrec-bench serve``: recommendations by user id over HTTP (the ``serve`` extra).

An optional layer on top of serving (nothing below it imports it):

* :mod:`.store`: appended events in SQLite (WAL; group commits on a writer thread,
  committed before acknowledged);
* :mod:`.histories`: users' histories, the training log's then the appended events;
* :mod:`.batcher`: micro-batching of concurrent requests on one thread, bounded queue;
* :mod:`.engine`: batches of requests -> the serving session's calls;
* :mod:`.core`: loading a checkpoint, its log and the database (:func:`open_service`);
* :mod:`.app` and :mod:`.metrics`: the FastAPI routes and Prometheus metrics (need
  fastapi and prometheus-client: ``pip install 'tzrec-bench[serve]'``);
* :mod:`.command`: the ``serve`` subcommand (uvicorn).

The modules above the HTTP layer need only the standard library, torch and tzrec.
"""

__all__ = ["EXTRA", "require_http"]

#: what to install for the HTTP layer
EXTRA = "tzrec-bench[serve]"


def require_http() -> None:
    """ImportError naming the extra (and the first missing module) unless the HTTP layer's
    dependencies import."""
    from tzrec_ops.extras import require

    for module in ("fastapi", "uvicorn", "prometheus_client"):
        require(module, EXTRA, "tzrec-bench serve")
