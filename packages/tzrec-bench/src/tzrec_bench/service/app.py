"""The HTTP layer (FastAPI): routes, request models with limits, errors, metrics.

=========================== ===========================================================
``GET /recommend``          ``?user=ID&k=10[&exclude_seen=true]``: the user's top ``k``
                            (models whose predictions take ``k``); a user without events
                            of items the model knows gets the log's popular items, with
                            ``"fallback": "popular"``
``POST /score``             ``{"user", "candidates"}``: per-task probabilities of each
                            candidate (models that score candidates)
``POST /events``            ``{"user", "items", "timestamps"?, "actions"?}``: appended,
                            committed to the database (appends waiting together share
                            one commit), then acknowledged; unknown items
                            are stored, counted and left out of the model's input
``GET /healthz``            the process answers
``GET /readyz``             the model is loaded, the batcher runs, the database commits
``GET /info``               model and data fingerprints, model name, task, limits
``GET /metrics``            Prometheus text format
=========================== ===========================================================

Ids are the raw ids of the event log (a query's ``user`` is read as the log's kind of id).
A bad request is a 4xx whose ``detail`` names the field: 422 for a malformed body, a wrong
type, a list too long, ``k`` outside ``[1, items]``, an unknown candidate, timestamps older
than the user's newest event; 404 for a user ``/score`` knows nothing of, or the call a
model does not answer; 503 with ``Retry-After`` when the queue is full.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from typing import Annotated, Any, AsyncIterator, List, Optional, Tuple, Union

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from tzrec_bench.service.batcher import Overloaded
from tzrec_bench.service.core import Service
from tzrec_bench.service.engine import BadRequest, Events, NotFound, Recommend, Score
from tzrec_bench.service.metrics import CONTENT_TYPE, ServiceMetrics

__all__ = ["MAX_EVENTS", "MAX_ID_LENGTH", "create_app"]

#: events in one POST /events
MAX_EVENTS = 1024
#: characters of a raw id given as text
MAX_ID_LENGTH = 256
#: the latest accepted timestamp (JSON's exact integers)
MAX_TIMESTAMP = 2**53 - 1
RETRY_AFTER_S = 1

Id = Union[Annotated[StrictInt, Field(ge=-2**63, le=2**63 - 1)],
           Annotated[StrictStr, Field(min_length=1, max_length=MAX_ID_LENGTH)]]
Timestamp = Annotated[StrictInt, Field(ge=0, le=MAX_TIMESTAMP)]
Action = Annotated[StrictInt, Field(ge=0, le=2**62)]
_ENDPOINTS = {"/recommend", "/score", "/events", "/healthz", "/readyz", "/info", "/metrics"}


class ScoreBody(BaseModel):
    """``POST /score``."""

    model_config = ConfigDict(extra="forbid")
    user: Id
    candidates: List[Id] = Field(min_length=1)


class EventsBody(BaseModel):
    """``POST /events``: one user's new events, oldest first."""

    model_config = ConfigDict(extra="forbid")
    user: Id
    items: List[Id] = Field(min_length=1, max_length=MAX_EVENTS)
    timestamps: Optional[List[Timestamp]] = Field(default=None, max_length=MAX_EVENTS)
    actions: Optional[List[Action]] = Field(default=None, max_length=MAX_EVENTS)


def _error(status: int, field: str, message: str, **headers: str) -> JSONResponse:
    return JSONResponse({"detail": f"{field}: {message}", "field": field}, status,
                        headers=headers or None)


def _field(loc: Tuple[Any, ...]) -> str:
    """The request field an error's location names: ``items[3]`` for
    ``("body", "items", 3, "constrained-int")`` (the union member pydantic tried is not a
    field), ``body`` for a body that is not JSON."""
    parts = list(loc[1:]) if loc and loc[0] in ("body", "query") else list(loc)
    if not parts or not isinstance(parts[0], str):
        return str(loc[0]) if loc else "request"
    name = parts[0]
    for part in parts[1:]:
        if not isinstance(part, int):
            break
        name += f"[{part}]"
    return name


def _parse(field: str, value: Any, parse: Any) -> Any:
    """``parse(value)``; its ValueError as a BadRequest naming ``field``."""
    try:
        return parse(value)
    except ValueError as exc:
        raise BadRequest(field, str(exc)) from None


def _parse_all(field: str, values: List[Any], parse: Any) -> Tuple[Any, ...]:
    return tuple(_parse(f"{field}[{p}]", v, parse) for p, v in enumerate(values))


