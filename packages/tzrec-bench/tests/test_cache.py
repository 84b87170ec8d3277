"""tzrec_bench.data.cache: concurrent loads of one log, the build lock, a build killed half-way,
entries keyed on the files' bytes."""

from __future__ import annotations

import json
import os
import pathlib
import select
import signal
import subprocess
import sys
import time
from typing import Dict, List

import pytest
from filelock import FileLock

import tzrec_bench.data.cache as cache_module
import tzrec_bench.data.load as load_module
from tzrec_bench.data import load_dataset

# One worker process: says it is ready once imported, then loads the log once per line read
# from stdin and answers one JSON line with what it got and whether it parsed the log itself.
# It keeps every data set it loaded and checks, each round, that the earlier ones (entries
# since removed as stale) still read as they did: they are memory-mapped.
WORKER = r"""
import json, sys
import tzrec_bench.data.load as load

log, cache = sys.argv[1], sys.argv[2]
builds, parse = [], load.write_event_log
load.write_event_log = lambda *args: (builds.append(1), parse(*args))[1]
held = []
print("{}", flush=True)
while sys.stdin.readline():
    builds.clear()
    try:
        ds = load.load_dataset(log, cache_dir=cache)
        got = {"fingerprint": ds.fingerprint, "offsets": ds.offsets.tolist(),
               "item_ids": ds.item_ids.tolist(), "items": ds.item_raw_ids.tolist(),
               "builds": len(builds)}
        for old, seen in held:
            if old.item_ids.tolist() != seen:
                raise AssertionError("an earlier entry's mapped arrays changed")
        held.append((ds, got["item_ids"]))
    except Exception as exc:
        got = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(got), flush=True)
"""
WORKERS = 6
ROUNDS = 5
HEADER = "user_id,item_id,timestamp\n"


def _write_log(path: pathlib.Path, round_: int) -> None:
    """A small CSV log that differs in every round (so every round builds a new entry and the
    previous one becomes stale)."""
    rows = [(f"u{u}", f"i{(u * 7 + k * round_) % 11}", k) for u in range(8) for k in range(4)]
    rows += [(f"u{round_}", f"new{round_}", 99)]
    path.write_text(HEADER + "".join(f"{u},{i},{t}\n" for u, i, t in rows))


def _answer(proc: subprocess.Popen, deadline: float) -> Dict[str, object]:
    ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
    if not ready:
        return {"error": "no answer in time (a worker hangs)"}
    line = proc.stdout.readline()
    return json.loads(line) if line else {"error": f"worker exited with {proc.wait()}"}


def _env() -> Dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


def test_concurrent_loads_of_a_new_log_all_succeed_with_the_same_entry(tmp_path):
    log, cache = tmp_path / "log.csv", tmp_path / "cache"
    procs: List[subprocess.Popen] = []
    try:
        for n in range(WORKERS):
            with open(tmp_path / f"worker{n}.err", "w") as err:
                procs.append(subprocess.Popen(
                    [sys.executable, "-c", WORKER, str(log), str(cache)], env=_env(),
                    text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                ))
        deadline = time.monotonic() + 120  # each imports torch
        assert [_answer(proc, deadline) for proc in procs] == [{}] * WORKERS
        for round_ in range(ROUNDS):
            _write_log(log, round_)
            for proc in procs:  # every worker is blocked on stdin: they start together
                proc.stdin.write("go\n")
                proc.stdin.flush()
            deadline = time.monotonic() + 60
            answers = [_answer(proc, deadline) for proc in procs]
            errors = [a["error"] for a in answers if "error" in a]
            assert not errors, f"round {round_}: {len(errors)} of {WORKERS} failed: {errors}"
            # one process parsed the log; the others waited for its entry and mapped it
            assert sum(a["builds"] for a in answers) == 1, [a["builds"] for a in answers]
            expected = load_dataset(str(log), cache_dir=cache)
            assert expected.num_events == 33
            for answer in answers:
                assert answer["fingerprint"] == expected.fingerprint
                assert answer["item_ids"] == expected.item_ids.tolist()
                assert answer["offsets"] == expected.offsets.tolist()
                assert answer["items"] == expected.item_raw_ids.tolist()
        entries = [p.name for p in cache.iterdir() if p.is_dir()]
        assert len(entries) == 1, entries  # the stale entries of earlier rounds are gone
    finally:
        for proc in procs:
            proc.stdin.close()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture
def parses(monkeypatch) -> List[int]:
    """Counts the event log parses of this process (each appends 1)."""
    calls: List[int] = []
    parse = load_module.write_event_log

    def spy(*args):
        calls.append(1)
        return parse(*args)

    monkeypatch.setattr(load_module, "write_event_log", spy)
    return calls


# killed half-way through a build, holding the lock, with a partial entry written
KILLED = r"""
import os, signal, sys
import tzrec_bench.data.load as load

def build(folder, *args):
    (folder / "item_ids.npy").write_bytes(b"half")
    (folder / "meta.json").write_text("{}")
    os.kill(os.getpid(), signal.SIGKILL)

load.write_event_log = build
load.load_dataset(sys.argv[1], cache_dir=sys.argv[2])
"""


