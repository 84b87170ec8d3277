"""The load test's stall report: which requests were slower than the threshold and what
overlapped them (synthetic events; no GPU), and the heap frozen out of the GC for the timed
run."""

from __future__ import annotations

import gc
import sys
import types

import pytest
import torch

from tzrec_bench.benchmarks import load_test
from tzrec_bench.benchmarks.load_test import run, stalls
from tzrec_bench.benchmarks.load_test.stalls import Call, Collection, StallWatch, attribute

TINY = [
    "--device", "cpu", "--dim", "16", "--heads", "2", "--layers", "1", "--items", "50",
    "--users", "8", "--history", "6", "--max-history", "12", "--candidates", "4",
    "--requests", "12", "--rate", "2000", "--warmup", "2", "--check-every", "3",
]


def _args(*extra: str):
    return load_test._resolve(load_test._parser().parse_args([*TINY, *extra]))


def test_each_stall_gets_the_first_cause_that_overlapped_it():
    # seconds; six calls one after another, each request answered by one of them
    calls = [
        Call("score", 0.000, 0.060, captures=1),  # a capture: 60 ms
        Call("extend", 0.060, 0.062),
        Call("score", 0.100, 0.170, built=2),  # a Triton build
        Call("score", 0.230, 0.235, eager=1),  # a shape outside every bucket
        Call("score", 0.300, 0.302),  # fast, but a full GC ran before it
        Call("extend", 0.400, 0.440),  # slow on its own
        Call("score", 0.500, 0.510),  # fast: the rate is the problem
    ]
    collections = [Collection(0, 0.061, 0.0611), Collection(2, 0.210, 0.295)]
    requests = [
        (0.000, 0.000, 0.060),  # 60 ms: capture
        (0.055, 0.060, 0.062),  # 7 ms: no stall
        (0.090, 0.100, 0.170),  # 80 ms: compile
        (0.175, 0.230, 0.235),  # 60 ms: eager shape (the compile ended before it was due)
        (0.240, 0.300, 0.302),  # 62 ms, a gen-2 collection in its wait: gc2
        (0.380, 0.400, 0.440),  # 60 ms, 40 ms call: slow call
        (0.450, 0.500, 0.510),  # 60 ms, 10 ms call, nothing else: backlog
    ]
    report = attribute(requests, calls, collections, 50.0, {"retries": 0, "cudaMalloc": 3})
    assert report.requests == 7 and report.stalls == 6
    assert report.causes == {"capture": 1, "compile": 1, "eager shape": 1, "gc2": 1,
                             "slow call": 1, "backlog": 1}
    assert report.gc2 == 2 and report.gc_counts == {0: 1, 2: 1}  # the eager one too
    assert report.gc_max_ms[2] == pytest.approx(85.0)
    assert (report.captures, report.built, report.tuned, report.eager) == (1, 2, 0, 1)
    assert report.wait_ms == pytest.approx([0.0, 10.0, 55.0, 60.0, 20.0, 50.0])
    assert report.call_ms == pytest.approx([60.0, 70.0, 5.0, 2.0, 40.0, 10.0])
    assert report.longest_call is calls[2]
    line = report.line()
    for part in ("stalls > 50 ms: 6 of 7", "GC gen2 1 in the trial (max 85.0 ms), overlapping "
                 "2 stalls", "new captures 1, Triton kernels built 2", "longest call in their "
                 "windows 70.0 ms (score)", "causes: capture 1, compile 1, eager shape 1, gc2 1, "
                 "slow call 1, backlog 1", "allocator: +0 retries, +3 cudaMalloc"):
        assert part in line


