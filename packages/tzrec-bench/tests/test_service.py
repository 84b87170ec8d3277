"""``tzrec-bench serve``'s app in process: every endpoint, answers equal to the serving
session's for the same history, appended events in the next answer, the database reopened,
bad requests (4xx naming the field), overload (503 with Retry-After), and the README's curl
examples.

What is checked against what: ``/recommend`` and ``/score`` == ``ServingSession`` over the
same checkpoint, given the user's history (the log's events, then the appended ones) as
``Histories`` (the session is tested against the full forward in tzrec-gr); the popular
fallback == the log's items counted by hand.
"""

from __future__ import annotations

import re
import shlex
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install 'tzrec-bench[serve]'")

from tzrec_bench.predict_users import history  # noqa: E402
from tzrec_gr.serving import Histories, ServingSession  # noqa: E402

README = Path(__file__).resolve().parents[1] / "README.md"


def _history(rows, user, extra=()):
    """The user's (items, timestamps) from the log rows by hand, then ``extra`` events."""
    mine = [(r[1], r[2]) for r in rows if r[0] == user] + list(extra)
    return [i for i, _ in mine], [t for _, t in mine]


def _expected(run, items, times, k, exclude_seen=True):
    session = ServingSession.from_checkpoint(run)
    vocab = session.vocabularies
    known = [(i, t) for i, t in zip(items, times) if len(vocab.items.rows([i])) and
             vocab.items.rows([i])[0] >= 0]
    top = session.recommend(Histories.from_raw(vocab, [[i for i, _ in known]],
                                               [[t for _, t in known]]), k,
                            exclude_seen=exclude_seen)
    return top.raw_ids(vocab)[0], top.scores[0, :len(top.raw_ids(vocab)[0])].tolist()


def _same(answer, items, scores):
    assert answer["items"] == items
    assert answer["scores"] == pytest.approx(scores, abs=1e-6)
    assert "fallback" not in answer


def test_health_readiness_info_and_metrics(service_run, serve):
    service, client = serve(service_run.run, service_run.log)
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").json() == {"status": "ready"}
    info = client.get("/info").json()
    dataset = service.engine.histories.dataset
    assert info["model"] == "hstu-retrieval" and info["task"] == "retrieval"
    assert info["data_fingerprint"] == dataset.fingerprint != ""
    assert info["training_data_fingerprint"] == dataset.fingerprint
    assert len(info["model_fingerprint"]) == 32 and info["stored_events"] == 0
    client.get("/recommend", params={"user": "u1"})
    client.get("/recommend", params={"user": "u1"})
    text = client.get("/metrics").text
    assert 'tzrec_requests_total{endpoint="/recommend",status="200"} 2.0' in text
    assert "tzrec_batch_size_count 2.0" in text
    assert "tzrec_cache_hits_total 1.0" in text and "tzrec_cache_misses_total 1.0" in text
    assert "tzrec_request_seconds_bucket" in text and "tzrec_graph_replays_total 0.0" in text
    assert client.get("/openapi.json").json()["paths"].keys() >= {"/recommend", "/events"}


@pytest.mark.parametrize("exclude_seen", [True, False])
def test_recommend_is_the_sessions_answer_for_the_users_history(service_run, serve,
                                                                exclude_seen):
    _, client = serve(service_run.run, service_run.log)
    for user in ("u0", "u3", "u11"):
        got = client.get("/recommend", params={"user": user, "k": 7,
                                               "exclude_seen": str(exclude_seen).lower()})
        assert got.status_code == 200
        assert got.json()["user"] == user
        _same(got.json(), *_expected(service_run.run, *_history(service_run.rows, user), 7,
                                     exclude_seen))


