"""Fixtures shared by several test files: tiny models trained once per session."""

from __future__ import annotations

import csv
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tzrec_bench.train.config import TrainConfig
from tzrec_bench.train.loop import train

#: the service's tiny log: users u0..u11 with 10 events each over items i0..i29
SERVICE_USERS = [f"u{u}" for u in range(12)]


def _service_log(path: Path) -> list:
    gen = torch.Generator().manual_seed(0)
    rows = [[user, f"i{int(torch.randint(0, 30, (1,), generator=gen))}", 1_700_000_000 + 60 * t]
            for t in range(10) for user in SERVICE_USERS]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["user_id", "item_id", "timestamp"])
        writer.writerows(rows)
    return rows


@pytest.fixture(scope="session")
def service_run(tmp_path_factory):
    """An hstu-retrieval run trained 2 steps on a tiny CSV log (``log``, its ``rows``)."""
    root = tmp_path_factory.mktemp("service")
    log = root / "events.csv"
    rows = _service_log(log)
    train(TrainConfig(model="hstu-retrieval", data=str(log), cache_dir=str(root / "cache"),
                      max_steps=2, max_seq_len=16, embedding_dim=16, num_layers=1, num_heads=2,
                      num_negatives=8, batch_size=4, eval_batch_size=16, progress=False,
                      plot=False, out_dir=str(root / "run")))
    return SimpleNamespace(run=root / "run", log=log, rows=rows)


@pytest.fixture(scope="session")
def ranking_service_run(tmp_path_factory):
    """An hstu-ranking run trained 2 steps on tiny synthetic data (which has actions)."""
    root = tmp_path_factory.mktemp("ranking-service")
    train(TrainConfig(model="hstu-ranking", data="synthetic", synthetic_users=24,
                      synthetic_items=60, max_seq_len=16, embedding_dim=16, num_layers=1,
                      num_heads=2, num_candidates=4, batch_size=8, eval_batch_size=32,
                      max_steps=2, progress=False, plot=False, cache_dir=str(root / "cache"),
                      out_dir=str(root / "run")))
    return SimpleNamespace(run=root / "run")


class InProcessClient:
    """Requests to an app in this process (httpx's ASGI transport), one event loop a call."""

    def __init__(self, app) -> None:
        self.app = app

    async def _send(self, client, method: str, url: str, **kwargs):
        return await client.request(method, url, **kwargs)

    def request(self, method: str, url: str, **kwargs):
        return self.gather([(method, url, kwargs)])[0]

    def get(self, url: str, **kwargs):
        return self.request("GET", url, **kwargs)

    def post(self, url: str, **kwargs):
        return self.request("POST", url, **kwargs)

    def gather(self, calls):
        """Send ``(method, url, kwargs)`` calls concurrently; their responses, in order."""
        import asyncio

        import httpx

        async def run():
            transport = httpx.ASGITransport(app=self.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://service") as c:
                return await asyncio.gather(*(self._send(c, m, u, **k) for m, u, k in calls))

        return asyncio.run(run())


@pytest.fixture
def serve(tmp_path):
    """``serve(run, log, db=None, **options) -> (service, client)``: a started service over
    a checkpoint and its in-process client (the serve extra required); closed afterwards."""
    pytest.importorskip("fastapi", reason="needs the serve extra: pip install "
                        "'tzrec-bench[serve]'")
    pytest.importorskip("httpx", reason="needs httpx (tzrec-bench[test])")
    from tzrec_bench.service.app import create_app
    from tzrec_bench.service.core import open_service

    opened = []

    def start(run, log=None, db=None, **options):
        service = open_service(str(run), None if log is None else str(log),
                               str(db or tmp_path / "events.sqlite"), **options)
        opened.append(service)
        app = create_app(service)
        service.batcher.start()  # the ASGI transport runs no lifespan
        return service, InProcessClient(app)

    yield start
    for service in opened:
        service.close()