def test_a_stall_sees_only_the_calls_and_collections_in_its_window():
    calls = [Call("score", 0.0, 0.5, captures=1), Call("score", 1.0, 1.01)]
    late = [(0.95, 1.0, 1.06)]  # due after the capture ended
    report = attribute(late, [*calls, Call("score", 1.01, 1.06)],
                       [Collection(2, 0.1, 0.2)], 50.0)
    assert report.stalls == 1 and report.causes == {"slow call": 1} and report.gc2 == 0
    assert attribute([(0.0, 0.0, 0.04)], calls, [], 50.0).stalls == 0
    quiet = attribute([], [], [], 50.0).line()
    assert "stalls > 50 ms: 0 of 0" in quiet and "causes" not in quiet and "allocator" not in quiet


class _Session:
    device = torch.device("cpu")

    def __init__(self):
        self.counts = (0, 0)

    def graph_counts(self):
        return self.counts


def test_the_watch_records_gc_graph_counters_and_triton_builds(monkeypatch):
    knobs = types.SimpleNamespace(runtime=types.SimpleNamespace(jit_post_compile_hook=None))
    earlier = []
    knobs.runtime.jit_post_compile_hook = lambda **kw: earlier.append(kw)
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(knobs=knobs))
    session = _Session()
    previous = knobs.runtime.jit_post_compile_hook

    def capture_and_build():
        session.counts = (1, 2)
        knobs.runtime.jit_post_compile_hook(key="k")
        gc.collect(1)
        return "answer"

    with StallWatch(session) as watch:
        assert knobs.runtime.jit_post_compile_hook is not previous
        out, began, done = watch.call("score", capture_and_build)
        watch.call("extend", lambda: None)
    assert knobs.runtime.jit_post_compile_hook is previous  # the earlier hook is back
    assert earlier == [{"key": "k"}]  # and was still called
    assert out == "answer" and began <= done
    first, second = watch.calls
    assert (first.kind, first.captures, first.eager, first.built) == ("score", 1, 2, 1)
    assert (second.captures, second.eager, second.built) == (0, 0, 0)
    assert any(c.generation == 1 and began <= c.start <= c.end <= done
               for c in watch.collections)
    assert watch.allocator == {}  # CPU: no allocator counters
    assert watch._on_gc not in gc.callbacks


def test_a_trial_reports_its_stalls_and_freezes_the_heap_only_while_timed(monkeypatch):
    frozen = []
    real = run._serve

    def serve(session, kind, group, k, served):
        frozen.append(gc.get_freeze_count() > 0)
        return real(session, kind, group, k, served)

    monkeypatch.setattr(run, "_serve", serve)
    result = load_test.run_load_test(_args("--stall-ms", "1e-6"))
    assert result.gc_frozen and gc.get_freeze_count() == 0
    opened_and_warm = len(frozen) - result.calls
    assert not any(frozen[:opened_and_warm]) and all(frozen[opened_and_warm:])
    assert result.stalls is not None and result.stalls.stalls == result.served == 12
    assert result.stalls.threshold_ms == 1e-6 and len(result.stalls.call_ms) == 12

    frozen.clear()
    plain = load_test.run_load_test(_args("--no-stall-report", "--no-gc-freeze"))
    assert plain.stalls is None and not plain.gc_frozen and not any(frozen)


def test_main_prints_a_stall_line_per_trial(capsys):
    argv = [*TINY, "--rates", "1000,2000", "--p99-ms", "1e6"]
    assert load_test.main(argv) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "stalls > 1e+06 ms" in ln]
    assert len(lines) == 2 and all("0 of 12" in ln for ln in lines)


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_a_bad_stall_threshold_exits_2_naming_the_option(value, capsys):
    assert load_test.main([*TINY, "--stall-ms", value]) == 2
    assert f"--stall-ms must be > 0, got {float(value):g}" in capsys.readouterr().err


def test_the_session_counts_captures_and_eager_calls_cheaply():
    args = _args()
    session = load_test.run.ServingSession(load_test.build_model(args))
    assert session.graph_counts() == (0, 0)  # CPU: no graphs at all
    assert stalls.ALLOCATOR_STATS["num_alloc_retries"] == "retries"
