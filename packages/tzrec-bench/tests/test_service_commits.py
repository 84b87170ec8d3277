"""The service's appends committed by the store's writer thread: concurrent appends share
commits, every acknowledged event is in the database after a restart in each user's order,
and a failed commit is undone (the next answer is the one before the events).

What is checked against what: the database's events == the events submitted, in each
user's order; ``/recommend`` after the restart == ``ServingSession`` given the log's events
then the appended ones (as in test_service.py).
"""

from __future__ import annotations

import re
import sqlite3
import threading
import time

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install 'tzrec-bench[serve]'")

from test_service import _expected, _history, _same  # noqa: E402

from tzrec_bench.service.engine import Events, Recommend  # noqa: E402
from tzrec_bench.service.store import StoreFailed  # noqa: E402

USERS = ["u1", "u4", "u7"]
POSTS = 6  # per user


def _slow_commits(store, seconds, monkeypatch):
    """Each commit takes ``seconds`` longer, so appends pile up behind it."""
    commit = store._commit

    def slow(rows):
        time.sleep(seconds)
        commit(rows)

    monkeypatch.setattr(store, "_commit", slow)


def test_concurrent_appends_share_commits_and_all_survive_a_restart_in_order(
        service_run, serve, tmp_path, monkeypatch):
    db = tmp_path / "events.sqlite"
    service, client = serve(service_run.run, service_run.log, db, max_batch=4, max_wait_ms=1)
    _slow_commits(service.engine.store, 0.05, monkeypatch)
    futures = {user: [] for user in USERS}

    def post(user):  # one client per user, each append sent before the last is acknowledged
        for n in range(POSTS):
            futures[user].append(service.batcher.submit(
                Events(user, (f"i{(3 * n) % 30}", f"new-{user}-{n}"), (1_800_000_000 + n,) * 2)))

    threads = [threading.Thread(target=post, args=(user,)) for user in USERS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for user in USERS:
        assert [f.result(timeout=30)["stored"] for f in futures[user]] == [2] * POSTS
    text = client.get("/metrics").text
    commits = float(re.search(r"tzrec_commit_size_count (\S+)", text).group(1))
    assert float(re.search(r"tzrec_commit_size_sum (\S+)", text).group(1)) == 2 * POSTS * 3
    assert commits < POSTS * len(USERS), text  # grouped: fewer commits than appends
    before = client.get("/recommend", params={"user": "u4", "k": 6}).json()
    service.close()

    service, client = serve(service_run.run, service_run.log, db)
    stored = service.engine.store.by_user()
    for user in USERS:
        extra = [(item, 1_800_000_000 + n) for n in range(POSTS)
                 for item in (f"i{(3 * n) % 30}", f"new-{user}-{n}")]
        assert [(e.item, e.timestamp) for e in stored[user]] == extra
    assert client.get("/info").json()["stored_events"] == 2 * POSTS * len(USERS)
    after = client.get("/recommend", params={"user": "u4", "k": 6}).json()
    extra = [(f"i{(3 * n) % 30}", 1_800_000_000 + n) for n in range(POSTS)]
    _same(after, *_expected(service_run.run, *_history(service_run.rows, "u4", extra), 6))
    assert after["items"] == before["items"]


def test_a_failed_commit_is_undone_and_the_store_takes_no_more(service_run, serve,
                                                               monkeypatch):
    service, client = serve(service_run.run, service_run.log)
    store = service.engine.store
    first = service.batcher.submit(Recommend("u2", 5)).result(timeout=30)  # u2 now open

    def broken(rows):
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(store, "_commit", broken)
    appended = service.batcher.submit(Events("u2", ("i3", "i5"), (1_800_000_000,) * 2))
    with pytest.raises(sqlite3.OperationalError, match="disk I/O error"):
        appended.result(timeout=30)
    assert store.failed and store.count() == 0
    # the events are off u2's history and out of its cache: the answer before them
    again = service.batcher.submit(Recommend("u2", 5)).result(timeout=30)
    assert again["items"] == first["items"]
    assert again["scores"] == pytest.approx(first["scores"], abs=1e-6)
    _same(again, *_expected(service_run.run, *_history(service_run.rows, "u2"), 5))
    with pytest.raises(StoreFailed, match="a commit failed"):
        service.batcher.submit(Events("u3", ("i1",), (1_800_000_000,))).result(timeout=30)
    assert client.get("/readyz").status_code == 503