def test_appended_events_are_in_the_next_answer(service_run, serve):
    service, client = serve(service_run.run, service_run.log)
    client.get("/recommend", params={"user": "u2"})  # u2 open: its events are extended
    new = [("i5", 1_800_000_000), ("not an item", 1_800_000_001), ("i7", 1_800_000_002)]
    for user in ("u2", "u4"):  # u4 not open: encoded from its whole history when asked
        got = client.post("/events", json={"user": user, "items": [i for i, _ in new],
                                           "timestamps": [t for _, t in new]})
        assert got.status_code == 200
        assert got.json() == {"user": user, "stored": 3, "unknown_items": ["not an item"]}
        answer = client.get("/recommend", params={"user": user, "k": 5}).json()
        expected = _expected(service_run.run, *_history(service_run.rows, user, new), 5)
        _same(answer, *expected)
        assert answer["items"] != _expected(service_run.run,
                                            *_history(service_run.rows, user), 5)[0]
    assert service.engine.store.count() == 6
    assert "tzrec_unknown_items_total 2.0" in client.get("/metrics").text
    # without timestamps the events are stamped now (not before the user's newest)
    assert client.post("/events", json={"user": "u2", "items": ["i1"]}).status_code == 200
    assert service.engine.histories.newest("u2") >= 1_800_000_002


def test_an_unknown_user_gets_popular_items_until_it_has_events(service_run, serve):
    _, client = serve(service_run.run, service_run.log)
    counts = Counter(r[1] for r in service_run.rows)
    popular = sorted(counts, key=lambda i: (-counts[i], i))[:4]
    answer = client.get("/recommend", params={"user": "someone new", "k": 4}).json()
    assert answer["fallback"] == "popular" and answer["items"] == popular
    assert answer["scores"] == pytest.approx([counts[i] / len(service_run.rows)
                                              for i in popular])
    assert client.post("/events", json={"user": "someone new", "items": ["i3", "i9"],
                                        "timestamps": [5, 6]}).status_code == 200
    _same(client.get("/recommend", params={"user": "someone new", "k": 4}).json(),
          *_expected(service_run.run, ["i3", "i9"], [5, 6], 4))


def test_the_database_keeps_the_events_across_a_restart(service_run, serve, tmp_path):
    db = tmp_path / "kept.sqlite"
    service, client = serve(service_run.run, service_run.log, db)
    client.post("/events", json={"user": "u6", "items": ["i1", "i2"],
                                 "timestamps": [1_800_000_000, 1_800_000_000]})
    client.post("/events", json={"user": "u6", "items": ["i3"], "timestamps": [1_800_000_009]})
    before = client.get("/recommend", params={"user": "u6", "k": 6}).json()
    service.close()
    again, client = serve(service_run.run, service_run.log, db)
    assert client.get("/info").json()["stored_events"] == 3
    assert client.get("/recommend", params={"user": "u6", "k": 6}).json() == before
    _same(before, *_expected(service_run.run, *_history(
        service_run.rows, "u6", [("i1", 1_800_000_000), ("i2", 1_800_000_000),
                                 ("i3", 1_800_000_009)]), 6))


def test_a_database_of_other_data_is_refused(service_run, serve, tmp_path):
    from tzrec_bench.service.store import EventStore, StoreMismatch

    db = tmp_path / "other.sqlite"
    EventStore(db, "another fingerprint").close()
    with pytest.raises(StoreMismatch, match="--db: .* holds events for other data"):
        serve(service_run.run, service_run.log, db)


