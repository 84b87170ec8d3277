"""The service's parts that need no HTTP extra: the micro-batcher (batch bounds, order,
bounded queue), the SQLite store (committed appends, reopening, raw ids kept as given) and
the ``serve`` command's errors (a missing extra, bad options) as one line each."""

from __future__ import annotations

import sqlite3
import sys
import threading
import time
from pathlib import Path

import pytest

from tzrec_bench.cli import main
from tzrec_bench.service.batcher import Batcher, Overloaded, split_in_order
from tzrec_bench.service.store import EventStore, StoredEvent, StoreMismatch


def test_the_batcher_gathers_up_to_max_batch_in_arrival_order():
    seen = []
    release = threading.Event()

    def handler(requests):
        release.wait(5)
        seen.append(list(requests))
        return [r * 10 if r != 3 else ValueError("three") for r in requests]

    sizes = []
    batcher = Batcher(handler, max_batch=4, max_wait_s=0.05, max_queue=100,
                      on_batch=lambda n, s: sizes.append(n)).start()
    futures = [batcher.submit(i) for i in range(10)]
    release.set()
    assert [f.result(5) for f in futures if not f.exception(5)] == [
        i * 10 for i in range(10) if i != 3]
    assert str(futures[3].exception()) == "three"  # one request's error, not the batch's
    batcher.stop()
    assert [r for batch in seen for r in batch] == list(range(10))
    assert max(sizes) <= 4 and sum(sizes) == 10


def test_a_full_queue_refuses_and_a_failing_handler_fails_only_its_batch():
    block = threading.Event()
    calls = []

    def handler(requests):
        calls.append(requests)
        block.wait(5)
        if "boom" in requests:
            raise RuntimeError("handler failed")
        return requests

    batcher = Batcher(handler, max_batch=1, max_wait_s=0, max_queue=2).start()
    first = batcher.submit("boom")
    while not calls:  # the worker holds "boom"; the queue is empty again
        time.sleep(0.001)
    queued = [batcher.submit("a"), batcher.submit("b")]
    with pytest.raises(Overloaded, match="2 requests are waiting"):
        batcher.submit("c")
    block.set()
    with pytest.raises(RuntimeError, match="handler failed"):
        first.result(5)
    assert [f.result(5) for f in queued] == ["a", "b"]
    batcher.stop()
    assert not batcher.running
    with pytest.raises(RuntimeError, match="not started"):
        batcher.submit("d")


@pytest.mark.parametrize("bad", [{"max_batch": 0}, {"max_queue": 0}, {"max_wait_s": -1}])
def test_the_batcher_refuses_bad_bounds(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        Batcher(lambda r: r, **bad)


def test_runs_keep_each_users_order_and_never_hold_a_user_twice():
    requests = [("r", "a"), ("r", "b"), ("e", "a"), ("r", "a"), ("r", "c"), ("r", "c")]
    runs = split_in_order(requests, key=lambda r: r[0], user=lambda r: r[1])
    assert runs == [[0, 1], [2], [3, 4], [5]]


def test_the_store_commits_each_append_and_reads_back_after_reopening(tmp_path):
    db = tmp_path / "events.sqlite"
    store = EventStore(db, "fp")
    store.append([StoredEvent("u1", "i1", 5), StoredEvent(17, 3, 6, action=2)])
    # another connection sees them at once: committed, not held in a transaction
    other = sqlite3.connect(db)
    assert other.execute("SELECT COUNT(*) FROM events").fetchone()[0] == 2
    assert other.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    other.close()
    store.append([StoredEvent("17", "3", 7)])
    store.close()
    again = EventStore(db, "fp")
    assert list(again.events()) == [StoredEvent("u1", "i1", 5), StoredEvent(17, 3, 6, 2),
                                    StoredEvent("17", "3", 7)]  # 17 and "17" kept apart
    assert list(again.by_user()) == ["u1", 17, "17"] and again.count() == 3
    again.close()
    with pytest.raises(StoreMismatch, match="holds events for other data"):
        EventStore(db, "other")
    # the refusal closed its connection: WAL's side files go with the last one
    assert not Path(f"{db}-wal").exists() and not Path(f"{db}-shm").exists()


def test_a_failed_append_stores_none_of_its_events(tmp_path):
    store = EventStore(tmp_path / "e.sqlite")
    with pytest.raises(TypeError):
        store.append([StoredEvent("u", "i", 1), StoredEvent("u", object(), 2)])
    assert store.count() == 0
    with pytest.raises(FileNotFoundError, match="--db: no folder"):
        EventStore(tmp_path / "missing" / "e.sqlite")


def test_serve_without_the_extra_is_one_line_naming_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "fastapi", None)  # import fastapi raises ImportError
    assert main(["serve", str(tmp_path), "--port", "8000"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "fastapi" in err and "pip install 'tzrec-bench[serve]'" in err


@pytest.mark.parametrize("option,value", [("--port", "0"), ("--max-batch", "0"),
                                          ("--queue", "0"), ("--max-wait-ms", "-1"),
                                          ("--max-cached-users", "0"),
                                          ("--max-pending", "0")])
def test_serve_refuses_a_bad_option_by_name(tmp_path, capsys, option, value):
    assert main(["serve", str(tmp_path), option, value]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and option in err


def test_serve_names_a_missing_checkpoint_or_log(tmp_path, capsys):
    assert main(["serve", str(tmp_path / "nothing")]) == 1
    assert "RUN_OR_CHECKPOINT: no checkpoint at" in capsys.readouterr().err


def test_serve_options_reach_the_session_and_the_store(service_run, tmp_path, monkeypatch):
    import argparse

    from tzrec_bench.service import command
    from tzrec_bench.service.core import open_service
    from tzrec_gr import serving

    parser = argparse.ArgumentParser()
    command.add_parser(parser.add_subparsers(), argparse.HelpFormatter)
    default = command.service_options(parser.parse_args(["serve", "run"]))
    assert default["encode_graphs"] and default["max_pending"] == 4096
    options = command.service_options(parser.parse_args(
        ["serve", "run", "--no-encode-graphs", "--max-pending", "7"]))
    assert not options["encode_graphs"] and options["max_pending"] == 7
    made = []
    real = serving.ServingSession

    def session(*args, **kwargs):
        made.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(serving, "ServingSession", session)
    service = open_service(str(service_run.run), str(service_run.log),
                           str(tmp_path / "e.sqlite"), **options)
    try:
        assert [kw["encode_graphs"] for kw in made] == [False]
        assert service.engine.store.max_pending == 7
    finally:
        service.close()


def test_serve_warms_the_session_up_to_max_batch_before_listening(service_run, tmp_path,
                                                                   monkeypatch):
    from tzrec_bench.service.core import open_service

    service = open_service(str(service_run.run), str(service_run.log),
                           str(tmp_path / "e.sqlite"), max_batch=20)
    asked = []
    session = service.engine.session
    real = session.warm_up
    monkeypatch.setattr(session, "warm_up", lambda **kw: asked.append(kw) or real(**kw))
    try:
        report = service.warm_up()
        # every bucket below 20 users and the one that holds 20
        buckets = session.batch_buckets
        expected = [b for b in buckets if b < 20] + [min(b for b in buckets if b >= 20)]
        assert asked == [{"batch_sizes": expected}]
        assert report["captured"] == [] and "no CUDA graphs" in report["reason"]
    finally:
        service.close()
