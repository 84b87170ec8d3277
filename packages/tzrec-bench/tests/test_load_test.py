"""python -m tzrec_bench.load_test on a tiny model: nothing dropped, answers equal to the full
forward, and the checks fail when the session drops a request or answers wrongly."""

from __future__ import annotations

import pytest
import torch

from tzrec_bench import load_test
from tzrec_bench.load_test.stream import _calls
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


def test_main_prints_the_report_and_exits_0(capsys):
    assert load_test.main([*TINY, "--threads", "1"]) == 0
    out = capsys.readouterr().out
    header = out.splitlines()[0]
    assert "HSTURanking E=16" in header and f"torch {torch.__version__}" in header
    assert "30 served of 30 sent" in out
    assert "p50" in out and "p99" in out and "requests/s" in out and "events/s" in out
    assert "fp32 tolerance" in out


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
    calls = _calls(requests, 4)
    order = [r.index for _, group in calls for r in group]
    assert sorted(order) == list(range(40))
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