JSON = {"content-type": "application/json"}
BAD = [
    ("GET", "/recommend", {"params": {"user": "u1", "k": -1}}, 422, "k"),
    ("GET", "/recommend", {"params": {"user": "u1", "k": 0}}, 422, "k"),
    ("GET", "/recommend", {"params": {"user": "u1", "k": "ten"}}, 422, "k"),
    ("GET", "/recommend", {"params": {"user": "u1", "k": 10_000}}, 422, "k"),
    ("GET", "/recommend", {"params": {"k": 3}}, 422, "user"),
    ("GET", "/recommend", {"params": {"user": "u1", "exclude_seen": "perhaps"}}, 422,
     "exclude_seen"),
    ("POST", "/score", {"json": {"user": "u1", "candidates": ["i1"]}}, 404, "score"),
    ("POST", "/events", {"content": b"{not json"}, 422, "body"),
    ("POST", "/events", {"json": [1, 2]}, 422, "body"),
    ("POST", "/events", {"json": {"items": ["i1"]}}, 422, "user"),
    ("POST", "/events", {"json": {"user": "u1", "items": []}}, 422, "items"),
    ("POST", "/events", {"json": {"user": "u1", "items": "i1"}}, 422, "items"),
    ("POST", "/events", {"json": {"user": 1.5, "items": ["i1"]}}, 422, "user"),
    ("POST", "/events", {"json": {"user": "u1", "items": [True]}}, 422, "items"),
    ("POST", "/events", {"json": {"user": "u1", "items": ["i1"] * 1025}}, 422, "items"),
    ("POST", "/events", {"json": {"user": "u1", "items": ["i1"], "when": 3}}, 422, "when"),
    ("POST", "/events", {"json": {"user": "u1", "items": ["i1"], "timestamps": [-5]}}, 422,
     "timestamps"),
    ("POST", "/events", {"json": {"user": "u1", "items": ["i1"], "timestamps": [2**60]}},
     422, "timestamps"),
    ("POST", "/events", {"json": {"user": "u1", "items": ["i1"], "timestamps": [1, 2]}},
     422, "timestamps"),
    ("POST", "/events", {"json": {"user": "u1", "items": ["i1"], "timestamps": [5]}}, 422,
     "timestamps[0]"),  # older than u1's newest event in the log
    ("POST", "/events", {"json": {"user": "new", "items": ["i1", "i2"],
                                  "timestamps": [9, 8]}}, 422, "timestamps[1]"),
    ("POST", "/events", {"json": {"user": "u1", "items": ["i1"], "actions": [1, 2]}}, 422,
     "actions"),
    # Python's JSON reads Infinity and NaN; the error must not echo them back
    ("POST", "/events", {"content": b'{"user": Infinity}', "headers": JSON}, 422, "user"),
    ("POST", "/events", {"content": b'{"user": "u1", "items": [NaN]}', "headers": JSON}, 422,
     "items[0]"),
]


