"""Prometheus metrics of the service (``prometheus_client``), one registry per app.

Requests (count by endpoint and status, latency histograms), batches (size, handler
seconds), database commits (events per group commit, seconds), the queue's depth, and the
engine's counters read at each scrape: cache hits and misses (users opened again), unknown
items in appended events, popular-item fallbacks, stored events, open users and the
session's CUDA graph replays.
"""

from __future__ import annotations

from typing import Any, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["CONTENT_TYPE", "ServiceMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class _EngineCollector:
    """The engine's counters and the session's graph replays, read at each scrape."""

    def __init__(self, service: Any) -> None:
        self.service = service

    def collect(self) -> Iterator[Any]:
        engine = self.service.engine
        for name, what in (("cache_hits", "requests of users open in the session"),
                           ("cache_misses", "users encoded from their whole history"),
                           ("unknown_items", "appended events of items the model does not know"),
                           ("fallbacks", "answers of popular items (no model input)")):
            yield CounterMetricFamily(f"tzrec_{name}", what, value=engine.counters[name])
        yield CounterMetricFamily("tzrec_events_stored", "events appended and committed",
                                  value=engine.store.committed)
        yield GaugeMetricFamily("tzrec_open_users", "users open in the session",
                                value=len(engine.session))
        stats = engine.session.graph_stats()
        yield CounterMetricFamily("tzrec_graph_replays", "CUDA graph replays of the session",
                                  value=int(stats.get("replays", 0) or 0))


class ServiceMetrics:
    """The metrics of one service (``service``: its engine and batcher)."""

    def __init__(self, service: Any) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("tzrec_requests", "HTTP requests", ["endpoint", "status"],
                                registry=r)
        self.latency = Histogram("tzrec_request_seconds", "HTTP request latency",
                                 ["endpoint"], buckets=_LATENCY, registry=r)
        self.batch_size = Histogram("tzrec_batch_size", "requests per session batch",
                                    buckets=_SIZES, registry=r)
        self.batch_seconds = Histogram("tzrec_batch_seconds", "seconds per session batch",
                                       buckets=_LATENCY, registry=r)
        self.commit_size = Histogram("tzrec_commit_size", "events per database commit (a "
                                     "group of appends)", buckets=_SIZES, registry=r)
        self.commit_seconds = Histogram("tzrec_commit_seconds", "seconds per database commit",
                                        buckets=_LATENCY, registry=r)
        queue = Gauge("tzrec_queue_depth", "requests waiting for the session", registry=r)
        queue.set_function(lambda: service.batcher.depth)
        r.register(_EngineCollector(service))

    def on_batch(self, size: int, seconds: float) -> None:
        """The batcher's report of one batch."""
        self.batch_size.observe(size)
        self.batch_seconds.observe(seconds)

    def on_commit(self, events: int, seconds: float) -> None:
        """The store's report of one group commit (on its writer thread)."""
        self.commit_size.observe(events)
        self.commit_seconds.observe(seconds)

    def observe(self, endpoint: str, status: int, seconds: float) -> None:
        """One answered HTTP request."""
        self.requests.labels(endpoint, str(status)).inc()
        self.latency.labels(endpoint).observe(seconds)

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)