def create_app(service: Service) -> FastAPI:
    """The app over ``service``; its batcher starts and stops with the app's lifespan."""
    metrics = ServiceMetrics(service)
    service.batcher.on_batch = metrics.on_batch
    service.engine.store.on_commit = metrics.on_commit
    histories = service.engine.histories

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.batcher.start()
        try:
            yield
        finally:
            service.batcher.stop()
            service.engine.close()

    app = FastAPI(title="tzrec-bench serve", lifespan=lifespan,
                  description="Recommendations by user id from a trained tzrec model.")
    app.state.service = service
    app.state.metrics = metrics

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        """One line naming the first bad field; the value is not echoed (it may be a NaN or
        an infinity, which JSON cannot carry back)."""
        first = exc.errors()[0]
        return _error(422, _field(tuple(first.get("loc", ()))), str(first.get("msg", "invalid")))

    @app.middleware("http")
    async def measure(request: Request, call_next: Any) -> Response:
        started = time.perf_counter()
        response = await call_next(request)
        path = request.url.path
        metrics.observe(path if path in _ENDPOINTS else "other", response.status_code,
                        time.perf_counter() - started)
        return response

    async def answer(make: Any) -> Any:
        """The batcher's answer to the request ``make()`` builds (parsing ids: a BadRequest
        is a 422 before anything is queued)."""
        try:
            future = service.batcher.submit(make())
        except Overloaded as exc:
            return _error(503, "queue", str(exc), **{"Retry-After": str(RETRY_AFTER_S)})
        except BadRequest as exc:
            return _error(422, exc.field, exc.message)
        try:
            return await asyncio.wrap_future(future)
        except Overloaded as exc:  # the database's writer has too many appends waiting
            return _error(503, "queue", str(exc), **{"Retry-After": str(RETRY_AFTER_S)})
        except BadRequest as exc:
            return _error(422, exc.field, exc.message)
        except NotFound as exc:
            return _error(404, exc.field, exc.message)

    @app.get("/recommend")
    async def recommend(
        user: Annotated[str, Query(min_length=1, max_length=MAX_ID_LENGTH)],
        k: Annotated[int, Query(ge=1)] = 10,
        exclude_seen: bool = True,
    ) -> Any:
        """The user's top ``k`` items, raw ids with scores, best first."""
        if not service.recommends:
            return _error(404, "recommend", f"the model ({service.info['model']}) scores "
                          "candidates: POST /score")
        if k > service.limits.num_items:
            return _error(422, "k", f"at most the {service.limits.num_items} items of the "
                          f"catalogue, got {k}")
        return await answer(lambda: Recommend(
            _parse("user", user, histories.parse_user), k, exclude_seen))

    @app.post("/score")
    async def score(body: ScoreBody) -> Any:
        """Per-task probabilities of the user's candidates."""
        if not service.scores:
            return _error(404, "score", f"the model ({service.info['model']}) recommends: "
                          "GET /recommend")
        most = service.limits.max_candidates
        if len(body.candidates) > most:
            return _error(422, "candidates", f"at most {most} (the model's max_targets), "
                          f"got {len(body.candidates)}")
        return await answer(lambda: Score(
            _parse("user", body.user, histories.parse_user),
            _parse_all("candidates", body.candidates, histories.parse_item)))

    @app.post("/events")
    async def events(body: EventsBody) -> Any:
        """Append the user's new events (stored before the answer)."""
        return await answer(lambda: Events(
            _parse("user", body.user, histories.parse_user),
            _parse_all("items", body.items, histories.parse_item),
            None if body.timestamps is None else tuple(body.timestamps),
            None if body.actions is None else tuple(body.actions)))

    @app.get("/healthz")
    async def healthz() -> Any:
        """The process answers."""
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> Any:
        """Ready once the batcher runs (the model and the histories are loaded by then) and
        while the database commits."""
        if service.engine.store.failed:
            return JSONResponse({"status": "database failed"}, 503)
        if not service.batcher.running:
            return JSONResponse({"status": "starting"}, 503,
                                headers={"Retry-After": str(RETRY_AFTER_S)})
        return {"status": "ready"}

    @app.get("/info")
    async def info() -> Any:
        """The model, the data and their fingerprints."""
        return {**service.info, "stored_events": service.engine.store.count(),
                "users_with_events": histories.appended_users}

    @app.get("/metrics")
    async def prometheus() -> Response:
        """Prometheus metrics."""
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app
