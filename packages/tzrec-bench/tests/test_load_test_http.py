"""The load test's HTTP mode on a tiny model on the CPU: the service started in its own
process on a local port, the stream sent through httpx, both figures and their ratio printed,
the answers through HTTP equal to the full forward; a failing request is counted as dropped.
"""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("fastapi", reason="needs the serve extra: pip install 'tzrec-bench[serve]'")
httpx = pytest.importorskip("httpx", reason="needs httpx (tzrec-bench[test])")

from tzrec_bench.benchmarks import load_test  # noqa: E402
from tzrec_bench.benchmarks.load_test.http import run_http_trial  # noqa: E402
from tzrec_bench.benchmarks.load_test.model import build_model, weights_digest  # noqa: E402

TINY = [
    "--device", "cpu", "--dim", "16", "--heads", "2", "--layers", "1", "--items", "50",
    "--users", "8", "--history", "6", "--max-history", "12", "--candidates", "4", "--k", "5",
    "--requests", "30", "--rate", "20", "--warmup", "2", "--check-every", "2",
    "--threads", "1", "--max-batch", "8",
]


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("model, databases", [
    ("ranking", ["temp"]), ("retrieval", ["temp", ":memory:"])])
def test_http_mode_prints_both_rates_the_ratio_and_checks_the_answers(model, databases,
                                                                      capsys):
    # history 6, at most 12 events: retrieval users outgrow the model's input, so the check
    # covers items seen only before the newest events (left out by the service)
    code = load_test.main([*TINY, "--model", model, "--http", "--events", "6",
                           "--http-db", ",".join(databases)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.count("the service in its own process (max batch 8") == len(databases)
    assert "requests: 30 served of 30 sent" in out  # in process
    answered = re.findall(r"requests: 30 answered of 30 sent \([^)]*\), 0 dropped", out)
    assert len(answered) == len(databases)
    assert re.search(r"client send lag \(sent - due\): p50 [\d.]+ ms", out)
    ratios = re.findall(r"HTTP \((events on disk|no database file)\) / in-process, max batch "
                        r"8: ([\d.,]+) / ([\d.,]+) requests/s achieved at 20/s offered .* = "
                        r"([\d.]+): (?:HTTP \(.*\) costs|no cost)", out)
    assert [r[0] for r in ratios] == [
        "no database file" if db == ":memory:" else "events on disk" for db in databases], out
    for _, *figures in ratios:
        http_rate, in_process, shown = (float(g.replace(",", "")) for g in figures)
        assert http_rate > 0 and in_process > 0
        assert shown == pytest.approx(http_rate / in_process, abs=0.01)  # (shown to 0.1)
    checked = re.search(r"HTTP answers: (\d+) scoring requests against the full forward.*"
                        r"worst ([\d.e+-]+) of the fp32 tolerance", out)
    assert checked and int(checked.group(1)) >= 3 and float(checked.group(2)) <= 1.0


def _fake_service(args, fail_every: int):
    """A transport answering like the service (fixed values), but a 500 for every
    ``fail_every``-th scoring request, a dropped connection for the one after it and a
    503 (overloaded) for the one after that."""
    seen = {"score": 0}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/events":
            return httpx.Response(200, json={"stored": 1, "unknown_items": []})
        seen["score"] += 1
        if seen["score"] % fail_every == 0:
            return httpx.Response(500, text="Internal Server Error")
        if seen["score"] % fail_every == 1 and seen["score"] > fail_every:
            raise httpx.ReadError("connection reset", request=request)
        if seen["score"] % fail_every == 2 and seen["score"] > fail_every:
            return httpx.Response(503, json={"detail": "queue: full"},
                                  headers={"Retry-After": "1"})
        if args.served.takes_k:
            return httpx.Response(200, json={"items": list(range(args.k)),
                                             "scores": [0.5] * args.k})
        return httpx.Response(200, json={"scores": {"a": [0.5] * args.candidates,
                                                    "b": [0.5] * args.candidates}})

    return httpx.MockTransport(handler), seen


@pytest.mark.parametrize("model", ["ranking", "retrieval"])
def test_a_failing_http_request_is_counted_as_dropped(model):
    args = load_test._resolve(load_test._parser().parse_args(
        [*TINY, "--model", model, "--rate", "400", "--extend-fraction", "0.3"]))
    transport, seen = _fake_service(args, fail_every=4)
    result = run_http_trial(args, "http://service", build_model(args), offset=0,
                            transport=transport)
    timed_scores = result.kinds["score"]
    assert result.dropped > 0 and result.served + result.dropped == result.sent == 30
    assert len(result.latencies_ms) == result.served
    assert any("HTTP 500: Internal Server Error" in e for e in result.errors)
    assert any("ReadError: connection reset" in e for e in result.errors)
    # every failed call is named, the untimed ones too (the openers and the warm-up); a 503
    # (overload, as the service answers it) is counted, not an error
    calls = range(1, seen["score"] + 1)
    failed = [n for n in calls if n % 4 == 0 or (n % 4 == 1 and n > 4)]
    refused = [n for n in calls if n % 4 == 2 and n > 4]
    assert len(result.errors) == len(failed) and result.refused == len(refused)
    assert result.dropped <= len(failed) + len(refused) and result.dropped <= timed_scores
    assert not any("503" in e for e in result.errors)
    assert not result.sustains(args.p99_ms) and not result.passed


@pytest.mark.parametrize("argv, message", [
    (["--http", "--connections", "0"], "--connections must be >= 1, got 0"),
    (["--http", "--queue", "0"], "--queue must be >= 1, got 0"),
    (["--http", "--max-wait-ms", "-1"], "--max-wait-ms must be >= 0, got -1"),
])
def test_bad_http_options_exit_2_naming_the_option(argv, message, capsys):
    assert load_test.main([*TINY, *argv]) == 2
    assert message in capsys.readouterr().err


def test_the_digest_tells_the_same_seeded_model_from_another():
    args = load_test._resolve(load_test._parser().parse_args(TINY))
    same = weights_digest(build_model(args))
    assert weights_digest(build_model(args)) == same
    args.seed = 1
    assert weights_digest(build_model(args)) != same


def test_the_readmes_load_test_commands_parse():
    import shlex
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    lines = [line.strip() for line in readme.splitlines()
             if line.strip().startswith("python -m tzrec_bench.benchmarks.load_test")]
    assert any("--http" in line for line in lines)
    for line in lines:
        argv = shlex.split(line.split(" # ")[0])[3:]
        # the options' spelling is checked here, not the GPU (the parser checks the device)
        argv = ["cpu" if word == "cuda" else word for word in argv]
        load_test._parser().parse_args(argv)  # exits 2 on an option it does not have