@pytest.mark.parametrize("method,url,kwargs,status,field", BAD,
                         ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_a_bad_request_is_a_4xx_naming_the_field_and_stores_nothing(
        service_run, serve, method, url, kwargs, status, field):
    service, client = serve(service_run.run, service_run.log)
    got = client.request(method, url, **kwargs)
    assert got.status_code == status, got.text
    body = got.json()
    assert body["detail"].startswith(f"{body['field']}: ") and field in body["field"], body
    assert service.engine.store.count() == 0


def test_overload_is_a_503_with_retry_after(service_run, serve):
    _, client = serve(service_run.run, service_run.log, max_batch=1, max_wait_ms=0,
                      max_queue=1)
    calls = [("GET", "/recommend", {"params": {"user": f"u{i % 12}", "k": 5}})
             for i in range(40)]
    answers = client.gather(calls)
    statuses = Counter(a.status_code for a in answers)
    assert set(statuses) == {200, 503} and statuses[503] > 0, statuses
    refused = next(a for a in answers if a.status_code == 503)
    assert refused.headers["retry-after"] == "1" and refused.json()["field"] == "queue"
    assert 'status="503"' in client.get("/metrics").text


def test_score_is_the_sessions_answer_and_follows_new_events(ranking_service_run, serve):
    service, client = serve(ranking_service_run.run)
    dataset = service.engine.histories.dataset
    session = ServingSession.from_checkpoint(ranking_service_run.run)
    vocab = session.vocabularies
    user, row = int(dataset.user_raw_ids[3]), 3
    record = history(dataset, row)
    candidates = vocab.items.raw([2, 9, 4])

    def expected(extra_items=(), extra_times=(), extra_actions=()):
        newest = -service.limits.max_events  # the model reads the newest events
        probs = session.score(Histories.from_raw(
            vocab, [(record["item_ids"] + list(extra_items))[newest:]],
            [(record["timestamps"] + list(extra_times))[newest:]],
            [(record["actions"] + list(extra_actions))[newest:]]),
            [vocab.items.rows(candidates).tolist()])
        return {t: probs[:, j].tolist() for j, t in enumerate(service.limits.tasks)}

    got = client.post("/score", json={"user": user, "candidates": candidates})
    assert got.status_code == 200 and got.json()["candidates"] == candidates
    for task, values in expected().items():
        assert got.json()["scores"][task] == pytest.approx(values, abs=1e-5)
    newest = record["timestamps"][-1]
    new = {"user": user, "items": vocab.items.raw([5, 6]), "timestamps": [newest + 1, newest + 2],
           "actions": [1, 3]}
    assert client.post("/events", json={**new, "actions": None}).json()["field"] == "actions"
    assert client.post("/events", json=new).status_code == 200
    got = client.post("/score", json={"user": user, "candidates": candidates}).json()
    for task, values in expected(new["items"], new["timestamps"], new["actions"]).items():
        assert got["scores"][task] == pytest.approx(values, abs=1e-5)
    too_many = vocab.items.raw(list(range(service.limits.max_candidates + 1)))
    for body, status, field in (
        ({"user": user, "candidates": too_many}, 422, "candidates"),
        ({"user": user, "candidates": [candidates[0], "nope"]}, 422, "candidates[1]"),
        ({"user": "nobody", "candidates": candidates}, 404, "user"),
        ({"user": user, "candidates": []}, 422, "candidates"),
        ({"user": str(2**70), "candidates": candidates}, 422, "user"),  # integer ids: 64 bits
        ({"user": user, "candidates": [candidates[0], str(-2**70)]}, 422, "candidates[1]"),
    ):
        answer = client.post("/score", json=body)
        assert answer.status_code == status and field in answer.text, answer.text
    assert client.post("/events", json={**new, "items": [str(2**64), 1]}).json()["field"] == (
        "items[0]")
    assert client.get("/recommend", params={"user": user}).status_code == 404


def _readme_curls():
    """The ``curl`` lines of the README's serving section (continuations joined)."""
    text = README.read_text()
    section = re.split(r"\n##+ ", text.split("### Serve recommendations over HTTP", 1)[1])[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    return [shlex.split(line, comments=True) for line in lines if line.startswith("curl ")]


def _as_request(words):
    """``curl`` words -> (method, path, kwargs)."""
    method, url, data, headers = "GET", None, None, {}
    words = iter(words[1:])
    for word in words:
        if word == "-X":
            method = next(words)
        elif word == "-d":
            data, method = next(words), ("POST" if method == "GET" else method)
        elif word == "-H":
            name, _, value = next(words).partition(": ")
            headers[name] = value
        elif word.startswith("http"):
            url = word
        else:
            assert word in ("-s", "-i", "-f"), f"the test reads no curl option {word}"
    path = re.sub(r"^https?://[^/]+", "", url)
    return method, path, {"content": data, "headers": headers} if data else {}


def test_the_readmes_curl_examples_run(service_run, serve):
    curls = _readme_curls()
    paths = {re.sub(r"\?.*", "", _as_request(c)[1]) for c in curls}
    assert {"/recommend", "/events", "/info", "/readyz", "/metrics"} <= paths
    _, client = serve(service_run.run, service_run.log)
    for words in curls:
        method, path, kwargs = _as_request(words)
        got = client.request(method, path, **kwargs)
        assert got.status_code == 200, (shlex.join(words), got.text)


def test_a_database_of_generated_data_is_refused_for_a_log(service_run, ranking_service_run,
                                                          serve, tmp_path):
    from tzrec_bench.service.store import StoreMismatch

    db = tmp_path / "synthetic.sqlite"
    service, _ = serve(ranking_service_run.run, None, db)  # synthetic data: no fingerprint
    service.close()
    with pytest.raises(StoreMismatch, match="unfingerprinted synthetic"):
        serve(service_run.run, service_run.log, db)


def test_concurrent_requests_share_session_calls_with_the_same_answers(service_run, serve,
                                                                       tmp_path):
    _, alone = serve(service_run.run, service_run.log, max_batch=1)
    users = [f"u{i}" for i in range(8)]
    single = [alone.get("/recommend", params={"user": u, "k": 5}).json() for u in users]
    _, client = serve(service_run.run, service_run.log, tmp_path / "batched.sqlite",
                      max_batch=8, max_wait_ms=500)
    got = client.gather([("GET", "/recommend", {"params": {"user": u, "k": 5}})
                         for u in users])
    for answer, expected in zip(got, single):
        assert answer.json()["items"] == expected["items"]
        assert answer.json()["scores"] == pytest.approx(expected["scores"], abs=1e-6)
    text = client.get("/metrics").text
    count = float(re.search(r"tzrec_batch_size_count (\S+)", text).group(1))
    assert count < len(users), text  # gathered: fewer session calls than requests
    assert float(re.search(r"tzrec_batch_size_sum (\S+)", text).group(1)) == len(users)


def test_a_users_requests_in_one_batch_are_answered_in_order(service_run, serve):
    from tzrec_bench.service.engine import Events, Recommend

    service, _ = serve(service_run.run, service_run.log)
    new = Events("u9", ("i1", "i2", "i3"), (1_800_000_000,) * 3)
    answers = service.engine([Recommend("u9", 5), new, Recommend("u9", 5)])
    # every answer is a future: the top-k lists once their results reach the host, the
    # events' once the writer commits them
    first, stored, last = (future.result(timeout=10) for future in answers)
    assert stored["stored"] == 3
    _same(first, *_expected(service_run.run, *_history(service_run.rows, "u9"), 5))
    _same(last, *_expected(service_run.run, *_history(
        service_run.rows, "u9", [(i, 1_800_000_000) for i in new.items]), 5))


def test_exclude_seen_leaves_out_every_item_of_the_whole_history_as_predict(
        service_run, serve, tmp_path):
    """A user whose appended events push the log's out of the model's input: the answer
    leaves out the items of every event (not only the newest the model reads), and equals
    ``tzrec-bench predict``'s for the same events as a log."""
    import csv
    import json

    from tzrec_bench.cli import main

    service, client = serve(service_run.run, service_run.log)
    bound = service.limits.max_events
    new = [(f"i{(3 * j) % 30}", 1_800_000_000 + j) for j in range(bound)]
    log_items, log_times = _history(service_run.rows, "u6")
    older = set(log_items) - {i for i, _ in new}
    assert older  # items only events outside the model's input hold
    client.get("/recommend", params={"user": "u6"})  # open: the new events are extended
    assert client.post("/events", json={"user": "u6", "items": [i for i, _ in new],
                                        "timestamps": [t for _, t in new]}).status_code == 200
    k = service.limits.num_items
    got = client.get("/recommend", params={"user": "u6", "k": k}).json()
    assert not older & set(got["items"]) and not {i for i, _ in new} & set(got["items"])
    log = tmp_path / "u6.csv"
    with open(log, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["user_id", "item_id", "timestamp"])
        writer.writerows([["u6", i, t] for i, t in zip(log_items, log_times)])
        writer.writerows([["u6", i, t] for i, t in new])
    out = tmp_path / "top.csv"
    assert main(["predict", str(service_run.run), "--users", "u6", "--data", str(log),
                 "--output", str(out), "--k", str(k)]) == 0
    with open(out, newline="") as f:
        (row,) = list(csv.DictReader(f))
    assert got["items"] == json.loads(row["item_ids"])
    assert got["scores"] == pytest.approx(json.loads(row["scores"]), abs=1e-6)
