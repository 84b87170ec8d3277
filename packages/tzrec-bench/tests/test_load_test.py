"""python -m tzrec_bench.benchmarks.load_test on a tiny model: nothing dropped, answers equal
to the full forward, and the checks fail when the session drops a request or answers wrongly."""

from __future__ import annotations

import pytest
import torch

from tzrec_bench.benchmarks import load_test
from tzrec_bench.benchmarks.load_test.stream import _calls
from tzrec_gr.serving import Histories, ServingSession
from tzrec_ops.tolerances import tolerance

TINY = [
    "--device", "cpu", "--dim", "16", "--heads", "2", "--layers", "1", "--items", "50",
    "--users", "8", "--history", "6", "--max-history", "12", "--candidates", "4", "--k", "5",
    "--requests", "30", "--rate", "2000", "--warmup", "2", "--check-every", "3",
]


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _args(*extra: str):
    return load_test._resolve(load_test._parser().parse_args([*TINY, *extra]))


@pytest.mark.parametrize(
    "extra",
    [("--model", "ranking"), ("--model", "retrieval", "--max-batch", "4"),
     ("--model", "ranking", "--no-time-encoding", "--max-batch", "8", "--dtype", "bf16")],
    ids=["ranking", "retrieval-batched", "ranking-incremental-bf16"],
)
def test_serves_every_request_and_matches_the_full_forward(extra):
    args = _args(*extra)
    result = load_test.run_load_test(args)
    assert result.sent == result.served == 30
    assert len(result.latencies_ms) == 30
    assert result.kinds.get("score", 0) > 0 and result.kinds.get("extend", 0) > 0
    assert result.checks >= 2
    assert result.worst_ratio <= 1.0 and result.passed
    assert result.tolerance == tolerance(load_test.DTYPES[args.dtype])
    pct = result.percentiles()
    assert 0 <= pct["p50"] <= pct["p90"] <= pct["p99"] <= pct["max"]
    assert result.elapsed_s > 0 and result.events > 0
    assert not result.graph_stats["enabled"]  # CPU: eager
    timed = {name: n for name, n, _, _ in result.call_times()}
    assert sum(timed.values()) == result.calls
    scoring = "score" if args.model == "ranking" else "recommend"
    assert timed["extend"] > 0 and set(timed) <= {"extend", scoring, f"{scoring} after extend"}
    assert all(0 < mean <= p99 for _, _, mean, p99 in result.call_times())


def test_call_class_names_scoring_calls_after_new_events():
    extended = {3}
    assert load_test.call_class("extend", [3], extended) == "extend"
    assert load_test.call_class("score", [1, 2], extended) == "score"
    assert load_test.call_class("score", [1, 3], extended) == "score after extend"
    assert load_test.call_class("recommend", [3], extended) == "recommend after extend"


def test_main_prints_the_report_and_exits_0(capsys):
    assert load_test.main([*TINY, "--threads", "1"]) == 0
    out = capsys.readouterr().out
    header = out.splitlines()[0]
    assert "HSTURanking E=16" in header and f"torch {torch.__version__}" in header
    assert "30 served of 30 sent" in out
    assert "p50" in out and "p99" in out and "requests/s" in out and "events/s" in out
    assert "session calls (count, mean / p99 ms): extend" in out
    assert "fp32 tolerance" in out


@pytest.mark.parametrize("name, task", [("hstu-retrieval", "retrieval"),
                                        ("hstu-ranking", "ranking")])
def test_a_registered_name_runs_the_model_its_task_names(capsys, name, task):
    short = [*TINY, "--requests", "6", "--check-every", "1"]
    assert load_test.main([*short, "--model", name]) == 0
    by_name = capsys.readouterr().out
    assert load_test.main([*short, "--model", task]) == 0
    by_task = capsys.readouterr().out
    assert by_name.splitlines()[0] == by_task.splitlines()[0]
    assert "6 served of 6 sent" in by_name
    assert _args("--model", name).served == _args("--model", task).served


