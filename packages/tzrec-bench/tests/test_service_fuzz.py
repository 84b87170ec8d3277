"""Generated requests at every endpoint of ``tzrec-bench serve``'s app, over a retrieval
model (string ids) and a ranking model (integer ids): never a 5xx, and a refused request
(4xx) changes no stored event and no user's history."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install 'tzrec-bench[serve]'")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

FIELDS = ["user", "items", "timestamps", "actions", "candidates", "k", "extra"]
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
    st.floats(allow_nan=False), st.text(max_size=12),
    st.sampled_from(["u1", "u3", "i1", "i7", "new user", "", "1e9", "-1", str(2**64)]),
    st.integers(min_value=0, max_value=2_000_000_000),
)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=6), max_leaves=12)
bodies = st.one_of(
    st.dictionaries(st.sampled_from(FIELDS), values, max_size=5),
    values,
    st.fixed_dictionaries({"user": st.sampled_from(["u1", "u2", "nobody", 3, 5, "5"]),
                           "items": st.lists(st.sampled_from(["i1", "i2", "zzz", 7]),
                                             max_size=1100),
                           "actions": st.one_of(st.none(), st.lists(
                               st.integers(min_value=-1, max_value=3), max_size=3)),
                           "timestamps": st.one_of(st.none(), st.lists(
                               st.integers(min_value=-5, max_value=2**62), max_size=4))}),
)
raw_bodies = st.one_of(st.binary(max_size=40), bodies.map(lambda b: json.dumps(b).encode()))
queries = st.dictionaries(st.sampled_from(["user", "k", "exclude_seen", "other"]),
                          st.one_of(st.text(max_size=8), st.integers(-2**66, 2**66),
                                    st.sampled_from(["u1", "true", "no", "10", "-3", "",
                                                     str(2**64), "1e400"])),
                          max_size=4)
calls = st.one_of(
    st.tuples(st.just("GET"), st.sampled_from(["/recommend", "/healthz", "/readyz", "/info",
                                               "/metrics", "/nothing"]), queries, st.none()),
    st.tuples(st.just("POST"), st.sampled_from(["/events", "/score", "/recommend"]),
              st.just({}), raw_bodies),
)


def _state(service):
    histories = service.engine.histories
    users = ("u1", "u2", 3, 5)
    return service.engine.store.count(), {u: histories.newest(u) for u in users}


@pytest.mark.parametrize("run", ["service_run", "ranking_service_run"])
@settings(max_examples=120, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(call=calls)
def test_no_generated_request_is_a_5xx_or_changes_data_when_refused(run, serve, request, call):
    if not hasattr(serve, "started"):  # one service for every example
        trained = request.getfixturevalue(run)
        serve.started = serve(trained.run, getattr(trained, "log", None))
    service, client = serve.started
    method, path, params, content = call
    before = _state(service)
    got = client.request(method, path, params=params, content=content,
                         headers={"content-type": "application/json"} if content else {})
    assert got.status_code < 500, (call, got.text)
    if got.status_code >= 400:
        assert _state(service) == before, (call, got.text)
    assert client.get("/healthz").status_code == 200