def test_a_build_killed_half_way_leaves_no_entry_and_no_lock(tmp_path, monkeypatch, parses):
    log, cache = tmp_path / "log.csv", tmp_path / "cache"
    _write_log(log, 0)
    killed = subprocess.run([sys.executable, "-c", KILLED, str(log), str(cache)], env=_env())
    assert killed.returncode == -signal.SIGKILL
    (left,) = [p for p in cache.iterdir() if p.is_dir()]
    assert left.name.endswith(".tmp")  # its temporary folder, never read as an entry
    # the OS released the dead process's lock: this load need not wait for it
    monkeypatch.setattr(cache_module, "LOCK_TIMEOUT", 5.0, raising=False)
    ds = load_dataset(str(log), cache_dir=cache)
    assert ds.num_events == 33 and len(parses) == 1
    (entry,) = [p for p in cache.iterdir() if p.is_dir()]
    assert not entry.name.endswith(".tmp")  # the leftover was removed by the build


def test_a_held_lock_is_waited_for_then_named_with_how_to_clear_it(tmp_path, monkeypatch,
                                                                    capsys):
    log, cache = tmp_path / "log.csv", tmp_path / "cache"
    _write_log(log, 0)
    load_dataset(str(log), cache_dir=cache)
    (lock_file,) = cache.glob("*.lock")
    _write_log(log, 1)  # a new entry to build
    monkeypatch.setattr(cache_module, "LOCK_TIMEOUT", 0.3)
    with FileLock(str(lock_file)):  # another process building
        with pytest.raises(TimeoutError) as error:
            load_dataset(str(log), cache_dir=cache)
    assert str(error.value) == (
        f"waited 0.3 s for the cache lock {lock_file}, held by another process building the "
        f"same entry: let it finish or stop it (if no process uses this cache folder, delete "
        f"{lock_file})"
    )
    assert f"waiting for {lock_file}: another process is building" in capsys.readouterr().err
    assert load_dataset(str(log), cache_dir=cache).num_events == 33  # once it is released


def _same_size_edit(log: pathlib.Path) -> None:
    """Changes one item id for another of the same length, keeping the modification time."""
    stat = log.stat()
    text = log.read_text()
    log.write_text(text.replace("new0", "NEW0"))
    assert log.stat().st_size == stat.st_size
    os.utime(log, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_a_same_size_edit_that_keeps_the_mtime_is_read_again(tmp_path, parses):
    log, cache = tmp_path / "log.csv", tmp_path / "cache"
    _write_log(log, 0)
    assert "new0" in load_dataset(str(log), cache_dir=cache).item_raw_ids.tolist()
    _same_size_edit(log)
    items = load_dataset(str(log), cache_dir=cache).item_raw_ids.tolist()
    assert "NEW0" in items and "new0" not in items and len(parses) == 2
    os.utime(log)  # touched, not changed: the bytes decide
    load_dataset(str(log), cache_dir=cache)
    assert len(parses) == 2
    assert len([p for p in cache.iterdir() if p.is_dir()]) == 1  # the stale entry removed


def test_above_the_digest_limit_size_and_mtime_are_the_key(tmp_path, monkeypatch, parses):
    monkeypatch.setattr(cache_module, "DIGEST_LIMIT", 0)
    log, cache = tmp_path / "log.csv", tmp_path / "cache"
    _write_log(log, 0)
    load_dataset(str(log), cache_dir=cache)
    _same_size_edit(log)
    assert "new0" in load_dataset(str(log), cache_dir=cache).item_raw_ids.tolist()  # stale
    os.utime(log)
    assert "NEW0" in load_dataset(str(log), cache_dir=cache).item_raw_ids.tolist()
    assert len(parses) == 2


def test_entries_of_other_options_on_the_same_log_are_kept(tmp_path, parses):
    log, cache = tmp_path / "log.csv", tmp_path / "cache"
    _write_log(log, 0)
    everything = load_dataset(str(log), cache_dir=cache).num_events
    filtered = load_dataset(str(log), cache_dir=cache, min_events=2).num_events
    assert load_dataset(str(log), cache_dir=cache).num_events == everything != filtered
    assert len(parses) == 2  # two configurations on one log do not evict each other


def test_the_command_line_reports_a_lock_timeout_in_one_line(tmp_path, monkeypatch, capsys):
    from tzrec_bench.cli import main

    log, cache = tmp_path / "log.csv", tmp_path / "cache"
    _write_log(log, 0)
    load_dataset(str(log), cache_dir=cache)
    (lock_file,) = cache.glob("*.lock")
    _write_log(log, 1)
    monkeypatch.setattr(cache_module, "LOCK_TIMEOUT", 0.2)
    with FileLock(str(lock_file)):
        code = main(["train", "--data", str(log), "--cache-dir", str(cache),
                     "--out-dir", str(tmp_path / "run"), "--max-steps", "1", "--device", "cpu"])
    assert code == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"tzrec-bench train: error: waited 0.2 s for the cache lock {lock_file}")