def test_the_models_facts_come_from_its_server():
    retrieval = _args("--model", "retrieval").served
    assert (retrieval.name, retrieval.model_class, retrieval.call) == (
        "hstu-retrieval", "HSTURetrieval", "recommend")
    assert retrieval.takes_k and not retrieval.candidates and not retrieval.actions
    assert not retrieval.time_encoded and retrieval.request_size == "k"
    ranking = _args("--model", "hstu-ranking").served
    assert (ranking.model_class, ranking.call, ranking.request_size) == (
        "HSTURanking", "score", "candidates")
    assert ranking.candidates and ranking.actions and ranking.time_encoded
    assert not ranking.takes_k
    assert not _args("--no-time-encoding").served.time_encoded


@pytest.mark.parametrize(
    "choice, header",
    [("retrieval", "top-5 of 50 items;"), ("ranking", "fp32, time encoding, backend"),
     ("ranking --no-time-encoding", "fp32, backend")],
)
def test_the_header_tells_what_a_request_carries(capsys, choice, header):
    assert load_test.main([*TINY, "--requests", "6", "--check-every", "1",
                           "--model", *choice.split()]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert header in first
    assert ("4 candidates;" in first) == (choice != "retrieval")


def test_a_name_of_no_served_model_is_refused_naming_the_option(capsys):
    with pytest.raises(SystemExit) as info:
        load_test.main([*TINY, "--model", "sasrec"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --model: invalid choice: 'sasrec'" in err and "hstu-retrieval" in err


def test_wrong_scores_fail_the_check(monkeypatch, capsys):
    score = ServingSession.score
    monkeypatch.setattr(ServingSession, "score", lambda self, u, c: score(self, u, c) + 1e-3)
    assert load_test.main(TINY) == 1
    assert "FAILED: served answers differ from the full forward" in capsys.readouterr().err


def test_wrong_recommendations_fail_the_check(monkeypatch):
    recommend = ServingSession.recommend

    def shifted(self, users, k=10, **kw):
        top = recommend(self, users, k, **kw)
        return type(top)(ids=top.ids, scores=top.scores - 1e-3)

    monkeypatch.setattr(ServingSession, "recommend", shifted)
    result = load_test.run_load_test(_args("--model", "retrieval"))
    assert result.served == result.sent
    assert result.worst_ratio > 1.0 and not result.passed


def test_a_session_that_loses_events_fails_the_check(monkeypatch):
    # the reference follows the histories on the host, not through the session
    extend = ServingSession.extend

    def forgetful(self, user_ids, events):  # keeps one event of each request (B = 1)
        one = torch.ones(1, dtype=torch.int64)
        kept = Histories(events.item_ids[:1], one, events.timestamps[:1], events.actions[:1])
        return extend(self, user_ids, kept)

    monkeypatch.setattr(ServingSession, "extend", forgetful)
    result = load_test.run_load_test(_args("--events", "4", "--check-every", "1"))
    assert result.served == result.sent
    assert result.worst_ratio > 1.0 and not result.passed


def test_a_request_the_session_fails_is_dropped_and_exits_non_zero(monkeypatch, capsys):
    extend = ServingSession.extend
    calls = []

    def fails_once(self, user_ids, events):
        calls.append(user_ids)
        if len(calls) == 3:
            raise RuntimeError("out of cache memory")
        return extend(self, user_ids, events)

    monkeypatch.setattr(ServingSession, "extend", fails_once)
    assert load_test.main(TINY) == 1
    captured = capsys.readouterr()
    assert "29 served of 30 sent" in captured.out and "1 failed" in captured.out
    err = captured.err
    assert "FAILED: 1 requests dropped" in err and "RuntimeError: out of cache memory" in err


def test_calls_keep_each_users_order_and_the_batch_bound():
    args = _args("--users", "3", "--requests", "40")
    requests, _ = load_test.make_stream(args, 40)
    opens = [r for r in requests if r.kind == "open"]
    assert [r.index for r in opens] == list(range(len(opens))) and 1 <= len(opens) <= 3
    assert len(requests) == len(opens) + 40
    requests = requests[len(opens):]
    assert {r.kind for r in requests} == {"extend", "score"}
    calls = _calls(requests, 4)
    order = [r.index for _, group in calls for r in group]
    assert sorted(order) == [r.index for r in requests]
    position = {i: n for n, i in enumerate(order)}
    for user in {r.user for r in requests}:
        mine = [r.index for r in requests if r.user == user]
        assert [position[i] for i in mine] == sorted(position[i] for i in mine)
    for kind, group in calls:
        assert 1 <= len(group) <= 4
        assert {r.kind for r in group} == {kind}
        assert len({r.user for r in group}) == len(group)
    assert len(calls) < 40  # some requests were grouped
    assert [len(g) for _, g in _calls(requests, 1)] == [1] * 40
    assert len(_calls(opens, 4)) == 1  # the opens: distinct users, one call


def test_stream_histories_follow_the_requests():
    args = _args("--users", "2", "--requests", "50", "--check-every", "1")
    requests, checks = load_test.make_stream(args, 50)
    assert len(checks) == sum(r.kind == "score" for r in requests)
    for check in checks:
        events = [r for r in requests if r.user == check.request.user and r.kind != "score"
                  and r.index < check.request.index]
        assert events[0].kind == "open" and events[0].item_ids.numel() == 6
        ids = torch.cat([r.item_ids for r in events])[-12:]
        assert torch.equal(check.item_ids, ids)
        assert bool((check.timestamps[1:] >= check.timestamps[:-1]).all())


def test_percentile_interpolates_between_ranks():
    assert load_test.percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert load_test.percentile([1.0, 2.0], 100) == 2.0
    assert load_test.percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError, match="q must be in"):
        load_test.percentile([1.0], 101)


@pytest.mark.parametrize(
    "argv, message",
    [(["--history", "20", "--max-history", "10"], "--history (20) must be at most"),
     (["--rate", "0"], "--rate must be > 0"),
     (["--dim", "15", "--heads", "2"], "multiple of --heads"),
     (["--extend-fraction", "1.5"], "--extend-fraction must be in")],
)
def test_bad_options_exit_2_naming_the_option(argv, message, capsys):
    assert load_test.main(argv) == 2
    assert message in capsys.readouterr().err


# -- the sustained rate ---------------------------------------------------------------------


def test_size_span_covers_each_power_of_two_between():
    assert load_test.size_span(1000, 2048) == [1000, 1024, 2048]
    assert load_test.size_span(6, 12) == [6, 8, 12]
    assert load_test.size_span(5, 5) == [5]
    assert load_test.size_span(1, 4) == [1, 2, 4]


def test_warm_up_runs_every_shape_before_the_clock():
    args = _args("--max-batch", "3,1")
    session = ServingSession(load_test.build_model(args))
    report = load_test.warm_up(session, args, max(args.max_batches))
    # batch buckets 1, 2, 4 (3 users) x histories 6, 8, 12 events
    assert [(e["batch"], e["events"]) for e in report["encoded"]] == [
        (b, n) for b in (1, 2, 4) for n in (6, 8, 12)
    ]
    assert report["extended"] == []  # time encoding: extended users are encoded whole
    assert len(session) == 0


def test_no_encode_graphs_reaches_the_session(monkeypatch):
    from tzrec_bench.benchmarks.load_test import run

    made = []
    real = run.ServingSession

    def session(*a, **kw):
        made.append(kw)
        return real(*a, **kw)

    monkeypatch.setattr(run, "ServingSession", session)
    run.run_load_test(_args("--requests", "4"))
    run.run_load_test(_args("--requests", "4", "--no-encode-graphs"))
    assert [kw["encode_graphs"] for kw in made] == [True, False]


def _fake_trial(capacity, calls):
    """A run_load_test stand-in: the p99 stays under 50 ms iff the rate <= capacity."""

    def trial(args, session, stop_ms=None, log=None):
        calls.append((args.rate, args.max_batch))
        late = args.rate > capacity
        return load_test.LoadTestResult(
            sent=10, served=5 if late else 10, latencies_ms=[1.0] * (5 if late else 10),
            elapsed_s=1.0, events=0, kinds={}, calls=1, checks=1, max_abs_diff=0.0,
            worst_ratio=0.0, tolerance=tolerance(torch.float32), graph_stats={},
            rate=args.rate, max_batch=args.max_batch, stopped=late,
            unfinished_ms=[60.0] * 5 if late else [],
        )

    return trial


@pytest.mark.parametrize(
    "start, capacity, rates",
    [(100, 700, [100, 200, 400, 800, 566, 673, 734]),  # doubling, then bisection to 10%
     (1000, 300, [1000, 500, 250, 354, 297, 324]),  # halving first
     (100, 1e9, [100, 200, 400, 800, 1000])],  # up to --max-rate
)
def test_search_doubles_then_bisects_to_the_precision(monkeypatch, start, capacity, rates):
    from tzrec_bench.benchmarks.load_test import search

    calls = []
    monkeypatch.setattr(search, "run_load_test", _fake_trial(capacity, calls))
    args = _args("--rate", str(start), "--search", "--max-rate", "1000")
    trials = search.search_rates(args, None, 4, 50.0)
    assert [r for r, _ in calls] == rates and {b for _, b in calls} == {4}
    best = max(r for r in rates if r <= capacity)
    assert search.sustained(trials, 50.0) == best
    lines = search.table(trials, 50.0)
    assert lines[0].split()[:4] == ["offered/s", "achieved/s", "p50", "ms"]
    assert [float(line.split()[0].replace(",", "")) for line in lines[1:]] == sorted(rates)
    assert all(("sustained" in line) == (float(line.split()[0].replace(",", "")) <= capacity)
               for line in lines[1:])


def test_a_trial_stops_once_its_p99_bound_is_exceeded():
    args = _args("--requests", "60")
    result = load_test.run_load_test(args, stop_ms=1e-6)  # every request is late
    assert result.stopped and result.served < result.sent == 60 and result.dropped == 0
    assert not result.sustains(1e-6) and result.unfinished_ms
    assert result.percentiles()["p99"] > 1e-6


def test_main_searches_the_sustained_rate_of_each_batch_bound(capsys):
    argv = [*TINY, "--max-batch", "2,1", "--search", "--max-rate", "4000", "--p99-ms", "1e6"]
    assert load_test.main(argv) == 0
    out = capsys.readouterr().out
    header = out.splitlines()[0]
    assert "triton" in header and "torch" in header and "p99 bound 1e+06 ms" in header
    for batch in (2, 1):
        assert f"max batch {batch}, by rate:" in out
        assert f"sustained rate, max batch {batch}: 4,000 requests/s" in out
    assert out.count("offered/s") >= 2 and "correctness:" in out


def test_main_sweeps_rates_and_a_rate_that_is_not_kept_is_no_failure(capsys):
    argv = [*TINY, "--rates", "1000,500", "--p99-ms", "1e-6"]
    assert load_test.main(argv) == 0
    out = capsys.readouterr().out
    assert "sustained rate, max batch 1: none of the 2 rates tried" in out
    assert out.count("stopped: p99 >= 1e-06 ms") == 4  # progress rows and the table


@pytest.mark.parametrize(
    "argv, message",
    [(["--rates", "100", "--search"], "--rates and --search exclude each other"),
     (["--max-batch", "4,0"], "--max-batch must be >= 1, got 0"),
     (["--p99-ms", "0"], "--p99-ms must be > 0"),
     (["--rates", "100,-1"], "--rates must be > 0, got -1")],
)
def test_bad_search_options_exit_2_naming_the_option(argv, message, capsys):
    assert load_test.main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [(["--max-batch", "32,x"], "--max-batch: expected integers separated by commas, got '32,x'"),
     (["--rates", "100,fast"], "--rates: expected numbers separated by commas, got '100,fast'")],
)
def test_lists_that_do_not_parse_exit_2_naming_the_option(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_test.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err

